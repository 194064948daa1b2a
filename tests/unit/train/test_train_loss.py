"""The training loss against hand computation: dense and sparse teachers, reduced draft vocab, step masks,
per-step decay, normalisation by valid tokens, and per-step accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.train.loss import (
    VocabMap,
    dense_teacher,
    hidden_teacher,
    loss_teacher_positions,
    sparse_teacher,
    speculator_loss,
)


def _kl(p: list[float], logq: list[float]) -> float:
    return sum(pi * (math.log(pi) - lq) for pi, lq in zip(p, logq, strict=False) if pi > 0)


def _log_softmax(x: list[float]) -> list[float]:
    m = max(x)
    z = math.log(sum(math.exp(v - m) for v in x)) + m
    return [v - z for v in x]


def _hand_loss(draft: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: list[int], attn: list[int],
               d2t_ids: list[int], weights: list[float]) -> tuple[float, list[float], list[tuple[int, int]]]:
    """Batch of one sequence; draft [K, T, Vd]; teacher_logits [T, V]."""
    k_steps, t_len, _ = draft.shape
    total, per_step, acc = 0.0, [], []
    for k in range(k_steps):
        kls, hits, n = [], 0, 0
        for t in range(t_len):
            tok = t + 2 + k
            if tok >= t_len or not loss_mask[tok] or not attn[tok]:
                continue
            full = teacher_logits[t + 1 + k].tolist()
            restricted = _log_softmax([full[i] for i in d2t_ids])
            p = [math.exp(v) for v in restricted]
            logq = _log_softmax(draft[k, t].tolist())
            kls.append(_kl(p, logq))
            n += 1
            hits += int(d2t_ids[int(draft[k, t].argmax())] == int(teacher_logits[t + 1 + k].argmax()))
        step = sum(kls) / max(1, len(kls))
        per_step.append(step)
        total += weights[k] * step
        acc.append((hits, n))
    return total, per_step, acc


@pytest.mark.parametrize("reduced", [False, True])
def test_dense_teacher_matches_hand_computation(reduced: bool) -> None:
    torch.manual_seed(0)
    t_len, v, k_steps = 9, 6, 3
    d2t_ids = [0, 2, 3, 5] if reduced else list(range(v))
    vocab = VocabMap.build(torch.tensor(d2t_ids), v)
    assert vocab.full is (not reduced)
    teacher_logits = torch.randn(t_len, v) * 2
    draft = torch.randn(k_steps, t_len, len(d2t_ids))
    loss_mask = [0, 0, 0, 1, 1, 1, 0, 1, 1]
    attn = [1] * 8 + [0]  # the last position is padding
    weights = [1.0, 0.8, 0.64]
    out = speculator_loss([draft[k][None] for k in range(k_steps)], dense_teacher(teacher_logits[None], vocab),
                          torch.tensor([loss_mask]), torch.tensor([attn]), weights, vocab)
    want, want_steps, want_acc = _hand_loss(draft, teacher_logits, loss_mask, attn, d2t_ids, weights)
    assert out.loss.item() == pytest.approx(want, rel=1e-5)
    assert out.step_kl == pytest.approx(want_steps, rel=1e-5)
    assert out.correct.tolist() == [h for h, _ in want_acc]
    assert out.counted.tolist() == [n for _, n in want_acc]


def test_hidden_teacher_equals_dense_teacher_of_the_same_logits() -> None:
    torch.manual_seed(1)
    h, lm = torch.randn(2, 7, 5), torch.randn(11, 5)
    vocab = VocabMap.build(torch.tensor([1, 4, 6, 7, 10]), 11)
    a, b = hidden_teacher(h, lm, vocab, chunk=3), dense_teacher(h @ lm.T, vocab)
    assert torch.equal(a.argmax, b.argmax)
    assert torch.allclose(a.p, b.p, atol=1e-5) and torch.allclose(a.p_log_p, b.p_log_p, atol=1e-5)


def test_hidden_teacher_at_the_needed_positions_only_gives_the_same_loss() -> None:
    """The positions the loss reads (`loss_teacher_positions`) are computed exactly as without the restriction, the
    others are NaN and argmax -1, and the loss, step losses and accuracies are unchanged."""
    torch.manual_seed(3)
    b, t, h_dim, v, k_steps = 2, 9, 6, 13, 3
    h, lm = torch.randn(b, t, h_dim), torch.randn(v, h_dim)
    vocab = VocabMap.build(torch.tensor([0, 2, 3, 5, 8, 9, 12]), v)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    attn = torch.tensor([[1] * 9, [1] * 7 + [0, 0]])
    needed = loss_teacher_positions(loss_mask, attn)
    assert needed.tolist() == [[False, False, True, True, True, False, True, True, False],
                               [True, True, True, True, True, True, False, False, False]]
    full = hidden_teacher(h, lm, vocab, chunk=4)
    part = hidden_teacher(h, lm, vocab, chunk=4, needed=needed)
    assert torch.equal(part.argmax[needed], full.argmax[needed]) and (part.argmax[~needed] == -1).all()
    assert torch.allclose(part.p[needed], full.p[needed], atol=1e-6) and part.p[~needed].isnan().all()
    draft = [torch.randn(b, t, 7) for _ in range(k_steps)]
    weights = [1.0, 0.8, 0.64]
    a = speculator_loss(draft, full, loss_mask, attn, weights, vocab, with_alpha=True)
    c = speculator_loss(draft, part, loss_mask, attn, weights, vocab, with_alpha=True)
    assert torch.isfinite(c.loss) and c.loss.item() == pytest.approx(a.loss.item(), rel=1e-6)
    assert c.step_kl == pytest.approx(a.step_kl, rel=1e-6)
    assert torch.equal(c.correct, a.correct) and torch.equal(c.counted, a.counted)
    assert torch.equal(c.alpha, a.alpha)


def test_sparse_teacher_restricts_renormalises_and_masks_positions_without_mass() -> None:
    v, vd = 8, 4
    d2t_ids = [1, 2, 5, 7]
    vocab = VocabMap.build(torch.tensor(d2t_ids), v)
    t_len = 5
    # top-3 of the teacher at each position (target ids, full-vocab log-probs)
    ids = torch.tensor([[1, 3, 5], [0, 3, 4], [7, 2, 0], [5, 1, 6], [2, 7, 1]])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.4, 0.4, 0.1], [0.7, 0.2, 0.05],
                                       [0.5, 0.25, 0.2]]))
    teacher = sparse_teacher(ids[None], logprobs[None], vocab)
    assert teacher.argmax[0].tolist() == [1, 0, 7, 5, 2]
    assert teacher.has_mass[0].tolist() == [True, False, True, True, True]  # position 1: no top-k id in the vocab
    torch.manual_seed(2)
    draft = torch.randn(1, t_len, vd)
    loss_mask = torch.ones(1, t_len, dtype=torch.long)
    out = speculator_loss([draft], teacher, loss_mask, torch.ones_like(loss_mask), [1.0], vocab)
    # step 0 at t targets the teacher at t+1, counted for t+2 < 5 -> t in {0, 1, 2}; t=0 reads position 1 (no mass)
    expected = []
    for t in (1, 2):
        pos = t + 1
        p_raw = {int(i): math.exp(float(lp)) for i, lp in zip(ids[pos], logprobs[pos], strict=True)
                 if int(i) in d2t_ids}
        z = sum(p_raw.values())
        logq = _log_softmax(draft[0, t].tolist())
        expected.append(sum(pv / z * (math.log(pv / z) - logq[d2t_ids.index(i)]) for i, pv in p_raw.items()))
    assert out.loss.item() == pytest.approx(sum(expected) / 2, rel=1e-5)
    assert out.counted.tolist() == [3]  # accuracy counts every valid position, a miss where argmax is outside


def test_step_valid_mask_alignment_and_normalisation_by_valid_tokens() -> None:
    """Only positions whose predicted token is an assistant token count, and each step is a mean over them:
    doubling the number of prompt tokens must not change the loss."""
    torch.manual_seed(3)
    v = 5
    vocab = VocabMap.build(torch.arange(v), v)
    logits = torch.randn(1, 6, v)
    draft = torch.randn(1, 6, v)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = speculator_loss([draft], dense_teacher(logits, vocab), mask, torch.ones_like(mask), [1.0], vocab)
    assert out.counted.tolist() == [3]  # t = 1, 2, 3 predict tokens 3, 4, 5
    pad_logits = torch.cat([torch.randn(1, 4, v), logits], 1)
    pad_draft = torch.cat([torch.randn(1, 4, v), draft], 1)
    pad_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), mask], 1)
    out2 = speculator_loss([pad_draft], dense_teacher(pad_logits, vocab), pad_mask, torch.ones_like(pad_mask), [1.0],
                           vocab)
    assert out2.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    # a prompt-only batch contributes nothing (and no NaN)
    none = speculator_loss([draft], dense_teacher(logits, vocab), torch.zeros_like(mask), torch.ones_like(mask),
                           [1.0], vocab)
    assert none.loss.item() == 0.0 and none.counted.tolist() == [0]


def test_position_weights_weigh_the_positions_each_step_drafts_from() -> None:
    """Rows from traffic weigh each position (data/traffic.py): weights of 1 give the plain loss, and a weight on
    one position alone gives that position's loss, at every step (step k at t drafts from t, reads the teacher at
    t+1+k)."""
    torch.manual_seed(5)
    v, t = 7, 8
    vocab = VocabMap.build(torch.arange(v), v)
    logits, mask = torch.randn(1, t, v), torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    draft = [torch.randn(1, t, v) for _ in range(2)]
    teacher, ones = dense_teacher(logits, vocab), torch.ones_like(mask)
    plain = speculator_loss(draft, teacher, mask, ones, [1.0, 0.5], vocab)
    same = speculator_loss(draft, teacher, mask, ones, [1.0, 0.5], vocab, position_weight=torch.ones(1, t))
    assert same.loss.item() == pytest.approx(plain.loss.item(), rel=1e-6)
    at = torch.zeros(1, t)
    at[0, 3] = 5.0  # step 0 at t=3 reads the teacher at 4 (the law of token 5); step 1 at t=3 reads it at 5
    only = speculator_loss(draft, teacher, mask, ones, [1.0, 0.0], vocab, position_weight=at)
    one_row = torch.zeros_like(mask)
    one_row[0, 5] = 1
    alone = speculator_loss([draft[0]], teacher, one_row, ones, [1.0], vocab)
    assert only.loss.item() == pytest.approx(alone.loss.item(), rel=1e-5)
    tilted = speculator_loss(draft, teacher, mask, ones, [1.0, 0.5], vocab, position_weight=1.0 + at)
    assert tilted.loss.item() != pytest.approx(plain.loss.item(), rel=1e-3)


def test_per_step_decay_weights_and_perfect_draft_has_zero_loss() -> None:
    torch.manual_seed(4)
    v, t_len = 6, 8
    vocab = VocabMap.build(torch.arange(v), v)
    logits = torch.randn(1, t_len, v)
    teacher = dense_teacher(logits, vocab)
    perfect = [torch.cat([logits[:, 1 + k:], torch.zeros(1, 1 + k, v)], 1) for k in range(3)]
    mask = torch.ones(1, t_len, dtype=torch.long)
    out = speculator_loss(perfect, teacher, mask, mask, [1.0, 0.8, 0.64], vocab, with_alpha=True)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    assert out.accuracy == [1.0, 1.0, 1.0]
    assert out.alpha[out.valid].min().item() == 1.0
    assert out.topk_correct[:, 0].tolist() == out.counted.tolist()
    noisy = [p + torch.randn_like(p) for p in perfect]
    a = speculator_loss(noisy, teacher, mask, mask, [1.0, 0.0, 0.0], vocab)
    b = speculator_loss(noisy, teacher, mask, mask, [1.0, 0.5, 0.25], vocab)
    assert b.loss.item() == pytest.approx(a.step_kl[0] + 0.5 * a.step_kl[1] + 0.25 * a.step_kl[2], rel=1e-5)


def test_loss_gradient_is_soft_cross_entropy_gradient() -> None:
    torch.manual_seed(5)
    v = 4
    vocab = VocabMap.build(torch.arange(v), v)
    logits = torch.randn(1, 3, v)
    draft = torch.randn(1, 3, v, requires_grad=True)
    mask = torch.tensor([[0, 0, 1]])
    out = speculator_loss([draft], dense_teacher(logits, vocab), mask, torch.ones_like(mask), [1.0], vocab)
    out.loss.backward()
    expected = torch.softmax(draft[0, 0].detach(), -1) - torch.softmax(logits[0, 1], -1)
    assert torch.allclose(draft.grad[0, 0], expected, atol=1e-6)
    assert draft.grad[0, 1:].abs().max().item() == 0.0


# ------------------------------------------------------------------------------------------------------------------
# acceptance-targeting losses and the shape of the teacher


def _one_position(kind: str, p: list[float], logits: list[float]) -> float:
    """The step-0 loss of one counted position: teacher p (dense, over the full vocab) vs draft logits."""
    from speculators.train.loss import LOSSES

    assert kind in LOSSES
    v = len(p)
    vocab = VocabMap.build(torch.arange(v), v)
    teacher_logits = torch.log(torch.tensor([p, p, p]))  # [T=3, V]; position 0 is judged against teacher row 1
    draft = torch.tensor([logits, logits, logits])[None]  # [1, T, V]
    out = speculator_loss([draft], dense_teacher(teacher_logits[None], vocab), torch.tensor([[0, 0, 1]]),
                          torch.ones(1, 3, dtype=torch.long), [1.0], vocab, kind=kind)
    return out.loss.item()


@pytest.mark.parametrize("kind", ["kl", "tv", "lk", "hybrid", "ce"])
def test_acceptance_losses_match_hand_computation(kind: str) -> None:
    p = [0.6, 0.3, 0.1]
    logits = [0.2, 1.0, -0.5]
    q = [math.exp(v) for v in _log_softmax(logits)]
    alpha = sum(min(a, b) for a, b in zip(p, q, strict=True))
    kl = _kl(p, _log_softmax(logits))
    w = math.exp(-3 * alpha)
    want = {"kl": kl, "tv": 1 - alpha, "lk": -math.log(alpha), "hybrid": w * kl + (1 - w) * (1 - alpha),
            "ce": -_log_softmax(logits)[0]}[kind]  # ce: the target's greedy token (id 0), whatever its probability
    assert _one_position(kind, p, logits) == pytest.approx(want, rel=1e-5)


def test_acceptance_losses_have_gradients_toward_the_teacher() -> None:
    p = torch.tensor([0.7, 0.2, 0.1])
    for kind in ("tv", "lk", "hybrid"):
        logits = torch.zeros(1, 3, 3, requires_grad=True)
        vocab = VocabMap.build(torch.arange(3), 3)
        out = speculator_loss([logits], dense_teacher(torch.log(p).expand(1, 3, 3), vocab), torch.tensor([[0, 0, 1]]),
                              torch.ones(1, 3, dtype=torch.long), [1.0], vocab, kind=kind)
        out.loss.backward()
        assert logits.grad[0, 0, 0] < 0 < logits.grad[0, 0, 2]  # raise the likely token, lower the unlikely one


def test_teacher_temperature_and_rest_mass() -> None:
    from speculators.train.loss import TeacherShape, _step_loss

    v = 6
    vocab = VocabMap.build(torch.tensor([0, 1, 2, 3, 4]), v)  # token 5 is outside the draft vocab
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    logp_full = torch.log_softmax(logits, -1)
    # temperature: the dense teacher is the tempered law restricted to the draft vocab
    t = dense_teacher(logits.expand(1, 1, v), vocab, TeacherShape(temperature=0.5))
    torch.testing.assert_close(t.p[0, 0], torch.softmax(logits[:5] / 0.5, -1))
    # top-3 + rest: the stored probabilities are kept and the remaining draft-vocab mass is one bucket
    ids = torch.tensor([[[0, 1, 5]]])
    lp = logp_full[ids]
    st = sparse_teacher(ids, lp, vocab, TeacherShape(rest_mass=True))
    z = 1 - logp_full[5].exp()
    torch.testing.assert_close(st.sparse_p[0, 0, :2], logp_full[:2].exp() / z)
    assert st.sparse_ids[0, 0].tolist() == [0, 1, -1] and st.sparse_p[0, 0, 2] == 0
    assert st.rest_p[0, 0].item() == pytest.approx(1 - (logp_full[:2].exp().sum() / z).item(), rel=1e-5)
    draft = torch.randn(1, 2, 5)  # [B, T, Vd]; position 0 is judged against teacher position 1
    teacher = sparse_teacher(ids.expand(1, 2, 3), lp.expand(1, 2, 3), vocab, TeacherShape(rest_mass=True))
    q = torch.softmax(draft[0, 0], -1)
    p2, rest = teacher.sparse_p[0, 1, :2], teacher.rest_p[0, 1]
    q_rest = 1 - q[:2].sum()
    want_kl = (p2 * (p2.log() - q[:2].log())).sum() + rest * (rest.log() - q_rest.log())
    aligned = teacher.at_rows(torch.tensor([1]))  # position 0's step 0 is judged against teacher position 1
    assert _step_loss(draft[0, :1], aligned, "kl")[0].item() == pytest.approx(want_kl.item(), rel=1e-5)
    want_alpha = torch.minimum(p2, q[:2]).sum() + torch.minimum(rest, q_rest)
    assert _step_loss(draft[0, :1], aligned, "tv")[0].item() == pytest.approx(1 - want_alpha.item(), rel=1e-5)


def test_dense_teacher_with_masked_logits_keeps_a_finite_loss() -> None:
    """Targets that mask tokens with -inf logits: the teacher's entropy term and the loss stay finite."""
    logits = torch.tensor([[[2.0, float("-inf"), 0.5, -1.0]]])  # [1, 1, 4]
    vocab = VocabMap.build(torch.arange(4), 4)
    teacher = dense_teacher(logits.expand(1, 4, 4).contiguous(), vocab)
    assert torch.isfinite(teacher.p_log_p).all() and teacher.p[0, 0, 1] == 0
    out = speculator_loss([torch.randn(1, 4, 4)], teacher, torch.ones(1, 4), torch.ones(1, 4), [1.0], vocab)
    assert torch.isfinite(out.loss)


def test_hard_cross_entropy_skips_greedy_tokens_outside_the_draft_vocab() -> None:
    """ce counts a position only where the target's greedy token is in the draft vocab: there it is
    -log q(token); with every greedy token outside, the loss is 0 and nothing is counted as a loss position."""
    teacher_logits = torch.tensor([[0.0, 0.0, 3.0, 0.0]] * 3)[None]  # [1, T=3, V=4]: greedy token 2 everywhere
    logits = torch.tensor([[0.5, -0.2]] * 3)[None]  # [1, T, Vd=2]
    mask, attn = torch.tensor([[0, 0, 1]]), torch.ones(1, 3, dtype=torch.long)
    inside = VocabMap.build(torch.tensor([2, 0]), 4)  # draft id 0 = target 2
    out = speculator_loss([logits], dense_teacher(teacher_logits, inside), mask, attn, [1.0], inside, kind="ce")
    assert out.loss.item() == pytest.approx(-_log_softmax([0.5, -0.2])[0], rel=1e-6)
    outside = VocabMap.build(torch.tensor([0, 1]), 4)
    out = speculator_loss([logits], dense_teacher(teacher_logits, outside), mask, attn, [1.0], outside, kind="ce")
    assert out.loss.item() == 0.0
