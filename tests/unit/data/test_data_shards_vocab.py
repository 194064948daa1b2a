"""Shard format pieces (int8 quantisation, teacher positions, splits), FeatureStore validation (manifest, checksums,
truncation, target identity) and the draft vocabulary (d2t / t2d)."""

from __future__ import annotations

import json

import pytest
import torch
from data_helpers import recipe, write_rows

from speculators.core import feature_codec
from speculators.core.errors import PairingError, SpeculatorsError
from speculators.data import capture, prepare, shards, vocab


def test_int8_roundtrip_error_is_half_a_step_per_group():
    torch.manual_seed(0)
    x = torch.randn(7, 256) * torch.tensor([1.0] * 128 + [50.0] * 128)  # one loud group must not hurt the other
    q, scale = feature_codec.quantize_int8(x, 128)
    assert q.dtype == torch.int8 and scale.shape == (7, 2)
    back = feature_codec.dequantize_int8(q, scale)
    step = x.reshape(7, 2, 128).abs().amax(-1, keepdim=True) / 127
    assert ((back - x).reshape(7, 2, 128).abs() <= step / 2 + 1e-6).all()
    assert (back[:, :128] - x[:, :128]).abs().max() < 0.05
    zeros = feature_codec.dequantize_int8(*feature_codec.quantize_int8(torch.zeros(2, 64), 64))
    assert torch.equal(zeros, torch.zeros(2, 64))


def test_group_size_divides_hidden():
    assert feature_codec.group_size_for(4096) == 128 and feature_codec.group_size_for(64) == 64
    assert feature_codec.group_size_for(2880) == 120 and 2880 % feature_codec.group_size_for(2880) == 0


def test_teacher_positions_are_those_before_assistant_tokens():
    mask = torch.tensor([0, 0, 1, 1, 0, 1])
    assert feature_codec.stored_teacher_positions(mask).tolist() == [False, True, True, False, True, False]


def test_split_is_deterministic_disjoint_and_complete():
    tr = shards.split_side_indices(20, "train", 0.1, 3)
    va = shards.split_side_indices(20, "val", 0.1, 3)
    assert len(va) == 2 and sorted(tr + va) == list(range(20))
    assert va == shards.split_side_indices(20, "val", 0.1, 3) != shards.split_side_indices(20, "val", 0.1, 4)
    assert shards.split_side_indices(1, "val", 0.1, 0) == [] and len(shards.split_side_indices(3, "val", 0.01, 0)) == 1


def test_build_vocab_frequency_ties_specials_and_padding():
    freq = torch.tensor([0, 5, 5, 9, 0, 1, 0, 0, 7, 0])
    d2t, t2d = vocab.build_vocab(freq, 4, always_include_ids=[9])
    chosen = vocab.draft_to_target_ids(d2t)
    assert chosen.tolist() == [1, 3, 8, 9]  # special 9 forced; 3 (9x), 8 (7x), then the tie 1/2 goes to 1
    assert d2t.dtype == torch.long and d2t.tolist() == [1, 2, 6, 6]
    assert t2d.dtype == torch.bool and torch.nonzero(t2d).flatten().tolist() == chosen.tolist()
    d2t, t2d = vocab.build_vocab(freq, 8, always_include_ids=[])
    assert vocab.draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # 5 seen + lowest unused ids
    with pytest.raises(SpeculatorsError, match="draft_vocab_size"):
        vocab.build_vocab(freq, 11)
    with pytest.raises(SpeculatorsError, match="special tokens"):
        vocab.build_vocab(freq, 1, always_include_ids=[0, 9])
    assert vocab.coverage(t2d, freq) == pytest.approx(27 / 27)


@pytest.fixture
def captured(tmp_path, tiny_llama):
    r = recipe(tmp_path / "run", tiny_llama, write_rows(tmp_path / "rows.jsonl", 6),
               speculator={"family": "eagle3", "draft_vocab_size": 64})
    prepare.run(r)
    capture.run(r)
    return r


def test_vocab_files_and_load_vocab(captured):
    f = captured.paths.features
    d2t, t2d = vocab.load_vocab(f, 64)
    assert d2t.shape == (64,) and t2d.shape == (len(t2d),) and int(t2d.sum()) == 64
    freq, forced = vocab.load_token_freq(f)
    assert {0, 1} <= set(forced)  # <|endoftext|>, <|end|> (EOS / end of turn) are always in the draft vocab
    assert t2d[forced].all()
    m = json.loads((f / "manifest.json").read_text())
    assert m["vocab"]["draft_vocab_size"] == 64 and 0 < m["vocab"]["train_assistant_tokens"] <= 1
    assert set(m["vocab"]["workload_prompt_tokens"]) == {"code-completion", "copy-heavy", "docstring-to-code",
                                                        "json-tool-call", "prose", "short-output"}
    d2, t2 = vocab.load_vocab(f, 32)  # another size: built from token_freq and cached under its own name
    assert (f / "vocab-32.safetensors").is_file() and d2.shape == (32,) and t2[forced].all()
    (f / "vocab-32.safetensors").write_bytes(b"junk")
    with pytest.raises(SpeculatorsError, match="vocab-32.safetensors is unreadable"):
        vocab.load_vocab(f, 32)


def test_feature_store_rejects_truncated_altered_and_missing_shards(captured):
    f = captured.paths.features
    store = shards.FeatureStore(f)
    store.verify()
    assert len(store) == store.manifest["counts"]["sequences"]
    assert store.lengths() == [int(store.sequence(i)["input_ids"].numel()) for i in range(len(store))]
    shard = f / "shard-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(SpeculatorsError, match="shard-00000.safetensors is truncated"):
        shards.FeatureStore(f).sequence(0)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SpeculatorsError, match="fails its checksum"):
        shards.FeatureStore(f).sequence(0)
    shard.unlink()
    with pytest.raises(SpeculatorsError, match="is missing"):
        shards.FeatureStore(f).sequence(0)


def test_feature_store_rejects_nan_and_bad_manifests(tmp_path, captured):
    f = captured.paths.features
    shard = f / "shard-00001.safetensors"
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(shard), framework="pt") as fh:
        meta = fh.metadata()
    t = load_file(str(shard))
    t["taps_scale"][0, 0] = float("nan")
    save_file(t, str(shard), metadata=meta)
    m = json.loads((f / "manifest.json").read_text())
    m["shards"][1]["bytes"] = shard.stat().st_size
    m["shards"][1]["sha256"] = shards.sha256_file(shard)
    (f / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpeculatorsError, match="shard-00001.safetensors: taps contains NaN/Inf"):
        shards.FeatureStore(f).verify()
    m["complete"] = False
    (f / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpeculatorsError, match="incomplete"):
        shards.FeatureStore(f)
    with pytest.raises(SpeculatorsError, match="no manifest.json"):
        shards.FeatureStore(tmp_path)


def test_check_target_refuses_other_targets(tmp_path, captured, tiny_qwen3):
    from speculators.core.config import TargetConfig
    from speculators.core.target import fingerprint_target

    store = shards.FeatureStore(captured.paths.features)
    store.check_target(fingerprint_target(captured.target).to_dict())
    other = fingerprint_target(TargetConfig(name_or_path=str(tiny_qwen3))).to_dict()
    with pytest.raises(PairingError, match="come from target .* not .*re-run capture"):
        store.check_target(other)
    with pytest.raises(PairingError, match="another tokenizer"):
        store.check_target({**other, "tokenizer_hash": "x"})
