"""DFlash: the vLLM `dflash` layout, one-pass blocks, training blocks == runtime blocks, anchors, bad configs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from models_helpers import (
    HIDDEN,
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    target_features,
)

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.models import SPECULATORS
from speculators.models.base import FeatureRequest, step_rows
from speculators.models.dflash import dflash_model as dflash_module
from speculators.models.layers import train_positions


def _model(num_steps=4, num_layers=2, seed=0, **kw):
    model, cfg, target = build("dflash", target_family="llama", draft_arch="qwen3", num_steps=num_steps,
                               num_layers=num_layers, seed=seed, **kw)
    randomize(model, seed=seed, scale=0.2)
    return model.eval(), cfg, target


def _batch(model, target, b=2, t=12, seed=0, attention_mask=None):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids) if attention_mask is None else attention_mask
    feats = target_features(target, ids, list(model.layer_ids))
    return {"input_ids": ids, "attention_mask": am, "taps": feats["taps"]}


def test_layout_frozen_target_copies_and_gradients():
    model, cfg, target = _model(num_steps=4, num_layers=2)
    n = cfg.num_hidden_layers
    assert model.required_features() == FeatureRequest(tap_layer_ids=(2, n // 2, n - 3), last_hidden=False)
    assert model.num_steps == 4 and model.block_size == 5
    sd = model.state_dict()
    assert sd["fc.weight"].shape == (HIDDEN, 3 * HIDDEN) and sd["hidden_norm.weight"].shape == (HIDDEN,)
    assert {"layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight", "norm.weight",
            "layers.0.mlp.down_proj.weight", "embed_tokens.weight", "lm_head.weight"} <= set(sd)
    assert not any("hidden_norm" in k for k in sd if k.startswith("layers."))  # one shared context norm
    torch.testing.assert_close(sd["embed_tokens.weight"], target.get_input_embeddings().weight)
    torch.testing.assert_close(sd["lm_head.weight"], target.get_output_embeddings().weight)
    model.train()
    batch = _batch(model, target)
    sum(x.sum() for x in model.forward_train(batch)).backward()
    assert model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None
    for name in ("fc.weight", "hidden_norm.weight", "layers.0.self_attn.k_norm.weight", "layers.1.mlp.up_proj.weight",
                 "norm.weight"):
        assert model.get_parameter(name).grad is not None, name


def test_config_is_the_vllm_dflash_speculators_format_and_round_trips():
    model, cfg, _ = _model(num_steps=6, num_layers=1)
    c = model.config_dict()
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashDraftModel"]
    assert c["speculators_config"]["algorithm"] == "dflash"
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6 and c["block_size"] == 7
    assert c["aux_hidden_state_layer_ids"] == model.layer_ids
    assert c["mask_token_id"] == (cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id)
    assert c["sliding_window_non_causal"] is True and c["sample_from_anchor"] is False
    layer = c["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 1
    assert layer["layer_types"] == ["full_attention"] and layer["rope_theta"] > 0
    again = SPECULATORS["dflash"].from_config_dict(c)
    assert again.config_dict() == c


@pytest.mark.parametrize("bad,message", [({"sample_from_anchor": True}, "sample_from_anchor"),
                                         ({"sliding_window_non_causal": False}, "causal"),
                                         ({"draft_vocab_size": 10}, "reduced draft vocab"),
                                         ({"target_hidden_size": 7}, "target_hidden_size")])
def test_configs_this_toolkit_cannot_run_are_refused(bad, message):
    model, _, _ = _model(num_steps=2, num_layers=1)
    with pytest.raises(SpeculatorsError, match=message):
        SPECULATORS["dflash"].from_config_dict({**model.config_dict(), **bad})
    c = model.config_dict()
    del c["mask_token_id"]
    with pytest.raises(SpeculatorsError, match="mask_token_id"):
        SPECULATORS["dflash"].from_config_dict(c)


def test_mask_token_outside_the_vocab_and_reduced_vocab_are_refused():
    with pytest.raises(SpeculatorsError, match="mask_token_id"):
        build("dflash", draft_arch="qwen3", num_steps=2, mask_token_id=VOCAB + 3)
    with pytest.raises(SpeculatorsError, match="full target vocab"):
        build("dflash", draft_arch="qwen3", num_steps=2, d2t=torch.zeros(VOCAB // 2, dtype=torch.long))


def test_head_rows_give_the_same_logits_as_the_full_forward():
    model, _, target = _model(num_steps=3)
    batch = _batch(model, target, t=14)
    lm = torch.ones_like(batch["input_ids"])
    lm[0, :5] = 0
    full = model.forward_train(batch)  # K x [B, T, V]
    rows = step_rows(lm, batch["attention_mask"], model.num_steps)
    packed = model.forward_train({**batch, "head_rows": rows})
    for k in range(model.num_steps):
        torch.testing.assert_close(packed[k], full[k].flatten(0, 1)[rows[k]], atol=1e-5, rtol=1e-5)


def _runtime_laws(model, taps, ids, t, chunks=(None,)):
    """The runtime's K laws of the block anchored at ids[t+1] after absorbing positions 0..t (in `chunks`)."""
    state = model.new_state(64, "cpu")
    start = 0
    for end in [*[c for c in chunks if c is not None and c <= t], t + 1]:
        if end > start:
            model.absorb(state, {"taps": taps[start:end]}, ids[start + 1:end + 1])
            start = end
    return model.block_logits(state, int(ids[t + 1]))  # [K, V]


