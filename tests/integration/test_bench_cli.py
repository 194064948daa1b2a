"""`speculators bench` on the house target (the one the speculator's pairing.json names: no --target) prints its
table and writes JSON + Markdown, with every cohort of
methods (plain, n-gram, a speculator, HF generate, HF assisted, and each runtime method batched) at T=0 and T=1,
and at T=1 only the verifier comparisons (`--compare-verify`: sampled chain token-wise / block, sampled tree
token-wise / traversal); at T=0 every runtime method, batched or not, reproduces plain decoding token for token."""

from __future__ import annotations

import json

import pytest

from tests.integration.cli_helpers import cli, cli_here, error_line
from tests.unit.runtime.runtime_helpers import make_speculator_dir

pytestmark = pytest.mark.integration


def test_bench_table_and_report(house_target, tmp_path) -> None:
    spec = make_speculator_dir(house_target, "eagle3", tmp_path / "eagle3")
    out = tmp_path / "bench"
    proc = cli("bench", "--speculator", str(spec), "--workloads",  # the target: the one spec's pairing.json names
               "data/workloads/code-completion.jsonl", "--rows-per-cohort", "2", "--temperatures", "0,1", "--device", "cpu",
               "--batch", "2", "--compare-verify", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| cohort | method | tok/s | × plain | × HF generate | tau |" in proc.stdout
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().startswith(f"# speculators bench — {house_target} on cpu")
    runtime = ("plain", "ngram", "eagle3:eagle3", "eagle3+ngram:eagle3")  # + the graft row
    batched = tuple(f"{m}@batch2" for m in runtime)
    methods = {*runtime, *batched, "hf", "hf-assisted"}
    verify = {f"eagle3:eagle3 {v}" for v in ("chain token", "chain block", "sampled token", "sampled traversal")}
    for temperature in ("0.0", "1.0"):
        cohorts = report["results"][temperature]
        assert set(cohorts) == {"code-completion", "all"}
        assert set(cohorts["all"]) == (methods | verify if temperature == "1.0" else methods)
        assert not set(cohorts["code-completion"]) & set(batched)  # batched rows: the whole set only
        for name, entry in cohorts["all"].items():
            assert entry["tokens"] > 0 and entry["tokens_per_second"] > 0 and entry["vs_plain"] > 0
            if name in runtime + batched or name in verify:
                assert entry["tau"] >= 1.0
    for name in ("eagle3:eagle3 chain block", "eagle3:eagle3 sampled traversal"):  # paired: same drafts, both rules
        paired = report["results"]["1.0"]["all"][name]["paired_tau"]
        assert paired["cycles"] > 0 and paired["token"] >= 1.0 and paired["sequence"] >= 1.0
    assert "Paired on the" in proc.stdout
    greedy = report["results"]["0.0"]["all"]
    assert all(greedy[m]["mismatched_rows"] == 0 for m in (*runtime[1:], *batched, "hf", "hf-assisted"))
    assert "plain@batch2" in proc.stdout
    # the CPU is named and every runtime row says how its cycles were drafted (share of cycles per plan)
    assert "CPU" in report["machine"] and f"Machine: {report['machine']}" in proc.stdout
    for temperature in ("0.0", "1.0"):
        rows = report["results"][temperature]["all"]
        assert rows["plain"]["plan_share"] == {"plain": 1.0}
        for name in runtime[1:]:
            share = rows[name]["plan_share"]
            assert set(share) <= {"plain", "lookup", "model", "model+lookup"} and abs(sum(share.values()) - 1) < 0.01
        # where each method's cycles went: the cycle, its forward, drafting per drafted token, and per plan the
        # seconds the controller predicted against those measured
        assert rows["plain"]["cycle_ms"] > 0 and "draft_ms_per_drafted_token" not in rows["plain"]
        for name in runtime[1:]:
            e = rows[name]
            assert 0 < e["forward_ms"] <= e["cycle_ms"] and e["draft_ms_per_drafted_token"] > 0
            timed = e["plan_cycle_ms"]
            assert set(timed) <= set(e["plan_share"]) and sum(t["cycles"] for t in timed.values()) > 0
            assert all(t["predicted"] > 0 and t["measured"] > 0 for t in timed.values())
    assert "plain steps (its forward" in proc.stdout and "cycle predicted / measured per plan" in proc.stdout


def test_bench_bad_inputs_fail_with_one_line(house_target) -> None:
    base = ["bench", "--target", str(house_target), "--device", "cpu"]
    assert "--rows-per-cohort must be >= 1" in error_line(cli(*base, "--rows-per-cohort", "0"))
    assert "--batch must be >= 0" in error_line(cli_here(*base, "--batch", "-1"))
    assert "--temperatures must be non-negative" in error_line(cli_here(*base, "--temperatures", "-1"))


def test_bench_fixed_depth_chains_without_hf(house_target, tmp_path) -> None:
    spec = make_speculator_dir(house_target, "eagle3", tmp_path / "eagle3")
    proc = cli("bench", "--speculator", str(spec), "--workloads",  # the target: the one spec's pairing.json names
               "data/workloads/short-output.jsonl", "--rows-per-cohort", "1", "--temperatures", "0", "--device", "cpu",
               "--tree", "chain", "--depth", "2", "--no-adaptive", "--ngram-graft", "0", "--no-hf",
               "--out", str(tmp_path / "bench"), "--record", str(tmp_path / "rec"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["speculator_tree"] == {"kind": "chain", "depth": 2, "topk": 1, "budget": 2, "choices": None,
                                         "adaptive": False, "verify": "sequence"}
    assert set(report["results"]["0.0"]["all"]) == {"plain", "ngram", "eagle3:eagle3", "plain+record",
                                                    "eagle3:eagle3+record"}
    entry = report["results"]["0.0"]["all"]["eagle3:eagle3"]
    assert entry["vs_hf"] is None and entry["mismatched_rows"] == 0
    recorded = report["results"]["0.0"]["all"]["eagle3:eagle3+record"]
    assert recorded["mismatched_rows"] == 0 and recorded["tau"] == entry["tau"]  # recording changes no token
    manifest = json.loads((tmp_path / "rec" / "eagle3-eagle3" / "manifest.json").read_text())
    assert manifest["counts"]["sequences"] >= 1 and manifest["recording"]["kind"] == "traffic"
    assert "--tree must be one of dynamic, static, chain, sampled, best_first" in error_line(
        cli_here("bench", "--target", str(house_target), "--tree", "forest", "--device", "cpu"))
    assert "--depth must be >= 1" in error_line(cli_here("bench", "--target", str(house_target), "--depth", "0"))
