"""The training levers of issue 46 on tiny random models: the attention of TTT steps >= 1 at the live rows only
(`models/ttt_live.py`) gives today's loss and gradients (the scatter-into-T x T path it replaced is kept here as the
reference); EAGLE-3's `freeze_lm_head` and `norm_from_target`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_helpers import (
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    reduced_vocab,
    target_features,
    tiny_target,
)

import speculators.models.recurrent as recurrent
from speculators.core.config import SpeculatorConfig
from speculators.core.errors import SpeculatorsError
from speculators.models import SPECULATORS
from speculators.models.base import step_rows
from speculators.models.io import target_weights
from speculators.models.layers import TTTAttention, ttt_attention
from speculators.train.loss import VocabMap, dense_teacher, speculator_loss

# ----------------------------------------------------------------------------------------------------------------
# the path before issue 46, verbatim: live queries scattered into [B, n, T, hd], the whole T x T recomputed


def _unpack_heads(x: torch.Tensor, live: torch.Tensor, b: int, t: int) -> torch.Tensor:
    n, hd = x.shape[1], x.shape[3]
    rows = x[0].transpose(0, 1)  # [N, n, hd]
    full = rows.new_zeros(b * t, n, hd).index_copy(0, live, rows)  # [B*T, n, hd]
    return full.view(b, t, n, hd).transpose(1, 2)


def _pack_heads(x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    b, n, t, hd = x.shape
    return x.transpose(1, 2).reshape(b * t, n, hd).index_select(0, live).transpose(0, 1).unsqueeze(0)


class ScatterTTTAttention(TTTAttention):
    def for_step(self, step, live=None):
        def attend(i, q, k, v):
            if step == 0:
                self.k0[i], self.v0[i] = k, v
                return ttt_attention(q, k, v, self.mask0, [], [])
            b, t = self.k0[i].shape[0], self.k0[i].shape[2]
            if live is not None:
                q, k, v = (_unpack_heads(x, live, b, t) for x in (q, k, v))
            self.dk[i].append(k)
            self.dv[i].append(v)
            out = ttt_attention(q, self.k0[i], self.v0[i], self.mask0, self.dk[i], self.dv[i])
            return out if live is None else _pack_heads(out, live)

        return attend


def _padded_batch(target, layer_ids, seed: int = 0) -> dict:
    """3 rows of unequal length (right padding) with prompt / assistant loss masks of unequal spans."""
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 17
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, 12:] = 0
    am[2, 9:] = 0
    lm = torch.zeros(b, t, dtype=torch.long)
    lm[0, 4:15] = 1
    lm[1, 6:12] = 1
    lm[2, 3:5] = 1
    lm[2, 6:9] = 1
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, **target_features(target, ids, layer_ids)}


def _loss_and_grads(model, target, batch, vocab, monkeypatch, scatter: bool):
    if scatter:
        monkeypatch.setattr(recurrent, "TTTAttention", ScatterTTTAttention)
    else:
        monkeypatch.setattr(recurrent, "TTTAttention", TTTAttention)
    teacher = dense_teacher(target(batch["input_ids"]).logits, vocab)
    rows = step_rows(batch["loss_mask"], batch["attention_mask"], model.num_steps)
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    inputs["head_rows"] = rows
    model.zero_grad(set_to_none=True)
    out = speculator_loss(model.forward_train(inputs), teacher, batch["loss_mask"], batch["attention_mask"],
                          [0.8 ** k for k in range(model.num_steps)], vocab, rows=rows)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("target_family", "draft_arch", "num_layers"),
                         [("llama", "llama", 1), ("qwen3", "qwen3", 2)])
def test_live_attention_gives_todays_loss_and_gradients(target_family, draft_arch, num_layers, monkeypatch):
    d2t, _ = reduced_vocab(VOCAB, 64)
    model, _, target = build("eagle3", target_family, draft_arch=draft_arch, num_steps=4, d2t=d2t,
                             num_layers=num_layers)
    randomize(model, seed=3, scale=0.2)
    vocab = VocabMap.build(model.draft_to_target, VOCAB)
    batch = _padded_batch(target, model.layer_ids)
    ref_loss, ref_grads = _loss_and_grads(model, target, batch, vocab, monkeypatch, scatter=True)
    loss, grads = _loss_and_grads(model, target, batch, vocab, monkeypatch, scatter=False)
    assert ref_grads.keys() == grads.keys() and len(grads) > 5
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * max(1.0, abs(float(ref_loss)))
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_exactness_check_catches_a_live_attention_that_drops_the_diagonal(monkeypatch):
    """The comparison above is sharp: forgetting the keys of steps 1..k at the query's own position moves the loss."""
    import speculators.models.layers as layers

    d2t, _ = reduced_vocab(VOCAB, 64)
    model, _, target = build("eagle3", num_steps=3, d2t=d2t)
    randomize(model, seed=3, scale=0.2)
    vocab = VocabMap.build(model.draft_to_target, VOCAB)
    batch = _padded_batch(target, model.layer_ids)
    ref_loss, _ = _loss_and_grads(model, target, batch, vocab, monkeypatch, scatter=True)
    real = layers.live_attention
    monkeypatch.setattr(layers, "live_attention", lambda q, k0, v0, m, dk, dv, live: real(q, k0, v0, m, dk[:1], dv[:1], live))
    loss, _ = _loss_and_grads(model, target, batch, vocab, monkeypatch, scatter=False)
    assert abs(float(loss) - float(ref_loss)) > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# frozen head rows, the final norm from the target


