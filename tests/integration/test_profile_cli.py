"""`speculators profile` (the speedup oracle) through the real CLI: a named shape with random weights and random
heads on CPU, the check against measured generation on the house target, and bad input. Budgets are small: these
tests check what the report holds, never how fast anything ran: what a slow runner could not measure in
the budget must be named as skipped."""

from __future__ import annotations

import json

import pytest

from speculators.core.metrics import simulated_tau
from tests.integration.cli_helpers import cli, cli_here, error_line
from tests.unit.runtime.runtime_helpers import make_speculator_dir

pytestmark = pytest.mark.integration


def _check_prediction_row(row: dict, acceptance: list[float]) -> None:
    """One batch size's prediction is consistent: each chain's tau is the acceptance's, its speedup is its tokens/s
    over plain's, and `best` is the fastest candidate, or plain when none beats plain (speedup exactly 1)."""
    b, plain = row["batch"], row["plain_tokens_per_s"]
    assert plain > 0 and plain == pytest.approx(b * 1000 / row["plain_step_ms"], rel=1e-3)
    for c in row["candidates"]:
        assert c["tau"] == pytest.approx(simulated_tau(acceptance[:c["depth"]]), abs=1e-4), c
        assert c["tokens_per_s"] == pytest.approx(b * 1000 * c["tau"] / c["step_ms"], rel=1e-3), c
        assert c["speedup"] == pytest.approx(c["tokens_per_s"] / plain, rel=1e-3, abs=1e-4), c
    fastest = max(row["candidates"], key=lambda c: c["speedup"])
    if fastest["speedup"] > 1.0:
        assert row["best"] == fastest
    else:
        assert (row["best"]["kind"], row["best"]["depth"], row["best"]["speedup"]) == ("plain", 0, 1.0)
        assert row["best"]["tokens_per_s"] == plain


def test_profile_of_a_shape_with_random_heads(tmp_path) -> None:
    acceptance = [0.8, 0.7, 0.6]
    out = tmp_path / "profile"
    proc = cli("profile", "--shape", "tiny-llama", "--acceptance", ",".join(map(str, acceptance)), "--batch-sizes",
               "1,2", "--nodes", "1,2,4,8", "--max-depth", "3", "--context-len", "32", "--budget-s", "60", "--device",
               "cpu", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# speculators profile — shape:tiny-llama" in proc.stdout and "vLLM schedule" in proc.stdout
    report = json.loads((out / "profile.json").read_text())
    assert (out / "profile.md").read_text().startswith("# speculators profile")
    assert report["format"] == "speculators.profile/v1" and report["shape"]["hidden_size"] == 128
    # the grid is measured inside the time budget: batch 1 always; a batch size it ran out of time for is named
    # as skipped (a slow or busy runner), never silently missing
    measured = {int(b) for b in report["target_forward_ms"]}
    out_of_time = {b for b in (1, 2) if f"target forward at batch {b}: time budget" in report["skipped"]}
    assert 1 in measured and measured | out_of_time == {1, 2} and not measured & out_of_time, report["skipped"]
    for b in measured:
        assert set(report["target_forward_ms"][str(b)]) == {"1", "2", "4", "8"}
        assert all(ms > 0 for ms in report["target_forward_ms"][str(b)].values())
    assert set(report["drafters"]) == {"eagle3", "medusa", "mtp", "dflash"}  # a literal acceptance: every family
    for family, rows in report["predictions"].items():
        assert [r["batch"] for r in rows] == sorted(measured)
        for r in rows:
            chains = [c for c in r["candidates"] if c["kind"] == "chain"]
            assert [c["depth"] for c in chains] == [1, 2, 3]
            _check_prediction_row(r, acceptance)
        sched = report["schedule"][family]
        assert sched["rows"][0]["start_bs"] == 1 and sched["rows"][-1]["end_bs"] == 512
        assert sched["speculative_config"]["num_speculative_tokens"] == max(r["k"] for r in sched["rows"])
    for b in measured:  # every measured batch has its plain step overhead, or says why not
        assert str(b) in report["overhead_ms"]["plain"] or any(
            s.startswith(f"runtime step at batch {b}, plain") for s in report["skipped"]), report["skipped"]
    assert report["check"] is None


def test_profile_checks_its_prediction_against_measured_generation(house_target, tmp_path) -> None:
    spec = make_speculator_dir(house_target, "eagle3", tmp_path / "eagle3")
    out = tmp_path / "profile"
    proc = cli("profile", "--target", str(house_target), "--speculator", str(spec), "--acceptance", "0.3,0.1",
               "--batch-sizes", "1", "--nodes", "1,2,3,4", "--max-depth", "2", "--context-len", "64",
               "--budget-s", "20", "--check-rows", "1", "--check-depths", "1,2", "--workloads",
               "data/workloads/[cs]*.jsonl", "--device", "cpu", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "## Check: predicted vs measured speedup" in proc.stdout
    check = json.loads((out / "profile.json").read_text())["check"]
    table = {(r["depth"], r["cohort"]): r for r in check["table"]}
    assert set(table) == {(d, c) for d in (1, 2) for c in ("code-completion", "copy-heavy", "short-output", "all")}
    for r in table.values():
        assert r["measured"] > 0 and r["predicted"] > 0 and r["live_tau"] >= 1.0
        assert "mismatched_rows" not in r  # fixed-depth chains reproduce plain decoding at T = 0
    assert "--tree chain --depth {K} --no-adaptive" in check["bench_command"]


def test_profile_bad_inputs_fail_with_one_line(house_target, tmp_path) -> None:
    base = ["profile", "--device", "cpu", "--budget-s", "5"]
    assert "exactly one of --target" in error_line(cli(*base, "--shape", "tiny-llama", "--target", "x"))
    # the rest through speculators.cli.main in this process (the console entry point is proven just above)
    assert "unknown model shape 'gpt-9'" in error_line(cli_here(*base, "--shape", "gpt-9"))
    assert "including 1" in error_line(cli_here(*base, "--shape", "tiny-llama", "--nodes", "2,4"))
    assert "--batch-sizes must be comma-separated integers" in error_line(
        cli_here(*base, "--shape", "tiny-llama", "--batch-sizes", "one"))
    assert "acceptance source nope not found" in error_line(
        cli_here(*base, "--shape", "tiny-llama", "--acceptance", "nope"))
    assert "--check-rows compares with measured generation" in error_line(
        cli_here(*base, "--shape", "tiny-llama", "--check-rows", "2"))
    assert "more than 70% of the" in error_line(  # counted on the meta device: nothing allocated
        cli_here(*base, "--shape", "llama-3.1-70b", "--dtype", "float32", "--slice", "never"))
    assert "--slice must be auto, always or never" in error_line(
        cli_here(*base, "--shape", "tiny-llama", "--slice", "x"))
    out = tmp_path / "keep"
    out.mkdir()
    (out / "profile.json").write_text("old")
    error_line(cli_here(*base, "--shape", "tiny-llama", "--acceptance", "2,3", "--out", str(out)))
    assert (out / "profile.json").read_text() == "old"  # nothing already written is lost
