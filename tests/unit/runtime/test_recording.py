"""Served traffic as training rows (runtime/recording.py): a recorded row equals a capture of the same tokens (within
int8 noise), its feedback matches the cycles that ran, recording changes no served token, the disk budget rotates
old rows, and a recording of another target is refused."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.core.feature_codec import stored_teacher_positions
from speculators.data.features import compute_features
from speculators.data.shards import FeatureStore
from speculators.models.base import FeatureRequest
from speculators.runtime.batching import generate_batch
from speculators.runtime.recording import RecordingSpec
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.oracle_drafter import OracleDrafter
from tests.unit.runtime.runtime_helpers import hf_model, loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPTS = ["def f(x):", "a b c a b c a b", "import os\nimport sys\n", "x"]


def _capture_of(model, ids: list[int], layers: list[int], k: int) -> dict[str, torch.Tensor]:
    """What capture computes for these tokens: one HF forward (taps + top-k teacher), float32."""
    request = FeatureRequest(tap_layer_ids=tuple(layers), last_hidden=False)
    feats = compute_features(model, torch.tensor([ids]), None, request, teacher="topk", topk=k)
    return {name: v[0] for name, v in feats.items()}


def assert_row_equals_capture(store: FeatureStore, i: int, model, layers: list[int]) -> None:
    row = store.sequence(i)
    ids = row["input_ids"].tolist()
    want = _capture_of(model, ids, layers, int(store.manifest["teacher_topk"]))
    forwarded = slice(0, len(ids) - 1)  # the last token is never forwarded: its taps are zeros by contract
    got, ref = row["taps"][forwarded], want["taps"][forwarded]
    assert float((got - ref).norm() / ref.norm()) < 0.01, "recorded taps differ from a capture beyond int8 noise"
    assert float(row["taps"][-1].abs().max()) == 0.0
    pos = stored_teacher_positions(row["loss_mask"])
    assert int(pos.sum()) == int(row["loss_mask"].sum()), "one teacher row per generated token"
    got_lp, ref_lp = row["teacher_topk_logprobs"][pos], want["teacher_topk_logprobs"][pos]
    torch.testing.assert_close(got_lp, ref_lp.to(torch.float16).float(), atol=2e-2, rtol=2e-3)
    # ids agree wherever the target's log-probabilities are not tied (fp32 rounding may order exact near-ties)
    gaps = (ref_lp[:, :-1] - ref_lp[:, 1:]).abs() > 1e-4  # [M, k-1]
    same = row["teacher_topk_ids"][pos] == want["teacher_topk_ids"][pos]
    assert bool(same[:, :1][gaps[:, :1]].all()), "the top-1 teacher id differs where it is not a tie"
    assert float(same.float().mean()) > 0.95


@pytest.mark.parametrize("drafter", ["none", "ngram", "eagle3", "oracle"])
def test_recorded_rows_equal_a_capture_of_the_same_tokens(tiny_llama, tmp_path, drafter: str) -> None:
    target = loaded_target(str(tiny_llama))
    if drafter == "oracle":  # drafts with the target itself behind decoys: deep accepted paths with gaps
        engine = Engine(target, OracleDrafter(hf_model(str(tiny_llama))), max_len=128,
                        adaptive=False)  # fixed trees: a busy machine's timings never turn drafting off
    else:
        spec = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "eagle3") if drafter == "eagle3" else drafter
        engine = Engine.from_pretrained(target, str(spec), max_len=128)
    plain = [engine.generate(p, SamplingParams(max_new_tokens=12)).token_ids for p in PROMPTS]
    recorder = engine.record_to(RecordingSpec(tmp_path / "rec"))
    outs = [engine.generate(p, SamplingParams(max_new_tokens=12)) for p in PROMPTS]
    sampled = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=1.0, seed=3))
    assert [o.token_ids for o in outs] == plain, "recording changed the tokens served at T = 0"
    assert recorder.rows_written == len(PROMPTS) + 1 and recorder.rows_skipped == 0
    store = FeatureStore(tmp_path / "rec")
    store.verify()
    store.check_target(recorder.target)
    assert store.layer_ids == recorder.layer_ids
    if drafter == "eagle3":  # the drafter's own taps are the ones recorded
        assert recorder.layer_ids == list(engine.drafter.required_features().tap_layer_ids)
    for i, out in enumerate([*outs, sampled]):
        row = store.sequence(i)
        assert row["input_ids"].tolist() == out.prompt_token_ids + out.token_ids
        assert row["loss_mask"].tolist() == [0] * len(out.prompt_token_ids) + [1] * len(out.token_ids)
        assert_row_equals_capture(store, i, hf_model(str(tiny_llama)), recorder.layer_ids)
    if drafter == "oracle":
        assert sum(o.stats.acceptance.accepted_tokens for o in outs) > len(PROMPTS), "no deep paths were exercised"


def test_feedback_matches_the_cycles_that_ran(tiny_llama, tmp_path) -> None:
    engine = Engine(loaded_target(str(tiny_llama)), OracleDrafter(hf_model(str(tiny_llama))), max_len=128,
                    adaptive=False)  # fixed trees: the plan controller's timing never turns drafting off
    engine.record_to(RecordingSpec(tmp_path / "rec"))
    out = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=16))
    path = sorted((tmp_path / "rec").glob("row-*.safetensors"))[0]
    from safetensors.torch import load_file

    t = load_file(str(path))
    starts = t["cycle_start"].nonzero().flatten().tolist()
    assert len(starts) == out.stats.target_calls, "one cycle start per verification forward"
    assert starts[0] == len(out.prompt_token_ids) - 1, "the first cycle drafts from the prompt's last token"
    accepted = t["draft_accepted"][starts]
    # each cycle commits its accepted drafts + one token: the next root sits right after them
    assert [b - a for a, b in zip(starts, starts[1:], strict=False)] == (accepted[:-1] + 1).tolist()
    nodes = t["draft_nodes"]
    assert int(nodes[:, 4].sum()) == int(accepted.sum()) == out.stats.acceptance.accepted_tokens
    assert set(nodes[:, 0].tolist()) <= set(starts) and int(t["draft_depth"][starts].max()) >= 2


def test_batched_requests_are_recorded_and_rotated_within_the_budget(tiny_llama, tmp_path) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)
    engine.record_to(RecordingSpec(tmp_path / "rec", budget_bytes=1 << 20))
    generate_batch(engine, PROMPTS * 3, [SamplingParams(max_new_tokens=40)] * 12, max_batch=3)
    one = json.loads((tmp_path / "rec" / "manifest.json").read_text())["shards"][0]["bytes"]
    budget = 3 * one + one // 2  # room for three rows
    rec = engine.record_to(RecordingSpec(tmp_path / "rec2", budget_bytes=max(budget, 1 << 20)))
    rec.spec.budget_bytes = budget  # below the 1 MiB floor of the user-facing spec, to rotate with tiny rows
    for p in PROMPTS * 2:
        engine.generate(p, SamplingParams(max_new_tokens=40))
    manifest = json.loads((tmp_path / "rec2" / "manifest.json").read_text())
    files = sorted(p.name for p in (tmp_path / "rec2").glob("row-*.safetensors"))
    assert files == sorted(e["file"] for e in manifest["shards"]), "the manifest lists exactly the rows on disk"
    assert len(files) < len(PROMPTS) * 2 and sum(e["bytes"] for e in manifest["shards"]) <= budget
    assert files[-1] == "row-000000008.safetensors", "the newest row is kept"
    FeatureStore(tmp_path / "rec2").verify()
    assert len(FeatureStore(tmp_path / "rec")) == 12


def test_a_recording_of_another_target_is_refused(tiny_llama, tmp_path) -> None:
    from tests.conftest import make_tiny_target

    other = make_tiny_target(tmp_path / "other", seed=5)
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "none", max_len=128)
    engine.record_to(RecordingSpec(tmp_path / "rec"))
    engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=4))
    engine2 = Engine.from_pretrained(loaded_target(str(other)), "none", max_len=128)
    with pytest.raises(PairingError, match="record into another directory"):
        engine2.record_to(RecordingSpec(tmp_path / "rec"))
    with pytest.raises(PairingError, match="revision"):  # training reads it as features of the recipe's target
        FeatureStore(tmp_path / "rec").check_target(engine2.recorder.target if engine2.recorder else
                                                    _fingerprint(other))
    with pytest.raises(SpeculatorsError, match="at least 1 MiB"):
        RecordingSpec(tmp_path / "x", budget_bytes=10)


def _fingerprint(path) -> dict:
    from speculators.runtime.drafters.load import target_fingerprint

    return target_fingerprint(loaded_target(str(path)))


def _synthetic_row(recorder, n_prompt: int = 3, n_out: int = 2):
    """A finished request's record without an engine (what the recorder's bookkeeping needs, random tensors)."""
    width, k = len(recorder.layer_ids) * recorder.hidden_size, recorder.spec.teacher_topk
    record = recorder.start(list(range(1, n_prompt + 1)), 0.0, torch.randn(n_prompt - 1, width))
    record.taps.append(torch.randn(n_out, width))
    record.teacher_ids.append(torch.randint(0, recorder.vocab_size, (n_out, k)))
    record.teacher_logprobs.append(-torch.rand(n_out, k))
    return record, list(range(7, 7 + n_out))


def _recorder(directory):
    from speculators.runtime.recording import TrafficRecorder

    target = {"name_or_path": "t", "revision": "r", "content_hash": "c" * 64}
    return TrafficRecorder(RecordingSpec(directory, teacher_topk=4), target=target, layer_ids=[0, 1], num_layers=2,
                           hidden_size=8, vocab_size=32)


def test_the_manifest_is_rewritten_in_proportion_and_rows_of_a_killed_process_are_adopted(tmp_path, monkeypatch
                                                                                         ) -> None:
    """Rewriting manifest.json costs O(rows): past 100 rows it lists new rows once they are 1% of all (or
    MANIFEST_EVERY_S passed, or at flush); a process killed before listing its last rows loses none of them."""
    from speculators.runtime import recording

    monkeypatch.setattr(recording, "MANIFEST_EVERY_S", 3600.0)
    rec = tmp_path / "rec"
    recorder = _recorder(rec)
    for _ in range(100):  # a small recording: every row listed at once
        recorder.write(*_synthetic_row(recorder), None)
    assert len(FeatureStore(rec)) == 100
    recorder.write(*_synthetic_row(recorder), None)  # 1 new row of 101 < 1%: written, not listed yet
    assert len(FeatureStore(rec)) == 100 and recorder.unlisted == 1
    recorder.write(*_synthetic_row(recorder), None)  # 2 of 102: listed
    assert len(FeatureStore(rec)) == 102 and recorder.unlisted == 0
    recorder.write(*_synthetic_row(recorder), None)
    assert len(FeatureStore(rec)) == 102 and len(list(rec.glob("row-*.safetensors"))) == 103
    del recorder  # killed: no flush
    reopened = _recorder(rec)  # the unlisted row is adopted and listed
    store = FeatureStore(rec)
    assert len(store) == 103 and reopened.unlisted == 0
    assert [e["index"] for e in store.manifest["shards"]] == list(range(1, 104))
    assert store.sequence(102)["input_ids"].tolist() == [1, 2, 3, 7, 8]
    reopened.write(*_synthetic_row(reopened), None)
    reopened.flush()
    assert len(FeatureStore(rec)) == 104 and reopened.next_index == 105
