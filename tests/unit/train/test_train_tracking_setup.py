"""Tracking (JSONL truncation on resume, acceptance table + plot, missing packages skipped with one warning) and
training setup helpers (frozen target tensors read from files, EOS coverage, the train signature)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.train.tracking import Tracker, read_jsonl

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


def test_missing_tracker_packages_are_skipped_with_one_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb" or name.startswith("torch.utils.tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    tr = Tracker(tmp_path, ["jsonl", "tensorboard", "wandb"], run_name="t", config={})
    tr.log({"loss": 1.0}, 1)
    tr.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 2 and all(line.startswith("warning:") for line in err)
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

    from speculators.config import TargetConfig
    from speculators.models.io import target_weights
    from speculators.train.loop import frozen_target_weights

    path = request.getfixturevalue(fixture)
    config, weights = frozen_target_weights(TargetConfig(name_or_path=str(path)))
    full = target_weights(AutoModelForCausalLM.from_pretrained(path))
    for name in ("embed_tokens", "lm_head", "final_norm"):
        assert torch.equal(getattr(weights, name), getattr(full, name).float()), name
    assert config.num_hidden_layers == 8
    assert frozen_target_weights(TargetConfig(name_or_path=str(path), adapter="some/adapter")) is None


def test_eos_coverage_check() -> None:
    from speculators.train.loop import check_eos_covered

    d2t = torch.tensor([0, 0, 1, 1])  # draft ids 0..3 -> target ids 0, 1, 3, 4
    check_eos_covered(d2t, [3, 4], "test")
    with pytest.raises(SpeculatorsError, match=r"EOS token id\(s\) \[2\]"):
        check_eos_covered(d2t, [2, 3], "test")


def test_train_signature_ignores_launch_and_logging_settings() -> None:
    from speculators.config import load_recipe
    from speculators.train.loop import train_signature

    base = load_recipe(None, [])
    same = load_recipe(None, ["train.num_processes=4", "train.trackers=[jsonl]", "train.resume=never",
                              "train.eval_every=7"])
    other = load_recipe(None, ["train.lr=1e-5"])
    assert train_signature(base) == train_signature(same) != train_signature(other)
    assert json.dumps(train_signature(base))
