"""Checkpoint I/O: atomic save, bit-exact strict load, frozen target copies recorded instead of saved."""

from __future__ import annotations

import json

import pytest
import torch
from models_helpers import (
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    reduced_vocab,
    tiny_target,
)
from safetensors.torch import load_file, save_file

from speculators.core.errors import SpeculatorsError
from speculators.models.base import TargetWeights
from speculators.models.io import (
    digests_match,
    load_speculator,
    probe_indices,
    read_speculator_config,
    save_speculator,
    target_weights,
    tensor_digest,
)


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
def test_roundtrip_is_bit_exact(tmp_path, family):
    d2t = reduced_vocab(VOCAB, 60)[0] if family == "eagle3" else None
    model, _, target = build(family, draft_arch="qwen3", num_steps=2, d2t=d2t)
    randomize(model)
    out = tmp_path / "step-0000010"
    save_speculator(model, out, {"step": 10, "recipe": {"name": "t"}, "family": "not-this"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000010"]  # no temp dir left behind
    config = read_speculator_config(out)
    native = config["speculators_native"]
    assert native["family"] == family and native["step"] == 10 and native["recipe"] == {"name": "t"}
    saved = load_file(str(out / "model.safetensors"))
    for name, source in model.TARGET_TENSORS.items():
        assert name not in saved
        assert native["target_tensors"][name]["saved"] is False and native["target_tensors"][name]["source"] == source
    loaded = load_speculator(out, target_weights(target))
    assert type(loaded) is type(model)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert loaded.config_dict()["speculators_native"]["family"] == family
    assert not loaded.training


def test_target_copies_are_required_and_checked(tmp_path):
    model, _, target = build("mtp")
    save_speculator(model, tmp_path / "ck", {})
    with pytest.raises(SpeculatorsError, match="target_weights"):
        load_speculator(tmp_path / "ck", None)
    _, other = tiny_target("llama", seed=7)
    with pytest.raises(SpeculatorsError, match="differs"):
        load_speculator(tmp_path / "ck", target_weights(other))
    w = target_weights(target)
    rounded = TargetWeights(*(t.to(torch.bfloat16).float() for t in (w.embed_tokens, w.lm_head, w.final_norm)))
    loaded = load_speculator(tmp_path / "ck", rounded)  # the same target loaded in another dtype is accepted
    assert torch.equal(loaded.embed_tokens.weight, rounded.embed_tokens)


def test_medusa_needs_no_target_and_changed_copies_are_saved(tmp_path):
    medusa, _, _ = build("medusa")
    save_speculator(medusa, tmp_path / "m", {})
    load_speculator(tmp_path / "m", None)
    model, _, _ = build("eagle3")
    with torch.no_grad():
        model.embed_tokens.weight.mul_(2.0)  # no longer the target's: must be saved
    save_speculator(model, tmp_path / "e", {})
    assert "embed_tokens.weight" in load_file(str(tmp_path / "e" / "model.safetensors"))
    loaded = load_speculator(tmp_path / "e", None)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)


def test_strict_errors(tmp_path):
    model, _, target = build("eagle3")
    w = target_weights(target)
    ck = tmp_path / "ck"
    save_speculator(model, ck, {})
    weights = load_file(str(ck / "model.safetensors"))

    with pytest.raises(SpeculatorsError, match="not found"):
        load_speculator(tmp_path / "nope", w)
    bad = tmp_path / "extra"
    bad.mkdir()
    (bad / "config.json").write_text((ck / "config.json").read_text())
    with pytest.raises(SpeculatorsError, match="model.safetensors"):
        load_speculator(bad, w)
    save_file({**weights, "surprise.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    with pytest.raises(SpeculatorsError, match="unexpected"):
        load_speculator(bad, w)
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(SpeculatorsError, match="missing"):
        load_speculator(bad, w)
    save_file({**weights, "fc.weight": torch.zeros(3, 3)}, str(bad / "model.safetensors"))
    with pytest.raises(SpeculatorsError, match="shape"):
        load_speculator(bad, w)
    save_file({**weights, "d2t": weights["d2t"].float()}, str(bad / "model.safetensors"))
    with pytest.raises(SpeculatorsError, match="dtype"):
        load_speculator(bad, w)
    (bad / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(SpeculatorsError, match="corrupt"):
        load_speculator(bad, w)

    config = json.loads((ck / "config.json").read_text())
    config["speculators_native"]["family"] = "hydra"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculatorsError, match="unknown speculator family"):
        load_speculator(bad, w)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(SpeculatorsError, match="not valid JSON"):
        load_speculator(bad, w)
    (bad / "config.json").unlink()
    with pytest.raises(SpeculatorsError, match="config.json"):
        load_speculator(bad, w)


def test_saving_into_an_existing_dir_keeps_other_files(tmp_path):
    model, _, target = build("eagle3")
    ck = tmp_path / "step"
    (ck / "training_state").mkdir(parents=True)
    (ck / "training_state" / "optimizer.bin").write_bytes(b"x")
    save_speculator(model, ck, {"step": 1})
    randomize(model, seed=3)
    save_speculator(model, ck, {"step": 2})
    assert sorted(p.name for p in ck.iterdir()) == ["config.json", "model.safetensors", "training_state"]
    loaded = load_speculator(ck, target_weights(target))
    assert torch.equal(loaded.fc.weight, model.fc.weight)
    assert read_speculator_config(ck)["speculators_native"]["step"] == 2


def test_target_weights_from_hf_and_peft_models():
    from peft import LoraConfig, get_peft_model

    _, target = tiny_target("qwen3")
    w = target_weights(target)
    assert w.embed_tokens.shape == (VOCAB, 64) and w.lm_head.shape == (VOCAB, 64) and w.final_norm.shape == (64,)
    assert torch.equal(w.final_norm, target.model.norm.weight)
    import copy

    peft = get_peft_model(copy.deepcopy(target), LoraConfig(r=2, target_modules=["q_proj"]))
    wp = target_weights(peft)
    assert torch.equal(wp.embed_tokens, w.embed_tokens) and torch.equal(wp.lm_head, w.lm_head)
    assert tensor_digest(wp.lm_head)["sha256"] == tensor_digest(w.lm_head)["sha256"]


def test_every_family_on_a_saved_tiny_target(tiny_target_any, tmp_path):
    """The real route: load_target from disk -> target_weights -> from_target -> forward_train -> save -> load."""
    from speculators.core.config import SpeculatorConfig, TargetConfig
    from speculators.core.target import forward_with_taps, load_target
    from speculators.models import SPECULATORS

    loaded = load_target(TargetConfig(name_or_path=str(tiny_target_any), device="cpu", dtype="float32"))
    weights = target_weights(loaded.model)
    ids = torch.randint(0, loaded.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    for family in ("eagle3", "medusa", "mtp", "dflash"):
        spec = SPECULATORS[family].from_target(loaded.model.config, SpeculatorConfig(family=family, num_steps=2),
                                               weights)
        req = spec.required_features()
        out = forward_with_taps(loaded.model, ids, torch.ones_like(ids), list(req.tap_layer_ids or []) or None)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "last_hidden": out.last_hidden}
        if out.taps is not None:
            batch["taps"] = out.taps
        with torch.no_grad():
            want = spec.forward_train(batch)
        cfg = spec.config_dict()
        verifier = cfg.get("speculators_config", {}).get("verifier") or cfg.get("verifier") or \
            cfg["speculators_native"]["verifier"]
        assert verifier["name_or_path"] == str(tiny_target_any)
        save_speculator(spec, tmp_path / family, {})
        again = load_speculator(tmp_path / family, weights)
        with torch.no_grad():
            got = again.forward_train(batch)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("shape", [(49152, 576), (128256, 4096), (151936, 4096), (5, 3), (1, 1)])
def test_probe_indices_stay_inside_real_embeddings(shape):
    """SmolLM2's, Llama-3.1-8B's and Qwen3-8B's embeddings are over 2^24 elements: float32 index arithmetic rounds
    past their end. The probes must be in range, increasing, and hit the first and the last element."""
    numel = shape[0] * shape[1]
    idx = probe_indices(numel, 16)
    assert len(idx) == min(16, numel)
    assert idx[0] == 0 and idx[-1] == numel - 1
    assert all(a < b for a, b in zip(idx, idx[1:], strict=False)) or numel == 1


def test_digest_of_a_real_size_embedding():
    """The digest of a 49152 x 576 tensor (SmolLM2-135M's tied embedding) probes its last element and tells a change
    there from the original."""
    emb = torch.randn(49152, 576, generator=torch.Generator().manual_seed(0))
    digest = tensor_digest(emb)
    assert digest["probe"][-1] == float(emb[-1, -1])
    changed = emb.clone()
    changed[-1, -1] += 1.0
    assert not digests_match(digest, tensor_digest(changed))
    assert digests_match(digest, tensor_digest(emb.to(torch.bfloat16)))
