"""capture: taps are the residual stream ENTERING the named layers (forward hooks / HF hidden_states[k]) on tiny
Llama, Qwen3, Qwen3-MoE and a LoRA-adapted target; shards round-trip through FeatureStore; the teacher equals the
target's top-k log-probs; bad inputs fail in one line and leave earlier outputs intact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from data_helpers import recipe, write_rows

from speculators.core.atomic import replace_dir
from speculators.core.errors import SpeculatorsError
from speculators.core.target import load_target
from speculators.data import capture, features, prepare
from speculators.data.shards import FeatureStore


def _hf_hidden(model, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return out.hidden_states, out.logits[0]


def _hook_inputs(model, layers, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The hidden state entering each decoder layer, recorded by our own forward pre-hooks."""
    from speculators.core.target import decoder_layers

    seen: dict[int, torch.Tensor] = {}
    handles = []
    for k in layers:
        def hook(mod, args, kwargs, k=k):
            seen[k] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        handles.append(decoder_layers(model)[k].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_compute_features_taps_are_inputs_of_named_layers(family, request, monkeypatch):
    monkeypatch.setattr(features, "TOPK_CHUNK_ELEMENTS", 3 * 8192)  # top-k over chunks of 3 positions
    path = request.getfixturevalue({"llama": "tiny_llama", "qwen3": "tiny_qwen3", "qwen3_moe": "tiny_moe"}[family])
    r = recipe(path.parent / "unused", path, path / "none.jsonl")
    target = load_target(r.target, device="cpu", dtype="float32")
    req = features.feature_request(r, target.num_layers)
    assert req.tap_layer_ids == (2, 4, 5)  # [2, N//2, N-3] for N = 8
    ids = torch.randint(0, target.vocab_size, (13,))
    feats = features.compute_features(target.model, ids[None], torch.ones(1, 13, dtype=torch.long), req,
                                      teacher="topk", topk=5, need_last_hidden=True)
    hs, logits = _hf_hidden(target.model, ids)
    hooks = _hook_inputs(target.model, req.tap_layer_ids, ids)
    h = target.hidden_size
    for j, k in enumerate(req.tap_layer_ids):
        tap = feats["taps"][0, :, j * h:(j + 1) * h]
        torch.testing.assert_close(tap, hs[k][0], rtol=0, atol=0)
        torch.testing.assert_close(tap, hooks[k][0], rtol=0, atol=0)
        assert not torch.allclose(tap, hs[k + 1][0])  # not the output of layer k
    torch.testing.assert_close(feats["last_hidden"][0], hs[-1][0], rtol=0, atol=0)  # HF's last entry is post-norm
    lp = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(feats["teacher_topk_logprobs"][0], lp.topk(5).values)
    assert torch.equal(feats["teacher_topk_ids"][0], lp.topk(5).indices)


def _prepared(tmp_path, target_path, n=6, **sections):
    data = write_rows(tmp_path / "rows.jsonl", n)
    r = recipe(tmp_path / "run", target_path, data, **sections)
    prepare.run(r)
    return r


def _reference_sequence(model, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    hs, logits = _hf_hidden(model, ids)
    taps = torch.cat([hs[k][0] for k in layers], dim=-1)
    return taps, torch.log_softmax(logits.float(), -1)


def test_capture_bf16_shards_equal_the_target_forward(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, capture={"storage": "bf16", "teacher": "topk", "teacher_topk": 8})
    summary = capture.run(r)
    import datasets

    ds = datasets.load_from_disk(str(r.paths.prepared))
    assert summary["rows"] == len(ds) >= 5 and summary["shards"] >= 2
    store = FeatureStore(r.paths.features)
    m = store.manifest
    assert m["layer_ids"] == [2, 4, 5] and m["stored"] == ["taps"] and m["teacher"] == "topk"
    target = load_target(r.target, device="cpu", dtype="float32")
    for i in range(len(store)):
        seq = store.sequence(i)
        assert seq["input_ids"].tolist() == ds[i]["input_ids"]
        assert seq["loss_mask"].tolist() == ds[i]["loss_mask"]
        assert store.row_id(i) == ds[i]["id"]
        taps, lp = _reference_sequence(target.model, seq["input_ids"], [2, 4, 5])
        assert seq["taps"].dtype == torch.float32
        torch.testing.assert_close(seq["taps"], taps.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
        pos = seq["teacher_mask"].bool()
        assert pos.tolist() == (seq["loss_mask"][1:] > 0).tolist() + [False]
        ref = lp.topk(8)
        assert torch.equal(seq["teacher_topk_ids"][pos], ref.indices[pos])
        torch.testing.assert_close(seq["teacher_topk_logprobs"][pos], ref.values[pos], rtol=1e-3, atol=2e-3)
        assert torch.isfinite(seq["teacher_topk_logprobs"]).all()


def test_capture_int8_error_is_bounded_by_the_scale(tmp_path, tiny_qwen3):
    r = _prepared(tmp_path, tiny_qwen3, n=3, capture={"storage": "int8", "teacher": "hidden"},
                  speculator={"family": "eagle3", "draft_vocab_size": None})
    capture.run(r)
    store = FeatureStore(r.paths.features)
    assert store.manifest["stored"] == ["taps", "last_hidden"]  # teacher=hidden needs the last hidden state
    assert not (r.paths.features / "vocab-256.safetensors").exists()
    target = load_target(r.target, device="cpu", dtype="float32")
    for i in range(len(store)):
        seq = store.sequence(i)
        hs, _ = _hf_hidden(target.model, seq["input_ids"])
        taps = torch.cat([hs[k][0] for k in (2, 4, 5)], dim=-1)
        h = target.hidden_size
        absmax = taps.reshape(taps.shape[0], 3, h).abs().amax(-1, keepdim=True)  # one group of 64 per tap
        err = (seq["taps"] - taps).reshape(taps.shape[0], 3, h).abs()
        assert (err <= absmax / 127 * 0.5 + 1e-4).all()
        assert "teacher_topk_ids" not in seq
        torch.testing.assert_close(seq["last_hidden"], hs[-1][0], rtol=0.02, atol=0.02)


def test_capture_medusa_stores_last_hidden_only(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=2, speculator={"family": "medusa", "draft_vocab_size": None})
    s = capture.run(r)
    store = FeatureStore(r.paths.features)
    assert store.manifest["stored"] == ["last_hidden"] and store.manifest["layer_ids"] is None
    seq = store.sequence(0)
    assert "taps" not in seq and seq["last_hidden"].shape[1] == 64
    assert s["bytes_per_token"] < 8 * 64


def test_capture_moe_target(tmp_path, tiny_moe):
    r = _prepared(tmp_path, tiny_moe, n=2, capture={"storage": "bf16"})
    capture.run(r)
    store = FeatureStore(r.paths.features)
    target = load_target(r.target, device="cpu", dtype="float32")
    assert len(store) == 2
    seq = store.sequence(1)
    taps, _ = _reference_sequence(target.model, seq["input_ids"], [2, 4, 5])
    torch.testing.assert_close(seq["taps"], taps.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_capture_through_a_peft_lora_adapter(tmp_path, tiny_llama):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    torch.manual_seed(1)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                 init_lora_weights=False))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    r = _prepared(tmp_path, tiny_llama, n=2, target={"adapter": str(adapter)}, capture={"storage": "bf16"})
    capture.run(r)
    store = FeatureStore(r.paths.features)
    assert store.manifest["target"]["adapter"] == str(adapter)
    seq = store.sequence(0)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                        adapter).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    want, _ = _reference_sequence(adapted, seq["input_ids"], [2, 4, 5])
    without, _ = _reference_sequence(plain, seq["input_ids"], [2, 4, 5])
    torch.testing.assert_close(seq["taps"], want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert (seq["taps"] - without).abs().max() > 0.05  # the adapter is really applied


def test_capture_out_of_range_layer_ids_fail_before_writing(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=2)
    capture.run(r)
    before = {p.name: p.stat().st_mtime_ns for p in r.paths.features.iterdir()}
    bad = recipe(r.run_dir, tiny_llama, tmp_path / "rows.jsonl", capture={"layer_ids": [2, 9]})
    with pytest.raises(SpeculatorsError, match=r"layer ids \[9\] are out of range .* 8 decoder layers"):
        capture.run(bad)
    assert {p.name: p.stat().st_mtime_ns for p in r.paths.features.iterdir()} == before
    assert capture.is_complete(r) and not capture.is_complete(bad)


def test_capture_refuses_data_tokenized_for_another_target(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=2)
    manifest = r.paths.prepared / "manifest.json"
    m = json.loads(manifest.read_text())
    m["inputs"]["tokenizer_hash"] = "0" * 64
    manifest.write_text(json.dumps(m))
    with pytest.raises(SpeculatorsError, match="tokenized with another tokenizer"):
        capture.run(r)
    assert not r.paths.features.exists()


def test_capture_skips_when_complete_and_only_rebuilds_vocab(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=3)
    capture.run(r)
    assert capture.is_complete(r)
    again = capture.run(r)
    assert again["status"].startswith("complete")
    r2 = recipe(r.run_dir, tiny_llama, tmp_path / "rows.jsonl", speculator={"draft_vocab_size": 300})
    assert not capture.is_complete(r2)
    s = capture.run(r2)
    assert s["status"] == "complete (built draft vocab)"
    assert (r.paths.features / "vocab-300.safetensors").is_file() and capture.is_complete(r2)


def test_a_copied_run_and_a_family_storing_the_same_features_find_the_capture_complete(tmp_path, tiny_llama):
    """The features' identity is what they are made of (data, target, taps, storage), not their folder or reader:
    a copy of the run dir under a DFlash recipe (the same taps as EAGLE-3) skips capture; Medusa (last hidden
    state only) does not."""
    r = _prepared(tmp_path, tiny_llama, n=3)
    capture.run(r)
    copy = tmp_path / "copy"
    shutil.copytree(r.run_dir, copy)
    dflash = recipe(copy, tiny_llama, tmp_path / "rows.jsonl", speculator={"family": "dflash", "num_steps": 3})
    assert capture.is_complete(dflash) and capture.run(dflash)["status"].startswith("complete")
    medusa = recipe(copy, tiny_llama, tmp_path / "rows.jsonl", speculator={"family": "medusa"})
    assert not capture.is_complete(medusa)


def test_capture_recaptures_a_truncated_shard(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=4)
    capture.run(r)
    shard = r.paths.features / "shard-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    with pytest.raises(SpeculatorsError, match="truncated"):
        FeatureStore(r.paths.features).verify()
    assert not capture.is_complete(r)
    s = capture.run(r)
    assert s["status"] == "done"
    assert shard.read_bytes() == good
    FeatureStore(r.paths.features).verify()


def test_summary_warns_when_the_topk_teacher_misses_mass():
    manifest = {"output": "f", "counts": {"sequences": 1, "tokens": 10, "masked_share": 0.5, "shards": 1},
                "storage_report": {"bytes_per_token": 100.0, "ratio_to_reference": 0.4}, "hidden_size": 32,
                "stored": ["taps"], "storage": "int8", "teacher": "topk", "teacher_topk": 20, "layer_ids": [2, 4, 5],
                "throughput": {"forward_tokens_per_s": 1.0}, "quality": {"teacher_topk_mean_mass": 0.8}}
    assert "raise capture.teacher_topk" in capture.summary_of(manifest, "done")["note"]
    manifest["quality"]["teacher_topk_mean_mass"] = 0.97
    assert "note" not in capture.summary_of(manifest, "done")


def _flip(path, count: int = 256, start: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if start is None else start
    for i in range(at, min(at + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_altered_prepared_data_is_refused_by_capture_and_redone_by_prepare(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=4)
    m = json.loads((r.paths.prepared / "manifest.json").read_text())
    assert {f["file"] for f in m["files"]} >= {p.name for p in r.paths.prepared.glob("data-*.arrow")}
    arrow = next(r.paths.prepared.glob("data-*.arrow"))
    good = arrow.read_bytes()
    _flip(arrow)
    with pytest.raises(SpeculatorsError, match=f"{arrow.name} fails its checksum .* re-run `speculators prepare "
                                               "--force`") as info:
        capture.run(r)
    assert "\n" not in str(info.value) and not r.paths.features.exists()
    assert not prepare.is_complete(r)
    assert prepare.run(r)["status"] == "done"  # not "complete (skipped)": the altered output is redone
    assert arrow.read_bytes() == good and capture.run(r)["status"] == "done"


def _rewrite_prepared(r, **column) -> None:
    """Rewrite the prepared rows with one column's first row replaced, under a manifest with matching checksums
    (what a buggy writer or an older version could leave behind)."""
    import datasets

    from speculators.data import artifacts

    ds = datasets.load_from_disk(str(r.paths.prepared))
    rows = {k: list(ds[k]) for k in ds.column_names}
    for name, value in column.items():
        rows[name][0] = value(rows[name][0])
    manifest = json.loads((r.paths.prepared / "manifest.json").read_text())
    tmp = r.paths.prepared.with_name("rewritten")
    manifest["files"] = artifacts.save_token_dataset(rows, tmp)
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    replace_dir(tmp, r.paths.prepared)


@pytest.mark.parametrize("column, value, message", [
    ("loss_mask", lambda m: [-1] + m[1:], r"row 0 \('stdlib-chat-00000'\) has loss_mask -1 \(expected 0 or 1\)"),
    ("input_ids", lambda ids: ids[:-1] + [70000], r"row 0 .* has token id 70000 outside the vocabulary \[0, 8"),
    ("loss_mask", lambda m: m[:-1], "different number of input_ids and loss_mask values"),
])
def test_prepared_values_are_checked_before_capture_writes(tmp_path, tiny_llama, column, value, message):
    r = _prepared(tmp_path, tiny_llama, n=3)
    _rewrite_prepared(r, **{column: value})
    with pytest.raises(SpeculatorsError, match=message):
        capture.run(r)
    assert not r.paths.features.exists() and not r.paths.features.with_name("features.partial").exists()


def test_prepared_data_without_checksums_is_refused(tmp_path, tiny_llama):
    r = _prepared(tmp_path, tiny_llama, n=2)
    manifest = r.paths.prepared / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["files"]
    manifest.write_text(json.dumps(m))
    with pytest.raises(SpeculatorsError, match="has no checksums in its manifest .* re-run `speculators prepare"):
        capture.run(r)
    assert not prepare.is_complete(r)
