"""The one training loss of every speculator family, and its per-step accuracy.

What it does:
- `VocabMap`: draft id -> target id (`draft_to_target`, [Vd]) and target id -> draft id (`target_to_draft`, [V],
  -1 outside the draft vocab).
- `Teacher`: the target's next-token law at every position, restricted and renormalised to the draft vocab, in one
  of two forms: dense probabilities [B, T, Vd] with their sum p log p (from full logits, or recomputed from the
  target's post-norm last hidden state with its `lm_head`, then only at the positions the loss reads:
  `loss_teacher_positions`), or sparse top-k probabilities [B, T, k] (stored by `capture` with teacher=topk). It also
  keeps the target's greedy token over the FULL vocab, so accuracy counts a miss where the target's choice is
  outside the draft vocab.
- `TeacherShape`: how the stored teacher becomes the training target: a temperature (the law the draft should match;
  1 = the target's own sampling law) and, for a sparse top-k teacher, whether the mass the target puts outside
  the stored top-k is kept as one "rest" bucket (top-k + remaining mass) instead of renormalising the top-k.
- `speculator_loss`: sum_k decay^k * L_k, where L_k is the step-k loss averaged over the positions that count for
  step k (`models.base.step_valid_mask`: token t+2+k exists, is real and is an assistant token) and where the
  teacher has mass in the draft vocab. L is `LOSSES[kind]` of the teacher p and the draft q:
  "kl" forward KL(p || q); "tv" total variation 1 - alpha with alpha = sum_v min(p(v), q(v)) (the acceptance
  probability of a sampled draft at T = 1); "lk" -log alpha (LK losses, arXiv 2602.23881); "hybrid"
  w * KL + (1 - w) * (1 - alpha) with w = exp(-3 alpha) (no gradient through w); "ce" the hard cross-entropy
  -log q(the target's greedy token) (DFlash's reference trainers; a position whose greedy token is outside the draft
  vocab does not count). With a rest bucket the sums run
  over the top-k plus the bucket (q's bucket = its mass outside the top-k ids). Step k at position t is compared with the
  teacher at t+1+k (the alignment convention of `models/base.py`). Also per-step top-1 accuracy counts
  (draft argmax mapped to a target id == the target's greedy token) and, on request, the per-position, per-step
  greedy acceptance used for the simulated chain tau.

What it does not do: run models, move data between processes, or average across gradient-accumulation steps
(each micro-batch is normalised by its own valid-token count; accelerate averages micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculators.models.base import gather_positions, select_rows, step_rows, step_valid_mask

TOPK = 8  # ranks measured for per-step top-k accuracy (Medusa static trees are built from it)
LOSSES = ("kl", "tv", "lk", "hybrid", "ce")


@dataclass(frozen=True)
class TeacherShape:
    """How the stored teacher becomes the training target (see the module docstring)."""

    temperature: float = 1.0
    rest_mass: bool = False  # sparse teachers: keep the mass outside the stored top-k as one bucket


@dataclass
class VocabMap:
    """The draft vocabulary inside the target vocabulary."""

    draft_to_target: torch.Tensor  # [Vd] long
    target_to_draft: torch.Tensor  # [V] long, -1 outside the draft vocab
    full: bool  # the draft vocab is the target vocab in the same order

    @classmethod
    def build(cls, draft_to_target: torch.Tensor, target_vocab_size: int) -> VocabMap:
        d2t = draft_to_target.long()
        vd = d2t.numel()
        full = vd == target_vocab_size and bool((d2t == torch.arange(vd, device=d2t.device)).all())
        t2d = torch.full((target_vocab_size,), -1, dtype=torch.long, device=d2t.device)
        t2d[d2t] = torch.arange(vd, device=d2t.device)
        return cls(draft_to_target=d2t, target_to_draft=t2d, full=full)

    def to(self, device: torch.device | str) -> VocabMap:
        return VocabMap(self.draft_to_target.to(device), self.target_to_draft.to(device), self.full)


@dataclass
class Teacher:
    """The target's next-token law at each position t (the law of token t+1), on the draft vocab."""

    argmax: torch.Tensor  # [B, T] long: the target's greedy token over the full vocab (or [N] rows: `at_rows`)
    p: torch.Tensor | None = None  # [B, T, Vd] float32: dense probabilities renormalised over the draft vocab
    p_log_p: torch.Tensor | None = None  # [B, T] float32: sum_v p log p of `p` (once per position, not per step)
    sparse_ids: torch.Tensor | None = None  # [B, T, k] long: draft ids of the top-k (-1: outside the draft vocab)
    sparse_p: torch.Tensor | None = None  # [B, T, k] float32: their probabilities renormalised over the draft vocab
    rest_p: torch.Tensor | None = None  # [B, T] float32: the draft-vocab mass outside the top-k (TeacherShape.rest_mass)

    def at_rows(self, flat: torch.Tensor) -> Teacher:
        """The teacher at flat positions b*T+t ([N] long): every field [B, T, ...] -> [N, ...]."""
        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else gather_positions(x, flat)

        return Teacher(argmax=pick(self.argmax), p=pick(self.p), p_log_p=pick(self.p_log_p),
                       sparse_ids=pick(self.sparse_ids), sparse_p=pick(self.sparse_p), rest_p=pick(self.rest_p))

    @property
    def has_mass(self) -> torch.Tensor:
        """[B, T] (or [N]) bool: the teacher puts some probability on the draft vocab at this position."""
        if self.p is not None:
            return torch.ones_like(self.argmax, dtype=torch.bool)
        return self.sparse_p.sum(-1) > 0


