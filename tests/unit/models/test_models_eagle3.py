"""EAGLE-3: construction from a target, the vLLM speculators layout, TTT training, and train == serve."""

from __future__ import annotations

import pytest
import torch
from models_helpers import (
    HIDDEN,
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    reduced_vocab,
    target_features,
)

from speculators.core.config import SpeculatorConfig
from speculators.core.errors import SpeculatorsError
from speculators.models import SPECULATORS
from speculators.models.base import FeatureRequest
from speculators.models.io import target_weights

K = 3


def _batch(target, layer_ids, b=2, t=14, seed=0):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **target_features(target, ids, layer_ids)}


@pytest.mark.parametrize("target_family", ["llama", "qwen3", "qwen3_moe"])
def test_from_target_shapes_and_frozen_copies(target_family):
    model, cfg, target = build("eagle3", target_family, draft_arch="qwen3", num_steps=K)
    assert model.layer_ids == [2, 4, 5]  # residual stream entering layers 2, N//2, N-3 of an 8-layer target
    assert model.required_features() == FeatureRequest(tap_layer_ids=(2, 4, 5), last_hidden=False)
    sd = model.state_dict()
    assert sd["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 2 * HIDDEN)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 2 * HIDDEN)
    assert sd["layers.0.hidden_norm.weight"].shape == (HIDDEN,)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (16,)  # qwen3 draft layout on any target
    assert sd["layers.0.mlp.gate_proj.weight"].shape == (cfg.intermediate_size, HIDDEN)
    assert sd["lm_head.weight"].shape == (VOCAB, HIDDEN)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and bool(sd["t2d"].all())
    assert torch.equal(model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)  # init_lm_head_from_target
    assert not any(k.startswith("model.") for k in sd)

    batch = _batch(target, model.layer_ids)
    logits = model.forward_train(batch)
    assert len(logits) == K and all(x.shape == (2, 14, VOCAB) and x.dtype == torch.float32 for x in logits)


def test_gradients_reach_trainables_and_not_the_embedding():
    model, _, target = build("eagle3", num_steps=K)
    batch = _batch(target, model.layer_ids)
    model.forward_train(batch)[0].logsumexp(-1).sum().backward()  # step 0 only
    assert model.embed_tokens.weight.grad is None
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)
    model.forward_train(batch)[2].sum().backward()  # later steps backprop through the fed-back hidden
    assert model.fc.weight.grad.abs().sum() > 0


def test_reduced_vocab_d2t_t2d_and_lm_head_rows():
    d2t, ids = reduced_vocab(VOCAB, 40)
    model, _, target = build("eagle3", d2t=d2t)
    assert model.draft_vocab_size == 40
    assert torch.equal(model.draft_to_target, ids)
    assert torch.equal(torch.nonzero(model.t2d).flatten(), ids)
    assert torch.equal(model.lm_head.weight, target.lm_head.weight[ids])
    logits = model.forward_train(_batch(target, model.layer_ids, b=1, t=6))
    assert logits[0].shape == (1, 6, 40)
    cfg = model.config_dict()
    assert cfg["draft_vocab_size"] == 40 and cfg["transformer_layer_config"]["vocab_size"] == VOCAB


def test_bad_d2t_and_vocab_are_refused():
    _, cfg, target = build("eagle3")
    w = target_weights(target)
    with pytest.raises(SpeculatorsError, match="d2t"):
        SPECULATORS["eagle3"].from_target(cfg, SpeculatorConfig(draft_vocab_size=40), w)
    d2t, _ = reduced_vocab(VOCAB, 40)
    with pytest.raises(SpeculatorsError, match="draft_vocab_size"):
        SPECULATORS["eagle3"].from_target(cfg, SpeculatorConfig(draft_vocab_size=50), w, d2t=d2t)
    with pytest.raises(SpeculatorsError, match="outside"):
        SPECULATORS["eagle3"].from_target(cfg, SpeculatorConfig(), w, d2t=d2t + VOCAB)
    with pytest.raises(SpeculatorsError, match="layer ids"):
        SPECULATORS["eagle3"].from_target(cfg, SpeculatorConfig(), w, layer_ids=[1, 9])