@pytest.mark.parametrize("num_layers", [1, 3])
def test_runtime_block_equals_the_training_block_at_every_anchor(num_layers):
    model, _, target = _model(num_steps=5, num_layers=num_layers, seed=2)
    batch = _batch(model, target, b=1, t=16, seed=4)
    steps = model.forward_train(batch)  # K x [1, T, V]
    ids, taps = batch["input_ids"][0], batch["taps"][0]
    for t in (0, 3, 9, 14):
        laws = _runtime_laws(model, taps, ids, t, chunks=(2, 5))
        for k in range(model.num_steps):
            torch.testing.assert_close(laws[k], steps[k][0, t], atol=2e-5, rtol=2e-5)


def test_absorbing_in_chunks_equals_absorbing_at_once():
    model, _, target = _model(num_steps=3, seed=1)
    batch = _batch(model, target, b=1, t=12)
    ids, taps = batch["input_ids"][0], batch["taps"][0]
    torch.testing.assert_close(_runtime_laws(model, taps, ids, 10), _runtime_laws(model, taps, ids, 10, (1, 2, 7)),
                               atol=1e-6, rtol=1e-6)


def _dense_block_reference(q, k, v, ck, cv, ctx_mask):
    """SDPA over [context ; own block] with an explicit mask, per block (the reference for `block_attention`)."""
    a, nh, s, hd = q.shape
    outs = []
    for i in range(a):
        keys = torch.cat([ck, k[i]], dim=1)[None]  # [1, nkv, T+S, hd]
        values = torch.cat([cv, v[i]], dim=1)[None]
        mask = torch.cat([ctx_mask[i].expand(s, -1), torch.zeros(s, s)], dim=-1)  # [S, T+S]
        outs.append(F.scaled_dot_product_attention(q[i:i + 1], keys, values, attn_mask=mask, enable_gqa=True))
    return torch.cat(outs)


def test_block_attention_equals_a_dense_masked_reference():
    g = torch.Generator().manual_seed(0)
    a, nh, nkv, s, t, hd = 5, 4, 2, 3, 7, 8
    q, k, v = (torch.randn(a, n, s, hd, generator=g) for n in (nh, nkv, nkv))
    ck, cv = torch.randn(nkv, t, hd, generator=g), torch.randn(nkv, t, hd, generator=g)
    sees = torch.arange(t)[None] <= torch.tensor([0, 2, 6, 3, 4])[:, None]
    sees[3, 1] = False  # a padded key
    mask = torch.zeros(a, t).masked_fill(~sees, float("-inf"))
    torch.testing.assert_close(dflash_module.block_attention(q, k, v, ck, cv, mask),
                               _dense_block_reference(q, k, v, ck, cv, mask), atol=1e-5, rtol=1e-5)