def dense_teacher(logits: torch.Tensor, vocab: VocabMap, shape: TeacherShape = TeacherShape()) -> Teacher:
    """From full target logits [B, T, V]."""
    with torch.no_grad():
        restricted = logits if vocab.full else logits.index_select(-1, vocab.draft_to_target)  # [B, T, Vd]
        p, p_log_p = _dense_law(restricted, shape.temperature)
        return Teacher(argmax=logits.argmax(-1), p=p, p_log_p=p_log_p)


def _dense_law(restricted_logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-vocab logits [..., Vd] -> (probabilities [..., Vd] float32, sum_v p log p [...])."""
    logp = F.log_softmax(restricted_logits.float() / temperature, dim=-1)
    p = logp.exp()
    return p, torch.xlogy(p, p).sum(-1)  # 0 where p underflows (a -inf logit gives 0 * -inf otherwise)


def loss_teacher_positions(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions whose law the loss reads. Step k at t reads the teacher at p = t+1+k and counts
    when token t+2+k = p+1 is a real assistant token (`models.base.step_valid_mask`), whatever k."""
    return step_valid_mask(loss_mask, attention_mask, -1)


def hidden_teacher(last_hidden: torch.Tensor, lm_head: torch.Tensor, vocab: VocabMap, chunk: int = 2048,
                   shape: TeacherShape = TeacherShape(), needed: torch.Tensor | None = None) -> Teacher:
    """Recompute the teacher from the target's post-norm last hidden state [B, T, H] and lm_head [V, H].

    One product with the whole lm_head per chunk of positions gives both the full-vocab argmax and the draft-vocab
    columns of the log-probs, so no [B, T, V] float32 tensor is ever materialised for a reduced draft vocab. With
    `needed` ([B, T] bool, `loss_teacher_positions`) only those positions are computed; the others hold argmax -1 and
    NaN probabilities, so a read of one is loud."""
    with torch.no_grad():
        b, t, hdim = last_hidden.shape
        flat = last_hidden.reshape(b * t, hdim)  # [B*T, H]
        at = None if needed is None else needed.flatten().nonzero().squeeze(-1)  # [N] flat positions
        rows = (flat if at is None else flat.index_select(0, at)).to(lm_head.dtype)  # [N, H]
        vd = vocab.draft_to_target.numel()
        argmax = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)  # [N]
        p = torch.empty(rows.shape[0], vd, dtype=torch.float32, device=rows.device)  # [N, Vd]
        p_log_p = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)  # [N]
        for i in range(0, rows.shape[0], chunk):
            logits = rows[i:i + chunk] @ lm_head.T  # [n, V]
            argmax[i:i + chunk] = logits.argmax(-1)
            restricted = logits if vocab.full else logits.index_select(-1, vocab.draft_to_target)  # [n, Vd]
            p[i:i + chunk], p_log_p[i:i + chunk] = _dense_law(restricted, shape.temperature)
        if at is not None:
            argmax = argmax.new_full((b * t,), -1).index_copy_(0, at, argmax)  # [B*T]
            p = p.new_full((b * t, vd), float("nan")).index_copy_(0, at, p)  # [B*T, Vd]
            p_log_p = p_log_p.new_full((b * t,), float("nan")).index_copy_(0, at, p_log_p)  # [B*T]
        return Teacher(argmax=argmax.view(b, t), p=p.view(b, t, vd), p_log_p=p_log_p.view(b, t))


