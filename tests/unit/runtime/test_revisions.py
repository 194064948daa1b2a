"""Draft revisions swapped under a running engine (runtime/revisions.py) and the adoption gate
(evaluate/adoption.py): a swap between cycles drops no request and keeps T = 0 identity, a rollback returns to the
previous revision, each revision's acceptance is counted apart, a revision of another kind or target is refused, and
the gate adopts the revision that drafts better on recorded traffic, never a damaged one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.evaluate.adoption import compare_revisions
from speculators.models.io import target_weights
from speculators.runtime.batching import BatchRunner
from speculators.runtime.recording import RecordingSpec
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import hf_model, loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPTS = ["def f(x):", "a b c a b c a b", "import os\nimport sys\n", "x = 1\ny = 2\nz =", "class A:\n    def"]


@pytest.fixture(scope="module")
def revs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("revs")
    return {"a": make_speculator_dir(tiny_llama, "eagle3", root / "a", seed=3, num_steps=2),
            "b": make_speculator_dir(tiny_llama, "eagle3", root / "b", seed=4, num_steps=2),
            "medusa": make_speculator_dir(tiny_llama, "medusa", root / "medusa", seed=3)}


def _name(d: Path) -> str:
    return json.loads((d / "pairing.json").read_text())["draft"]["revision"]


def test_a_swap_under_concurrent_requests_drops_none_and_keeps_t0_identity(tiny_llama, revs) -> None:
    target = loaded_target(str(tiny_llama))
    plain = Engine.from_pretrained(target, "none", max_len=128)
    want = [plain.generate(p, SamplingParams(max_new_tokens=30)).token_ids for p in PROMPTS]
    engine = Engine.from_pretrained(target, str(revs["a"]), max_len=128)
    runner = BatchRunner(engine, max_batch=3)
    tickets = [runner.add(engine.encode(p), SamplingParams(max_new_tokens=30)) for p in PROMPTS]
    for _ in range(4):
        runner.step()
    assert len(runner.running) == 3, "the swap must land while requests are running"
    assert engine.stage_revision(str(revs["b"])) == _name(revs["b"])
    runner.run()
    assert all(t.done and t.error is None for t in tickets), "a request was dropped"
    assert [t.output.token_ids for t in tickets] == want, "a swap changed the tokens served at T = 0"
    assert engine.revisions.swaps == 1 and engine.revisions.running == _name(revs["b"])
    assert set(engine.revisions.stats) == {_name(revs["a"]), _name(revs["b"])}
    assert all(s.target_calls > 0 for s in engine.revisions.stats.values())
    assert sum(t.output.stats.work.restarts for t in tickets) >= 3, "running requests were not rebound"
    sampled = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
    assert len(sampled.token_ids) == 12 or sampled.finish_reason == "stop"
    # rollback: the previous revision comes back at the next cycle
    assert engine.stage_revision(None) == _name(revs["a"])
    assert engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=10)).token_ids == want[1][:10]
    assert engine.revisions.running == _name(revs["a"]) and engine.revisions.swaps == 2


def test_revisions_of_another_kind_or_target_are_refused(tiny_llama, revs, tmp_path) -> None:
    from tests.conftest import make_tiny_target

    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(revs["a"]), max_len=128)
    with pytest.raises(SpeculatorsError, match="only a revision of the same kind"):
        engine.stage_revision(str(revs["medusa"]))
    other = make_tiny_target(tmp_path / "other", seed=11)
    with pytest.raises(PairingError, match="revision"):
        engine.stage_revision(str(make_speculator_dir(other, "eagle3", tmp_path / "foreign", num_steps=2)))
    with pytest.raises(SpeculatorsError, match="no previous draft revision"):
        engine.stage_revision(None)
    assert engine.revisions.staged is None
    lookup = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)
    with pytest.raises(SpeculatorsError, match="not a draft model"):
        lookup.stage_revision(str(revs["a"]))


def _damaged_copy(src: Path, dst: Path) -> Path:
    """`src` with its output head's rows scrambled, re-paired: the files still load, only acceptance can tell."""
    from speculators.core.pairing import draft_revision

    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["lm_head.weight"] = torch.roll(tensors["lm_head.weight"], 7, dims=0)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    pairing = json.loads((dst / "pairing.json").read_text())
    pairing["draft"]["revision"] = draft_revision(dst)
    (dst / "pairing.json").write_text(json.dumps(pairing))
    return dst


def test_the_gate_adopts_a_revision_trained_on_the_traffic_and_never_a_damaged_one(tiny_llama, revs, tmp_path) -> None:
    from speculators.data import traffic
    from speculators.train.train import run as train_run
    from tests.unit.train.train_helpers import load

    target = loaded_target(str(tiny_llama))
    engine = Engine.from_pretrained(target, str(revs["a"]), max_len=128)
    engine.record_to(RecordingSpec(tmp_path / "rec"))
    for p in PROMPTS:
        engine.generate(p, SamplingParams(max_new_tokens=24))
    # a revision that continues (a) on this traffic until it drafts the target's own continuations
    recipe = load({"name": "gate", "run_dir": str(tmp_path / "run"), "target": {"name_or_path": str(tiny_llama)},
                   "data": {"sources": [{"traffic": str(tmp_path / "rec")}], "val_fraction": 0.0},
                   "capture": {"mode": "offline"}, "speculator": {"family": "eagle3", "num_steps": 2},
                   "train": {"max_steps": 60, "batch_size": 5, "lr": 3e-3, "warmup_ratio": 0.0, "eval_every": 0,
                             "save_every": 0, "trackers": ["jsonl"], "curve_points": 0, "init_from": str(revs["a"])}})
    traffic.run(recipe)
    train_run(recipe)
    trained = recipe.paths.checkpoints / "step-0000060"
    weights = target_weights(hf_model(str(tiny_llama)))
    rows = [(str(tmp_path / "rec"), i) for i in range(5)]
    same = compare_revisions(revs["a"], revs["a"], rows, depth=2, target_weights=weights)
    assert not same["adopt"] and same["tau_running"] == same["tau_candidate"] >= 1.0
    better = compare_revisions(revs["a"], trained, rows, depth=2, target_weights=weights)
    assert better["adopt"] and better["tau_candidate"] > better["tau_running"] + 0.3, better
    damaged = _damaged_copy(trained, tmp_path / "damaged")
    verdict = compare_revisions(trained, damaged, rows, depth=2, target_weights=weights)
    assert not verdict["adopt"] and verdict["tau_candidate"] < verdict["tau_running"], verdict