def test_the_equivalence_test_catches_a_causal_training_block(monkeypatch):
    """A training block that is causal inside the block (the speculators CLI default vLLM warns about) drafts other
    laws than the runtime's bidirectional block: the equivalence test above must see it."""
    model, _, target = _model(num_steps=4, seed=3)
    batch = _batch(model, target, b=1, t=10)
    right = dflash_module.block_attention

    def causal(q, k, v, ck, cv, ctx_mask):
        s = q.shape[2]
        out = right(q[:, :, :1], k[:, :, :1], v[:, :, :1], ck, cv, ctx_mask)
        rows = [out] + [right(q[:, :, j:j + 1], k[:, :, :j + 1], v[:, :, :j + 1], ck, cv, ctx_mask)
                        for j in range(1, s)]
        return torch.cat(rows, dim=2)

    monkeypatch.setattr(dflash_module, "block_attention", causal)
    steps = model.forward_train(batch)
    laws = _runtime_laws(model, batch["taps"][0], batch["input_ids"][0], 6)
    assert (laws[0] - steps[0][0, 6]).abs().max() > 1e-3


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padding_does_not_change_real_positions(padding):
    model, _, target = _model(num_steps=3, seed=5)
    one = _batch(model, target, b=1, t=9, seed=7)
    pad = 4
    ids = torch.zeros(1, 9 + pad, dtype=torch.long)
    taps = torch.randn(1, 9 + pad, one["taps"].shape[-1])
    am = torch.zeros_like(ids)
    real = slice(pad, None) if padding == "left" else slice(0, 9)
    ids[:, real], taps[:, real], am[:, real] = one["input_ids"], one["taps"], 1
    assert torch.equal(train_positions(am)[:, real], torch.arange(9)[None])
    alone = model.forward_train(one)
    padded = model.forward_train({"input_ids": ids, "attention_mask": am, "taps": taps})
    for k in range(model.num_steps):
        last = 9 - 2 - k  # positions whose block stays inside the real tokens
        torch.testing.assert_close(padded[k][:, real][:, :last], alone[k][:, :last], atol=1e-5, rtol=1e-5)


def test_train_rows_sample_at_most_max_anchors_per_sequence():
    model, _, _ = _model(num_steps=3, max_anchors=5)
    lm = torch.ones(3, 20, dtype=torch.long)
    lm[2, :18] = 0  # 4 candidate anchors in the last row (t = 14..17): all kept
    am = torch.ones_like(lm)
    full = step_rows(lm, am, 3)
    torch.manual_seed(0)
    rows = model.train_rows(lm, am)
    anchors = torch.unique(torch.cat(rows))
    per_seq = torch.bincount(anchors // 20, minlength=3)
    assert per_seq.tolist() == [5, 5, 4]
    for k in range(3):
        assert set(rows[k].tolist()) <= set(full[k].tolist())
        assert set(rows[k].tolist()) == set(full[k].tolist()) & set(anchors.tolist())
    unbounded, _, _ = _model(num_steps=3)
    assert all(torch.equal(a, b) for a, b in zip(unbounded.train_rows(lm, am), full, strict=True))


def test_propose_drafts_the_block_laws_as_chains_and_trees():
    model, _, target = _model(num_steps=4, seed=6)
    batch = _batch(model, target, b=1, t=10)
    ids, taps = batch["input_ids"][0], batch["taps"][0]
    state = model.new_state(64, "cpu")
    model.absorb(state, {"taps": taps[:8]}, ids[1:9])
    laws = model.block_logits(state, int(ids[8]))
    greedy = SamplingParams(temperature=0.0)
    chain = model.propose(state, int(ids[8]), TreeConfig(kind="chain", depth=4, budget=4), greedy, None)
    assert chain.tokens[1:].tolist() == laws.argmax(-1).tolist()
    tree = model.propose(state, int(ids[8]), TreeConfig(kind="dynamic", depth=3, topk=2, budget=6), greedy, None)
    assert len(tree.tokens) == 7 and state.length == 8  # propose commits nothing
    with pytest.raises(ValueError, match="root token"):
        model.propose(state, (int(ids[8]) + 1) % VOCAB, TreeConfig(kind="chain"), greedy, None)
    empty = model.new_state(16, "cpu")
    assert len(model.propose(empty, 3, TreeConfig(kind="chain"), greedy, None).tokens) == 1


def test_loss_weights_follow_dflash_gamma():
    model, _, _ = _model(num_steps=4)
    w = model.step_weights(math.exp(-1 / 7))
    assert w[0] == 1.0 and math.isclose(w[3], math.exp(-3 / 7))