def sparse_teacher(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab: VocabMap,
                   shape: TeacherShape = TeacherShape()) -> Teacher:
    """From stored top-k target ids [B, T, k] and their full-vocab log-probs [B, T, k]. The top-k is renormalised
    over the draft vocab (after the temperature), or with `shape.rest_mass` kept as is next to a rest bucket of
    the remaining draft-vocab mass (the top-k's mass outside the draft vocab is taken out of both)."""
    with torch.no_grad():
        best = topk_logprobs.argmax(-1, keepdim=True)  # [B, T, 1]
        argmax = topk_ids.gather(-1, best).squeeze(-1)  # [B, T]
        draft_ids = vocab.target_to_draft[topk_ids.clamp_min(0)]  # [B, T, k]
        inside = (draft_ids >= 0) & (topk_ids >= 0)
        ids = torch.where(inside, draft_ids, -1)
        if shape.rest_mass:
            full = topk_logprobs.float().exp() * (topk_ids >= 0)  # [B, T, k] full-vocab probabilities
            z = (1.0 - (full * ~inside).sum(-1, keepdim=True)).clamp_min(1e-6)  # ~ mass on the draft vocab
            p = (full * inside) / z
            rest = (1.0 - p.sum(-1)).clamp(0.0, 1.0)  # [B, T]
            return Teacher(argmax=argmax, sparse_ids=ids, sparse_p=p, rest_p=rest)
        p = (topk_logprobs.float() / shape.temperature).exp() * inside  # [B, T, k]
        z = p.sum(-1, keepdim=True)
        p = torch.where(z > 0, p / z.clamp_min(1e-30), torch.zeros_like(p))
        return Teacher(argmax=argmax, sparse_ids=ids, sparse_p=p)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable: sum_k w_k * KL_k
    step_kl: list[float]  # L_k per step (detached; the forward KL unless another loss kind was asked for)
    correct: torch.Tensor  # [K] long: positions where the draft's top-1 equals the target's greedy token
    counted: torch.Tensor  # [K] long: positions that count for step k
    alpha: torch.Tensor | None = None  # [B, T, K] greedy acceptance per position and step (0/1)
    valid: torch.Tensor | None = None  # [B, T, K] bool: step k exists for position t
    topk_correct: torch.Tensor | None = None  # [K, TOPK] long: the target's token is in the draft's top-(i+1)

    @property
    def accuracy(self) -> list[float]:
        pairs = zip(self.correct.tolist(), self.counted.tolist(), strict=True)
        return [c / n if n else 0.0 for c, n in pairs]


def _step_loss(draft_logits: torch.Tensor, teacher: Teacher, kind: str = "kl") -> torch.Tensor:
    """The loss `kind` (see the module docstring) of draft logits [..., Vd] against a teacher aligned with them
    (`Teacher.at_rows`: every field's leading dims are the logits').  -> [...]"""
    logq = F.log_softmax(draft_logits.float(), dim=-1)  # [..., Vd]
    if teacher.p is not None:
        p = teacher.p  # [..., Vd]
        logq_p = logq  # q's log-probs where p lives
        rest = None
        kl = teacher.p_log_p - (p * logq).sum(-1)  # [...]
    else:
        ids = teacher.sparse_ids  # [..., k]
        p = teacher.sparse_p  # [..., k]
        logq_p = logq.gather(-1, ids.clamp_min(0)) + torch.where(ids >= 0, 0.0, float("-inf"))  # [..., k]
        rest = teacher.rest_p  # [...] or None
        kl = (torch.xlogy(p, p) - p * logq_p.clamp_min(-1e4)).sum(-1)  # [...]
    if rest is not None:  # the rest bucket: q's mass outside the top-k ids
        q_rest = (1.0 - logq_p.exp().sum(-1)).clamp_min(1e-12)
        kl = kl + torch.xlogy(rest, rest) - rest * q_rest.log()
    if kind == "kl":
        return kl
    alpha = torch.minimum(p, logq_p.exp()).sum(-1)  # [...]
    if rest is not None:
        alpha = alpha + torch.minimum(rest, q_rest)
    if kind == "tv":
        return 1.0 - alpha
    if kind == "lk":
        return -torch.log(alpha.clamp_min(1e-6))
    w = torch.exp(-3.0 * alpha.detach())
    return w * kl + (1.0 - w) * (1.0 - alpha)