def test_config_follows_the_vllm_speculators_format():
    model, cfg, _ = build("eagle3", "qwen3", draft_arch="llama", num_steps=4)
    c = model.config_dict()
    assert "model_type" not in c
    assert c["speculators_model_type"] == "eagle3"
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}
    assert set(sc["verifier"]) == {"name_or_path", "architectures"}
    tl = c["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 1
    assert tl["hidden_size"] == HIDDEN and tl["vocab_size"] == VOCAB and tl["rms_norm_eps"] == cfg.rms_norm_eps
    assert tl["max_position_embeddings"] == cfg.max_position_embeddings
    assert tl["rope_theta"] == cfg.rope_parameters["rope_theta"] and tl["rope_scaling"] is None
    assert tl["head_dim"] == 16 and tl["num_key_value_heads"] == 2
    assert c["draft_vocab_size"] == VOCAB and c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert c[flag] is False
    assert "target_hidden_size" in c and c["target_hidden_size"] is None
    assert c["speculators_native"]["family"] == "eagle3" and c["speculators_native"]["num_steps"] == 4
    rebuilt = SPECULATORS["eagle3"].from_config_dict(c)
    assert set(rebuilt.state_dict()) == set(model.state_dict())
    assert rebuilt.config_dict() == c
    with pytest.raises(SpeculatorsError, match="norm_before_residual"):
        SPECULATORS["eagle3"].from_config_dict({**c, "norm_before_residual": True})


# ------------------------------------------------------------------------------------------------------------------
# the guard against train/serve acceptance gaps


def _runtime_chain_logits(model, feats, ids, t, chunks):
    """Absorb positions 0..t (true taps, next tokens x_1..x_{t+1}) in `chunks`, then draft a chain from x_{t+1}
    with teacher-forced tokens x_{t+2}, x_{t+3}, ...; returns the K step logits [Vd] each."""
    state = model.new_state(64, "cpu")
    lo = 0
    for hi in [*chunks, t + 1]:
        model.absorb(state, {k: v[lo:hi] for k, v in feats.items()}, ids[lo + 1:hi + 1])
        lo = hi
    stepper = model.stepper(state)
    out = [stepper.root_logits()]
    for k in range(1, model.num_steps):
        out.append(stepper.step([k], ids[t + 1 + k: t + 2 + k], [k - 1 if k > 1 else -1], k)[0])
    return out


@pytest.mark.parametrize("target_family,draft_arch", [("llama", "llama"), ("qwen3", "qwen3"),
                                                      ("qwen3_moe", "llama")])
def test_runtime_chain_equals_forward_train(target_family, draft_arch):
    model, _, target = build("eagle3", target_family, draft_arch=draft_arch, num_steps=4)
    randomize(model)
    t_len = 16
    batch = _batch(target, model.layer_ids, b=1, t=t_len, seed=3)
    with torch.no_grad():
        train = model.forward_train(batch)
    ids = batch["input_ids"][0]
    feats = {"taps": batch["taps"][0]}
    for t, chunks in ((0, []), (5, [2]), (t_len - 5, [3, 7])):
        run = _runtime_chain_logits(model, feats, ids, t, chunks)
        for k in range(model.num_steps):
            torch.testing.assert_close(run[k], train[k][0, t], atol=1e-5, rtol=1e-5, msg=f"t={t} step={k}")


@pytest.mark.parametrize("padding", ["right", "left"])
def test_forward_train_padding_does_not_change_real_positions(padding):
    model, _, target = build("eagle3", num_steps=3)
    randomize(model)
    full = _batch(target, model.layer_ids, b=1, t=10, seed=5)
    with torch.no_grad():
        ref = model.forward_train(full)
    pad = 4
    padded = {}
    for key, v in full.items():
        z = torch.zeros((1, pad, *v.shape[2:]), dtype=v.dtype)
        padded[key] = torch.cat([v, z], 1) if padding == "right" else torch.cat([z, v], 1)
    am = torch.ones(1, 10 + pad, dtype=torch.long)
    if padding == "right":
        am[:, 10:] = 0
    else:
        am[:, :pad] = 0
    padded["attention_mask"] = am
    with torch.no_grad():
        got = model.forward_train(padded)
    off = 0 if padding == "right" else pad
    for k in range(3):
        valid = 10 - 1 - k  # positions whose step-k token exists in the unpadded sequence
        torch.testing.assert_close(got[k][0, off:off + valid], ref[k][0, :valid], atol=1e-5, rtol=1e-5)


def test_equivalence_test_catches_a_training_attention_that_forgets_ancestors(monkeypatch):
    """Negative control: a TTT whose step k does not see the steps before it at the same position (what the
    runtime's tree ancestors provide) no longer matches the runtime, and the test notices."""
    import speculators.models.layers as layers

    model, _, target = build("eagle3", num_steps=3)
    randomize(model)
    batch = _batch(target, model.layer_ids, b=1, t=12, seed=1)
    run = _runtime_chain_logits(model, {"taps": batch["taps"][0]}, batch["input_ids"][0], 4, [])
    original = layers.ttt_attention
    monkeypatch.setattr(layers, "ttt_attention", lambda q, k0, v0, m, dk, dv: original(q, k0, v0, m, dk[-1:], dv[-1:]))
    with torch.no_grad():
        bad = model.forward_train(batch)
    torch.testing.assert_close(run[1], bad[1][0, 4], atol=1e-5, rtol=1e-5)  # step 1 has one diagonal key anyway
    assert not torch.allclose(run[2], bad[2][0, 4], atol=1e-4)


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
def test_weights_of_another_model_are_refused_with_one_line(family):
    import dataclasses

    _, cfg, target = build("eagle3")
    w = target_weights(target)
    other = dataclasses.replace(w, lm_head=w.lm_head[:, :-1])  # a narrower model's head
    with pytest.raises(SpeculatorsError, match="come from different models") as err:
        SPECULATORS[family].from_target(cfg, SpeculatorConfig(family=family), other)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flags", [{"fc_norm": True}, {"norm_before_fc": True}, {"norm_output": True},
                                   {"fc_norm": True, "norm_output": True}])
