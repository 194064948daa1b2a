"""MTP: DeepSeek-style module on a frozen target, recursive steps, and train == serve."""

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


def _batch(target, b=2, t=14, seed=0):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **target_features(target, ids, None)}


@pytest.mark.parametrize("target_family,draft_arch", [("llama", "qwen3"), ("qwen3_moe", "llama")])
def test_from_target_layout_and_frozen_parts(target_family, draft_arch):
    model, cfg, target = build("mtp", target_family, draft_arch=draft_arch, num_steps=3)
    assert model.required_features() == FeatureRequest(tap_layer_ids=None, last_hidden=True)
    sd = model.state_dict()
    assert sd["eh_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert sd["enorm.weight"].shape == sd["hnorm.weight"].shape == (HIDDEN,)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, HIDDEN)  # plain (not fused) block
    assert ("layers.0.self_attn.q_norm.weight" in sd) == (draft_arch == "qwen3")
    assert torch.equal(sd["shared_head.head.weight"], target.lm_head.weight)
    assert torch.equal(sd["shared_head.norm.weight"], target.model.norm.weight)
    assert torch.equal(sd["embed_tokens.weight"], target.model.embed_tokens.weight)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "shared_head.head.weight"}
    assert torch.equal(model.draft_to_target, torch.arange(VOCAB))
    logits = model.forward_train(_batch(target))
    assert len(logits) == 3 and all(x.shape == (2, 14, VOCAB) for x in logits)


def test_gradients_and_frozen_target_copies():
    model, _, target = build("mtp", num_steps=3)
    model.forward_train(_batch(target))[0].logsumexp(-1).sum().backward()
    assert model.embed_tokens.weight.grad is None and model.shared_head.head.weight.grad is None
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_config_and_refusals():
    model, cfg, target = build("mtp", num_steps=2)
    c = model.config_dict()
    assert c["mtp_layout"] == "deepseek" and c["num_nextn_predict_layers"] == 1
    assert c["transformer_layer_config"]["model_type"] == "llama"
    assert "speculators_config" not in c and "model_type" not in c  # vLLM must not mistake it for another format
    assert c["speculators_native"]["family"] == "mtp" and c["speculators_native"]["num_steps"] == 2
    assert SPECULATORS["mtp"].from_config_dict(c).config_dict() == c
    d2t, _ = reduced_vocab(VOCAB, 40)
    with pytest.raises(SpeculatorsError, match="full target vocab"):
        SPECULATORS["mtp"].from_target(cfg, SpeculatorConfig(family="mtp"), target_weights(target), d2t=d2t)


@pytest.mark.parametrize("target_family,draft_arch", [("llama", "llama"), ("qwen3", "qwen3"),
                                                      ("qwen3_moe", "qwen3")])
def test_runtime_chain_equals_forward_train(target_family, draft_arch):
    model, _, target = build("mtp", target_family, draft_arch=draft_arch, num_steps=4)
    randomize(model)
    batch = _batch(target, b=1, t=16, seed=2)
    with torch.no_grad():
        train = model.forward_train(batch)
    ids, hid = batch["input_ids"][0], batch["last_hidden"][0]
    for t, chunks in ((0, []), (6, [3]), (11, [1, 8])):
        state = model.new_state(48, "cpu")
        lo = 0
        for hi in [*chunks, t + 1]:
            model.absorb(state, {"last_hidden": hid[lo:hi]}, ids[lo + 1:hi + 1])
            lo = hi
        stepper = model.stepper(state)
        torch.testing.assert_close(stepper.root_logits(), train[0][0, t], atol=1e-5, rtol=1e-5)
        for k in range(1, 4):
            got = stepper.step([k], ids[t + 1 + k:t + 2 + k], [k - 1 if k > 1 else -1], k)[0]
            torch.testing.assert_close(got, train[k][0, t], atol=1e-5, rtol=1e-5, msg=f"t={t} k={k}")
