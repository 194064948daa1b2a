"""Tracking (JSONL truncation on resume, acceptance table + plot, missing packages skipped with one warning) and
training setup helpers (frozen target tensors read from files, EOS coverage, the train signature)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

from speculators.core.errors import SpeculatorsError
from speculators.core.tracking import Tracker, read_jsonl

ROWS = [{"k": 1, "acceptance": 0.6, "chain_reach": 0.6, "top1_accuracy": 0.6},
        {"k": 2, "acceptance": 0.5, "chain_reach": 0.3, "top1_accuracy": 0.4}]


def test_jsonl_records_table_and_plot(tmp_path: Path) -> None:
    tr = Tracker(tmp_path, ["jsonl"], run_name="t", config={})
    for s in range(1, 5):
        tr.log({"loss": 1.0 / s, "top1_accuracy": [0.1, 0.2]}, s)
    tr.log_acceptance(4, ROWS, {"simulated_tau": 1.9}, tmp_path / "plots" / "a.png")
    tr.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    ev = [r for r in recs if r["kind"] == "eval"][0]
    assert ev["acceptance_table"] == ROWS and ev["simulated_tau"] == 1.9
    assert (tmp_path / "plots" / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_drops_the_crashed_tail_and_fresh_runs_start_clean(tmp_path: Path) -> None:
    tr = Tracker(tmp_path, ["jsonl"], run_name="t", config={})
    for s in range(1, 7):
        tr.log({"loss": float(s)}, s)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 7, "kind": "tr')  # a line cut by SIGKILL
    tr.close()
    Tracker(tmp_path, ["jsonl"], run_name="t", config={}, resume_step=4).close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    Tracker(tmp_path, ["jsonl"], run_name="t", config={}).close()
    assert not (tmp_path / "metrics.jsonl").exists() or read_jsonl(tmp_path / "metrics.jsonl") == []


def test_missing_tracker_packages_are_skipped_with_one_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb" or name.startswith("torch.utils.tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    tr = Tracker(tmp_path, ["jsonl", "tensorboard", "wandb"], run_name="t", config={})
    tr.log({"loss": 1.0}, 1)
    tr.close()
    warnings = [r for r in caplog.records if r.name.startswith("speculators")]
    assert len(warnings) == 2 and all(r.levelname == "WARNING" and "is not installed" in r.getMessage()
                                      for r in warnings)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"] == 1.0


def test_unknown_tracker_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SpeculatorsError, match="unknown tracker"):
        Tracker(tmp_path, ["jsonl", "mlflow"], run_name="t", config={})


def test_disabled_tracker_writes_nothing(tmp_path: Path) -> None:
    tr = Tracker(tmp_path / "logs", ["jsonl", "tensorboard"], run_name="t", config={}, enabled=False)
    tr.log({"loss": 1.0}, 1)
    tr.close()
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_moe"])
def test_frozen_target_weights_equal_a_full_load(fixture: str, request) -> None:
    from transformers import AutoModelForCausalLM

    from speculators.core.config import TargetConfig
    from speculators.models.io import target_weights
    from speculators.train.setup import frozen_target_weights

    path = request.getfixturevalue(fixture)
    config, weights = frozen_target_weights(TargetConfig(name_or_path=str(path)))
    full = target_weights(AutoModelForCausalLM.from_pretrained(path))
    for name in ("embed_tokens", "lm_head", "final_norm"):
        assert torch.equal(getattr(weights, name), getattr(full, name).float()), name
    assert config.num_hidden_layers == 8
    assert frozen_target_weights(TargetConfig(name_or_path=str(path), adapter="some/adapter")) is None


def test_eos_coverage_check() -> None:
    from speculators.train.setup import check_eos_covered

    d2t = torch.tensor([0, 0, 1, 1])  # draft ids 0..3 -> target ids 0, 1, 3, 4
    check_eos_covered(d2t, [3, 4], "test")
    with pytest.raises(SpeculatorsError, match=r"EOS token id\(s\) \[2\]"):
        check_eos_covered(d2t, [2, 3], "test")


def test_train_signature_ignores_launch_and_logging_settings() -> None:
    from speculators.core.recipes import load_recipe
    from speculators.train.setup import train_signature

    base = load_recipe(None, [])
    same = load_recipe(None, ["train.num_processes=4", "train.trackers=[jsonl]", "train.resume=never",
                              "train.eval_every=7"])
    other = load_recipe(None, ["train.lr=1e-5"])
    assert train_signature(base) == train_signature(same) != train_signature(other)
    assert json.dumps(train_signature(base))


def test_wandb_mode_honours_wandb_login(tmp_path: Path) -> None:
    from speculators.core.tracking import wandb_mode

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == ("disabled", "WANDB_MODE")
    assert wandb_mode({"WANDB_API_KEY": "x" * 40, "HOME": str(tmp_path)}) == ("online", "WANDB_API_KEY")
    assert wandb_mode({"NETRC": str(netrc)})[0] == "online" and "wandb login" in wandb_mode({"NETRC": str(netrc)})[1]
    assert wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})[0] == "offline"
    assert wandb_mode({"HOME": str(tmp_path / "nobody")})[0] == "offline"


def test_wandb_run_from_the_recipe_with_the_evaluation(tmp_path: Path, caplog) -> None:
    """A real offline W&B run (no network): entity / project / group / tags from the recipe, training metrics, one
    line saying how to upload it, then the evaluation report logged to the same run."""
    import logging

    from speculators.core.recipes import load_recipe
    from speculators.core.tracking import RUN_ID_FILE, log_evaluation, wandb_options
    from tests.unit.train.wandb_records import offline_run

    recipe = load_recipe(None, ["train.wandb_project=spec-proj", "train.wandb_entity=spec-team",
                                "train.wandb_group=house", "train.wandb_tags=[eagle3, cpu]"])
    options = wandb_options(recipe.train)
    with caplog.at_level(logging.INFO, logger="speculators"):
        tr = Tracker(tmp_path, ["jsonl", "wandb"], run_name="t", config={"lr": 1e-3}, wandb=options)
        for s in range(1, 4):
            tr.log({"loss": 1.0 / s}, s)
        tr.log_acceptance(3, ROWS, {"simulated_tau": 1.9}, tmp_path / "plots" / "a.png")
        tr.close()
        selection = {"best": "step-0000003", "best_step": 3, "metric": "mean simulated tau at T=0.0",
                     "summary": {"0.0": {"tau": {"code": 2.5, "prose": 1.5}, "mean_tau": 2.0,
                                         "ngram_tau": {"code": 1.8, "prose": 1.1}, "ngram_mean_tau": 1.45}},
                     "live": {"0.0": {"speculator": {"cohorts": {"code": {"tau": 2.4}}}}}}
        assert log_evaluation(tmp_path, options, selection, {"selection": tmp_path / "plots" / "a.png"})
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"upload it with: wandb sync {tmp_path}/wandb/offline-run-*-{run_id}" in m for m in lines), lines
    rec = offline_run(tmp_path, run_id)
    assert rec["run"][0] == ("spec-proj", "spec-team", "house", ["eagle3", "cpu"])
    assert [h["train/loss"] for h in rec["history"] if "train/loss" in h] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert any(h.get("eval/acceptance_table/_type") == "table-file" for h in rec["history"])
    evaluation = next(h for h in rec["history"] if "eval/cohort_tau/_type" in h)  # nested keys, flattened
    assert evaluation["eval/cohort_tau/nrows"] == 2 and evaluation["eval/selection/_type"] == "image-file"
    assert rec["summary"]["eval/best_checkpoint"] == "step-0000003" and rec["summary"]["eval/mean_tau@T=0.0"] == 2.0