def test_eagle31_normalisation_is_written_reloaded_and_served_as_trained(flags, tmp_path):
    """EAGLE 3.1 flags: the vLLM flags are written true, the extra norms carry vLLM's tensor names, a saved
    checkpoint reloads to the same function, and drafting (runtime chain) equals training (TTT)."""
    from speculators.models.io import load_speculator, save_speculator

    model, _, target = build("eagle3", "llama", num_steps=3, **flags)
    randomize(model, seed=5, scale=0.2)  # norm weights away from 1, so a skipped norm would show
    c = model.config_dict()
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert c[flag] is bool(flags.get(flag, False))
    names = set(model.state_dict())
    assert ("input_norm.weight" in names) is bool(flags.get("norm_before_fc"))
    assert ("fc_norm.2.weight" in names) is bool(flags.get("fc_norm"))
    plain, _, _ = build("eagle3", "llama", num_steps=3)
    randomize(plain, seed=5, scale=0.2)
    batch = _batch(target, model.layer_ids, b=1, t=16, seed=3)
    with torch.no_grad():
        train = model.forward_train(batch)
        assert not torch.allclose(train[1], plain.forward_train(batch)[1], atol=1e-3)  # the flags change the math
    ids, feats = batch["input_ids"][0], {"taps": batch["taps"][0]}
    for t, chunks in ((0, []), (9, [4])):
        run = _runtime_chain_logits(model, feats, ids, t, chunks)
        for k in range(model.num_steps):
            torch.testing.assert_close(run[k], train[k][0, t], atol=1e-5, rtol=1e-5, msg=f"t={t} step={k}")
    save_speculator(model, tmp_path / "ck", {})
    again = load_speculator(tmp_path / "ck", target_weights(target))
    with torch.no_grad():
        torch.testing.assert_close(again.forward_train(batch)[2], train[2])


def test_fc_norm_and_norm_before_fc_are_exclusive():
    with pytest.raises(SpeculatorsError, match="mutually exclusive"):
        build("eagle3", "llama", fc_norm=True, norm_before_fc=True)