def sampled_acceptance(draft_logits: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) of draft logits [N, Vd] against the teacher aligned with them
    (`Teacher.at_rows`; with its rest bucket when it has one): the acceptance probability of a draft sampled from
    q, teacher-forced.  -> [N] float32"""
    return 1.0 - _step_loss(draft_logits, teacher, "tv")


def speculator_loss(step_logits: list[torch.Tensor], teacher: Teacher, loss_mask: torch.Tensor,
                    attention_mask: torch.Tensor, weights: list[float], vocab: VocabMap,
                    with_alpha: bool = False, kind: str = "kl", rows: list[torch.Tensor] | None = None,
                    position_weight: torch.Tensor | None = None) -> LossOutput:
    """The loss of K per-step draft logits against the teacher (see the module docstring): full logits [B, T, Vd],
    or, with `rows` (`models.base.step_rows` of these masks, the forward's "head_rows"), only the rows where step
    k counts, [N_k, Vd]. Both give the same numbers; the loss is computed on those rows either way.
    `position_weight` [B, T] (rows from traffic, data/traffic.py): each step's loss is the mean over its rows weighted
    by the weight of the position it drafts from (every step of a cycle drafted from there); None = weight 1."""
    b, t = loss_mask.shape
    n_steps = len(step_logits)
    packed = rows is not None
    rows = rows if packed else step_rows(loss_mask, attention_mask, n_steps)
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    kls: list[float] = []
    correct = torch.zeros(n_steps, dtype=torch.long)
    counted = torch.zeros(n_steps, dtype=torch.long)
    alpha = torch.zeros(b * t, n_steps) if with_alpha else None
    valid_all = torch.zeros(b * t, n_steps, dtype=torch.bool) if with_alpha else None
    topk_correct = torch.zeros(n_steps, TOPK, dtype=torch.long) if with_alpha else None
    for k, logits in enumerate(step_logits):
        here = rows[k]  # [N] flat positions b*T+t where step k counts
        logits = logits if packed else select_rows(logits, rows, k)  # [N, Vd]
        aligned = teacher.at_rows(here + 1 + k)  # the teacher at t+1+k (same sequence: t+2+k < T)
        if kind == "ce":  # the target's greedy token, hard
            token = vocab.target_to_draft[aligned.argmax]  # [N] draft ids, -1 outside the draft vocab
            counts = token >= 0  # [N] bool
            per_pos = -F.log_softmax(logits.float(), dim=-1).gather(-1, token.clamp_min(0)[:, None])[:, 0]  # [N]
        else:
            counts = aligned.has_mass  # [N] bool
            per_pos = _step_loss(logits, aligned, kind)  # [N]
        if position_weight is None:
            step_loss = (per_pos * counts).sum() / counts.sum().clamp_min(1)
        else:
            w = position_weight.reshape(-1)[here] * counts  # [N]
            step_loss = (per_pos * w).sum() / w.sum().clamp_min(1e-6)
        total = total + weights[k] * step_loss
        kls.append(float(step_loss.detach()))
        with torch.no_grad():
            hit = vocab.draft_to_target[logits.argmax(-1)] == aligned.argmax  # [N] bool
            correct[k] = int(hit.sum())
            counted[k] = int(here.numel())
            if with_alpha:
                at = here.cpu()
                alpha[at, k] = hit.float().cpu()
                valid_all[at, k] = True
                r = min(TOPK, logits.shape[-1])
                top = vocab.draft_to_target[logits.topk(r, dim=-1).indices]  # [N, r] target ids
                found = (top == aligned.argmax[:, None]).cumsum(-1) > 0  # [N, r]
                topk_correct[k, :r] = found.sum(0).cpu()
                topk_correct[k, r:] = topk_correct[k, r - 1]
    return LossOutput(loss=total, step_kl=kls, correct=correct, counted=counted,
                      alpha=None if alpha is None else alpha.view(b, t, n_steps),
                      valid=None if valid_all is None else valid_all.view(b, t, n_steps), topk_correct=topk_correct)
