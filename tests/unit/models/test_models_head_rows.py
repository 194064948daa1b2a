"""Training computes each step's head only at the positions where its loss counts (`models.base.step_rows`): the
same loss, accuracies, held-out acceptance and gradients as the full [B, T, Vd] logits, for every family."""

from __future__ import annotations

import pytest
import torch
from models_helpers import (
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    reduced_vocab,
    target_features,
)

from speculators.evaluate.drafts import draft_logits
from speculators.models.base import live_rows, step_rows, step_valid_mask
from speculators.train.loss import TeacherShape, VocabMap, dense_teacher, sparse_teacher, speculator_loss


def _batch(target, layer_ids, masks: str = "random"):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (3, 16), generator=g)  # [B, T]
    attention = torch.ones_like(ids)
    attention[1, 11:] = 0  # a padded row
    if masks == "random":
        loss_mask = (torch.rand(ids.shape, generator=g) > 0.4).long() * attention  # [B, T] assistant positions
    else:  # a prompt, then one answer: the later steps' positions are a strict subset
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, 9:14] = loss_mask[1, 6:11] = loss_mask[2, 12:] = 1
    with torch.no_grad():
        feats = target_features(target, ids, layer_ids)
        logits = target(input_ids=ids).logits  # [B, T, V]
    return {"input_ids": ids, "attention_mask": attention, **feats}, loss_mask, logits


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
@pytest.mark.parametrize(("sparse", "masks"), [(False, "random"), (True, "random"), (True, "answers")])
def test_head_rows_give_the_full_logits_loss_and_gradients(family: str, sparse: bool, masks: str) -> None:
    d2t, _ = reduced_vocab(VOCAB, 120) if family == "eagle3" else (None, None)
    model, _, target = build(family, num_steps=3, d2t=d2t)
    randomize(model, scale=0.2)
    layer_ids = list(model.required_features().tap_layer_ids or []) or None
    batch, loss_mask, target_logits = _batch(target, layer_ids, masks)
    vocab = VocabMap.build(model.draft_to_target, VOCAB)
    if sparse:
        top = target_logits.log_softmax(-1).topk(8, dim=-1)
        teacher = sparse_teacher(top.indices, top.values, vocab, TeacherShape(rest_mass=True))
    else:
        teacher = dense_teacher(target_logits, vocab)
    weights = [1.0, 0.8, 0.64]
    attention = batch["attention_mask"]
    rows = step_rows(loss_mask, attention, 3)
    for k, r in enumerate(rows):  # flat positions b*T+t of the step-k mask, in order
        assert r.tolist() == step_valid_mask(loss_mask, attention, k).flatten().nonzero().flatten().tolist()
    assert all(r.numel() > 0 for r in rows)
    live = live_rows(rows)  # where steps 1..K-1 of a recurrent family run
    assert live.tolist() == sorted(set(rows[1].tolist()) | set(rows[2].tolist()))
    if masks == "answers":
        assert live.numel() < batch["input_ids"].numel() // 2

    full_logits = model.forward_train(batch)
    full = speculator_loss(full_logits, teacher, loss_mask, attention, weights, vocab, with_alpha=True)
    full.loss.backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    packed_logits = model.forward_train({**batch, "head_rows": rows})
    assert [tuple(x.shape) for x in packed_logits] == [(r.numel(), full_logits[0].shape[-1]) for r in rows]
    packed = speculator_loss(packed_logits, teacher, loss_mask, attention, weights, vocab, with_alpha=True, rows=rows)
    packed.loss.backward()
    torch.testing.assert_close(packed.loss, full.loss)
    assert packed.step_kl == pytest.approx(full.step_kl, rel=1e-5)
    assert packed.correct.tolist() == full.correct.tolist() and packed.counted.tolist() == full.counted.tolist()
    assert torch.equal(packed.alpha, full.alpha) and torch.equal(packed.valid, full.valid)
    assert torch.equal(packed.topk_correct, full.topk_correct)
    assert full_grads and set(full_grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, g in full_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-4, atol=1e-6)


def test_a_wrong_row_changes_the_loss() -> None:
    """The rows are used, not ignored: shifting one step's rows gives another loss."""
    model, _, target = build("mtp", num_steps=2)
    randomize(model, scale=0.2)
    batch, loss_mask, target_logits = _batch(target, None)
    vocab = VocabMap.build(model.draft_to_target, VOCAB)
    teacher = dense_teacher(target_logits, vocab)
    rows = step_rows(loss_mask, batch["attention_mask"], 2)
    with torch.no_grad():
        right = speculator_loss(model.forward_train({**batch, "head_rows": rows}), teacher, loss_mask,
                                batch["attention_mask"], [1.0, 1.0], vocab, rows=rows)
        shifted = [rows[0].roll(1), rows[1]]
        wrong = speculator_loss(model.forward_train({**batch, "head_rows": shifted}), teacher, loss_mask,
                                batch["attention_mask"], [1.0, 1.0], vocab, rows=rows)
    assert abs(float(right.loss) - float(wrong.loss)) > 1e-4


@pytest.mark.parametrize("family", ["eagle3", "medusa", "dflash"])
def test_a_batch_where_nothing_counts(family: str) -> None:
    """No assistant token: every step has no rows, the loss is 0 and backward still runs."""
    model, _, target = build(family, num_steps=3)
    layer_ids = list(model.required_features().tap_layer_ids or []) or None
    batch, loss_mask, target_logits = _batch(target, layer_ids)
    vocab = VocabMap.build(model.draft_to_target, VOCAB)
    none = torch.zeros_like(loss_mask)
    rows = step_rows(none, batch["attention_mask"], 3)
    out = speculator_loss(model.forward_train({**batch, "head_rows": rows}), dense_teacher(target_logits, vocab),
                          none, batch["attention_mask"], [1.0, 1.0, 1.0], vocab, rows=rows)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and out.counted.tolist() == [0, 0, 0]


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
@pytest.mark.parametrize(("prompt_len", "depth"), [(9, 2), (1, 3), (15, 3)])
def test_evaluation_drafts_only_where_it_scores(family: str, prompt_len: int, depth: int) -> None:
    """`evaluate.drafts.draft_logits` (the head only at t = P-2 .. T-3 and steps < depth) gives the full forward's
    logits at every row evaluation reads, and nothing elsewhere."""
    d2t, _ = reduced_vocab(VOCAB, 120) if family == "eagle3" else (None, None)
    model, _, target = build(family, num_steps=3, d2t=d2t)
    randomize(model, scale=0.2)
    model.eval()
    layer_ids = list(model.required_features().tap_layer_ids or []) or None
    batch, _, _ = _batch(target, layer_ids)
    ids = batch["input_ids"][:1]  # [1, T]
    feats = {k: v[:1] for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        full = model.forward_train({"input_ids": ids, "attention_mask": torch.ones_like(ids), **feats})  # K x [1, T, Vd]
    steps = draft_logits(model, ids[0].tolist(), feats, prompt_len, depth)
    total = ids.shape[1]
    read = list(range(max(prompt_len - 2, 0), total - 2))
    assert read and len(steps) == 3
    for k, step in enumerate(steps):
        assert step.shape == full[k][0].shape and step.dtype == torch.float32
        if k < depth:
            torch.testing.assert_close(step[read], full[k][0, read], rtol=1e-5, atol=1e-5)
        others = [t for t in range(total) if k >= depth or t not in read]
        assert torch.count_nonzero(step[others]) == 0
