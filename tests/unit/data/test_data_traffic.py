"""Training from served traffic (data/traffic.py, train.init_from, the weighted loss): recorded rows + a replay share
become weighted feature shards, a new revision continues the running one's weights on them, and a recording of
another target (or a revision of another target) is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.data import traffic
from speculators.data.shards import FeatureStore
from speculators.models.io import load_speculator, target_weights
from speculators.runtime.recording import RecordingSpec
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import hf_model, loaded_target, make_speculator_dir
from tests.unit.train.train_helpers import load, merge

PROMPTS = ["def f(x):", "a b c a b c a b", "import os\nimport sys\n", "x = 1\ny = 2\nz =", "class A:\n    def"]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """A random EAGLE-3 revision of the tiny target, and a recording of it serving the prompts (T = 0 and T = 1)."""
    root = tmp_path_factory.mktemp("traffic")
    torch.set_num_threads(1)
    spec = make_speculator_dir(tiny_llama, "eagle3", root / "rev0", seed=2, num_steps=2)
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(spec), max_len=128)
    engine.record_to(RecordingSpec(root / "rec"))
    for i, p in enumerate(PROMPTS * 2):
        engine.generate(p, SamplingParams(max_new_tokens=20, temperature=0.0 if i < 5 else 1.0, seed=i))
    return {"spec": spec, "rec": root / "rec", "root": root}


def _recipe(run_dir: Path, target: Path, served: dict, **sections) -> dict:
    d = {"name": "adapt-test", "run_dir": str(run_dir), "seed": 0, "target": {"name_or_path": str(target)},
         "data": {"sources": [{"traffic": str(served["rec"])}], "val_fraction": 0.2},
         "capture": {"mode": "offline", "shard_tokens": 96},
         "speculator": {"family": "eagle3", "num_steps": 2},
         "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-3, "eval_every": 0, "save_every": 0, "log_every": 1,
                   "trackers": ["jsonl"], "curve_points": 0, "init_from": str(served["spec"])}}
    return merge(d, sections)


def test_traffic_rows_are_weighted_and_training_continues_the_running_revision(tmp_path, tiny_llama, served) -> None:
    from speculators.train.train import run as train_run

    recipe = load(_recipe(tmp_path / "run", tiny_llama, served))
    assert traffic.enabled(recipe) and not traffic.is_complete(recipe)
    summary = traffic.run(recipe)
    assert summary["recorded_rows"] == 10 and summary["replayed_rows"] == 0
    assert traffic.is_complete(recipe)
    store, rec = FeatureStore(recipe.paths.features), FeatureStore(served["rec"])
    store.verify()
    assert len(store) == 10 and store.manifest["traffic"]["mean_recorded_weight"] > 1.0
    for i in range(len(store)):
        got, raw = store.sequence(i), rec.sequence(i)
        assert torch.equal(got["input_ids"], raw["input_ids"]) and torch.equal(got["loss_mask"], raw["loss_mask"])
        torch.testing.assert_close(got["taps"], raw["taps"])  # the same int8 values, re-encoded
        want = traffic.position_weights(rec, i, 1.0, 2.0)
        assert torch.equal(got["position_weight"], want)
        rows = rec.token_tensor(i, "cycle_start").bool()[1:]  # the training row of a cycle rooted at r is r - 1
        assert bool((want[:-1][rows] >= 2.0).all()) and bool((want[:-1][~rows] <= 3.0).all())
    # a cycle whose draft was cut short puts the rejected weight on row r - 1 + accepted
    rows = [(i, rec.token_tensor(i, "cycle_start"), rec.token_tensor(i, "draft_depth"),
             rec.token_tensor(i, "draft_accepted")) for i in range(len(rec))]
    i, start, depth, acc = next((i, s, d, a) for i, s, d, a in rows if bool(((d > a) & (s > 0)).any()))
    root = int(((depth > acc) & (start > 0)).nonzero()[0])
    assert float(traffic.position_weights(rec, i, 1.0, 2.0)[root - 1 + int(acc[root])]) >= 3.0
    out = train_run(recipe)
    assert out["steps"] == 3
    weights = target_weights(hf_model(str(tiny_llama)))
    before = load_speculator(served["spec"], weights)
    after = load_speculator(recipe.paths.checkpoints / "step-0000003", weights)
    moved = [n for n, p in after.state_dict().items() if not torch.equal(p, before.state_dict()[n].to(p.dtype))]
    assert moved and "fc.weight" in moved, "training did not continue from the revision's weights"
    assert torch.equal(after.state_dict()["embed_tokens.weight"], before.state_dict()["embed_tokens.weight"])
    drift = (after.state_dict()["fc.weight"] - before.state_dict()["fc.weight"]).abs().max()
    assert float(drift) < 0.05, "a few small steps moved the weights far: init_from was not applied"


def test_replay_share_and_the_refusals(tmp_path, tiny_llama, served) -> None:
    from tests.conftest import make_tiny_target

    base = load(_recipe(tmp_path / "run", tiny_llama, served))
    traffic.run(base)
    replay = str(base.paths.features)
    mixed = load(_recipe(tmp_path / "run2", tiny_llama, served, data={"traffic": {"replay": replay,
                                                                                    "replay_share": 0.5}}))
    summary = traffic.run(mixed)
    assert summary["replayed_rows"] >= 1 and 0 < summary["replayed_tokens"]
    assert summary["replayed_tokens"] <= summary["recorded_tokens"] * 0.5 + max(FeatureStore(replay).lengths())
    weights = [FeatureStore(mixed.paths.features).sequence(i)["position_weight"] for i in range(10, 10 + 1)]
    assert all(bool((w == 1.0).all()) for w in weights), "replayed rows weigh 1"
    other = make_tiny_target(tmp_path / "other", seed=7)
    with pytest.raises(PairingError, match="revision"):
        traffic.run(load(_recipe(tmp_path / "run3", other, served)))
    with pytest.raises(SpeculatorsError, match="mixes recordings"):
        _ = load(_recipe(tmp_path / "run4", tiny_llama, served, data={"sources": [{"traffic": str(served["rec"])},
                                                                                   {"path": "x.jsonl"}]})).traffic_dirs
    with pytest.raises(SpeculatorsError, match="not a recording"):
        traffic.run(load(_recipe(tmp_path / "run5", tiny_llama, served, data={"sources": [{"traffic": replay}]})))
    manifest = json.loads((served["rec"] / "manifest.json").read_text())
    assert manifest["recording"]["draft_revisions"] == [json.loads(
        (served["spec"] / "pairing.json").read_text())["draft"]["revision"]]


def test_init_from_a_revision_of_another_target_is_refused(tmp_path, tiny_llama, served) -> None:
    from speculators.train.train import run as train_run
    from tests.conftest import make_tiny_target

    other = make_tiny_target(tmp_path / "other", seed=9)
    foreign = make_speculator_dir(other, "eagle3", tmp_path / "foreign", num_steps=2)
    recipe = load(_recipe(tmp_path / "run", tiny_llama, served, train={"init_from": str(foreign)}))
    traffic.run(recipe)
    with pytest.raises(SpeculatorsError, match="init_from .* was trained for"):
        train_run(recipe)
    wrong = load(_recipe(tmp_path / "run2", tiny_llama, served, speculator={"num_steps": 2, "num_layers": 2}))
    traffic.run(wrong)
    with pytest.raises(SpeculatorsError, match="speculator settings"):
        train_run(wrong)