def test_freeze_lm_head_keeps_the_copied_rows_while_the_rest_trains():
    d2t, ids = reduced_vocab(VOCAB, 48)
    model, _, target = build("eagle3", num_steps=2, d2t=d2t, freeze_lm_head=True)
    assert not model.lm_head.weight.requires_grad
    assert model.config_dict()["speculators_native"]["freeze_lm_head"] is True
    head0 = model.lm_head.weight.detach().clone()
    others0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids_b = torch.randint(0, VOCAB, (2, 10), generator=g)
        batch = {"input_ids": ids_b, "attention_mask": torch.ones_like(ids_b),
                 **target_features(target, ids_b, model.layer_ids)}
        sum(x.logsumexp(-1).mean() for x in model.forward_train(batch)).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.lm_head.weight, head0)
    assert torch.equal(head0, target.lm_head.weight[ids])
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, others0[n])]
    assert "fc.weight" in moved and "layers.0.self_attn.q_proj.weight" in moved and "norm.weight" in moved


def test_default_head_is_trainable_and_the_default_config_is_unchanged():
    model, _, _ = build("eagle3", num_steps=2)
    assert model.lm_head.weight.requires_grad
    native = model.config_dict()["speculators_native"]
    assert "freeze_lm_head" not in native and "norm_from_target" not in native
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_norm_from_target_copies_the_targets_final_norm():
    cfg, target = tiny_target("llama")
    weights = target_weights(target)
    final = torch.linspace(-2.1, 3.3, weights.final_norm.shape[0])  # a trained target's norm is not all ones
    weights = dataclasses.replace(weights, final_norm=final)
    spec = SpeculatorConfig(family="eagle3", num_steps=2, norm_from_target=True)
    model = SPECULATORS["eagle3"].from_target(cfg, spec, weights)
    assert torch.equal(model.norm.weight, final) and model.norm.weight.requires_grad
    assert model.config_dict()["speculators_native"]["norm_from_target"] is True
    plain = SPECULATORS["eagle3"].from_target(cfg, dataclasses.replace(spec, norm_from_target=False), weights)
    assert torch.equal(plain.norm.weight, torch.ones_like(final))


def test_a_frozen_head_without_the_target_rows_is_refused():
    with pytest.raises(SpeculatorsError, match="init_lm_head_from_target"):
        build("eagle3", num_steps=2, freeze_lm_head=True, init_lm_head_from_target=False)
