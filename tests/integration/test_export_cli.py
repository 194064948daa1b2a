"""`speculators evaluate` and `speculators export` through the real CLI on the house target, bad input included.

The run dir holds two untrained EAGLE-3 checkpoints (written exactly as the train stage writes them): the test is
about the plumbing — held-out reports, checkpoint choice, live runtime numbers, a vLLM-valid export with pairing,
report and launch command — not about acceptance values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "evaluate"))
from evalexport_helpers import build_speculator, save_checkpoint, small_workloads  # noqa: E402

from speculators.core.recipes import load_recipe  # noqa: E402
from speculators.core.target import fingerprint_target, load_target  # noqa: E402
from speculators.export.validate import validate_vllm_export  # noqa: E402
from tests.integration.cli_helpers import cli_here  # noqa: E402

pytestmark = pytest.mark.integration
CLI = str(Path(sys.executable).parent / "speculators")


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: one torch thread per process avoids spinning
    res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"speculators {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


@pytest.fixture(scope="module")
def run_recipe(tmp_path_factory, house_target: Path) -> Path:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("eval-export-cli")
    wl = small_workloads(tmp / "workloads.jsonl", rows_per_cohort=1, max_new_tokens=16,
                         cohorts=("code-completion", "json-tool-call", "short-output"))
    data = {"name": "cli-eagle3", "run_dir": str(tmp / "run"), "target": {"name_or_path": str(house_target),
                                                                            "device": "cpu"},
            "speculator": {"family": "eagle3", "num_steps": 3, "draft_vocab_size": 2048},
            "evaluate": {"workloads": [str(wl)], "temperatures": [0.0, 1.0], "depth": 3, "live": True,
                         "live_rows_per_cohort": 1},
            "export": {"speculative_tokens": 3, "concurrencies": [1, 4]}}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    loaded = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    for i, step in enumerate((100, 200)):
        save_checkpoint(recipe, build_speculator(recipe, loaded, seed=i), step, fp, val_loss=1.0 / (i + 1))
    return path


def test_evaluate_then_export_through_the_cli(run_recipe: Path) -> None:
    recipe = load_recipe(run_recipe)
    res = _cli("evaluate", str(run_recipe))
    assert "best" in res.stdout and "n-gram" in res.stdout
    sel = json.loads((recipe.paths.eval / "selection.json").read_text())
    assert (recipe.paths.checkpoints / "best").read_text().strip() == sel["best"]
    rep = json.loads((recipe.paths.eval / sel["best"] / "report.json").read_text())
    assert rep["cohorts"] == ["code-completion", "json-tool-call", "short-output"]
    assert set(rep["temperatures"]) == {"0.0", "1.0"}
    assert rep["live"]["0.0"]["speculator"]["overall"]["target_calls"] > 0
    assert rep["live"]["0.0"]["ngram_live"]["overall"]["target_calls"] > 0
    for name in ("report.md", "per_position.png", "tau.png"):
        assert (recipe.paths.eval / sel["best"] / name).is_file()
    res = _cli("run", str(run_recipe), "--only", "evaluate")
    assert "skipped" in res.stdout  # complete outputs are not redone

    res = _cli("export", str(run_recipe))
    out = recipe.paths.export
    assert validate_vllm_export(out) == []
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_config"]["verifier"]["name_or_path"] == str(
        Path(recipe.target.name_or_path).resolve())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["draft_vocab_size"] == 2048
    pairing = json.loads((out / "pairing.json").read_text())
    assert pairing["evaluation"]["checkpoint"] == sel["best"]
    assert pairing["export"]["source_checkpoint"].endswith(sel["best"])
    launch = (out / "launch.sh").read_text()
    assert "vllm serve" in launch and "cost(k=1..) at concurrency 1" in launch
    assert "How k and the schedule were chosen" in (out / "README.md").read_text()
    res = _cli("run", str(run_recipe), "--only", "evaluate,export")
    assert res.stdout.count("skipped") == 2


def test_bad_input_is_one_line_and_exit_2(run_recipe: Path, tmp_path: Path) -> None:
    res = _cli("export", str(run_recipe), "speculator.family=medusa", check=False)
    assert res.returncode == 2 and res.stderr.startswith("error: ")
    assert "eagle3 speculator but the recipe says speculator.family=medusa" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = cli_here("evaluate", str(run_recipe), f"run_dir={tmp_path / 'empty'}")
    assert res.returncode == 2 and "no checkpoints to evaluate" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = cli_here("export", str(run_recipe), f"run_dir={tmp_path / 'empty'}")
    assert res.returncode == 2 and "no checkpoints to export" in res.stderr
    assert not (tmp_path / "empty" / "export").exists()
