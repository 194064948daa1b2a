"""Teacher-forced per-position acceptance matrices (alpha) and their per-cohort summaries.

For one evaluated sequence `x = prompt + continuation` (length T, prompt length P) the drafter is asked at every
position t = P-1 .. T-3 (root token x[t+1] just committed) to draft depths k = 1..D; depth k predicts x[t+1+k]
and is judged against the teacher (the target's next-token law) at position t+k. This is the alignment of
`speculators.models.base` (step k-1 at position t targets the teacher at t+k) and the depth exists iff token
x[t+1+k] is part of the continuation. The continuation is the target's own output (greedy for T=0, sampled with a
fixed seed otherwise), so feeding it as the teacher-forced input simulates the chain the runtime would draft.

- `speculator_alpha`: draft logits over the draft vocab are mapped onto the target vocab through
  `draft_to_target`; greedy -> `metrics.greedy_alpha`, sampling -> `metrics.sampled_alpha` on
  `core.sampling.logits_to_probs` of both laws (same temperature / top-k / top-p).
- `speculator_block_alpha` (sampling only): the same laws judged by block verification of the sampled chain
  (`metrics.block_alpha`: per-depth ratios of the block reach, summarised like alpha).
- `ngram_alpha`: the n-gram (prompt lookup) proposal (the served `NgramDrafter.lookup`) is a deterministic draft;
  it is accepted with probability p(x) (= `sampled_alpha(p, onehot(x))`), which for T=0 is 1[x == argmax p].
- `summarize`: `metrics.chain_reach` -> `per_position_from_reach` -> `simulated_tau`, plus tau at every depth.

This module does not run the target, load checkpoints or write files; it never branches on a speculator family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from speculators.core import metrics
from speculators.core.sampling import SamplingParams, logits_to_probs

Proposer = Callable[[list[int], int], list[int]]


def per_sequence_memo(propose: Proposer) -> Proposer:
    """`propose` with each (prefix length, depth) looked up once: valid for prefixes of ONE sequence only (a fresh
    memo per sequence), so the every-position and the cycle-starts scores of a proposer share its lookups."""
    memo: dict[tuple[int, int], list[int]] = {}

    def cached(prefix: list[int], depth: int) -> list[int]:
        key = (len(prefix), depth)
        if key not in memo:
            memo[key] = list(propose(prefix, depth))
        return memo[key]

    return cached


def positions(total_len: int, prompt_len: int) -> torch.Tensor:
    """Draft positions t = P-1 .. T-3 of a sequence (the roots x[t+1] are continuation tokens).  -> [N] long"""
    start = max(prompt_len - 1, 0)
    return torch.arange(start, max(total_len - 2, start), dtype=torch.long)


def valid_matrix(pos: torch.Tensor, total_len: int, depth: int) -> torch.Tensor:
    """valid[n, k-1] = depth k of position pos[n] predicts a token inside the sequence (pos + 1 + k <= T-1).
    [N] -> [N, D] bool"""
    ks = torch.arange(1, depth + 1, dtype=torch.long)  # [D]
    return (pos[:, None] + 1 + ks[None, :]) <= total_len - 1


def to_target_vocab(draft_logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter draft-vocab logits onto the target vocab (-inf elsewhere), as vLLM's EAGLE-3 `compute_logits` does.
    [..., Vd] -> [..., V]"""
    vd = draft_logits.shape[-1]
    if vd == vocab_size and torch.equal(draft_to_target, torch.arange(vd, device=draft_to_target.device)):
        return draft_logits
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))  # [..., V]
    out[..., draft_to_target.to(draft_logits.device)] = draft_logits
    return out


def _teacher_rows(teacher_logits: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Teacher logits at position t+k for every draft position t (clamped at the end; masked by `valid`)."""
    idx = (pos + k).clamp_max(teacher_logits.shape[0] - 1)  # [N]
    return teacher_logits[idx]  # [N, V]


def speculator_alpha(step_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor,
                     draft_to_target: torch.Tensor, prompt_len: int, params: SamplingParams,
                     depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced acceptance of a speculator's per-step logits on one sequence.

    step_logits: K tensors [T, Vd] from `forward_train` (batch row 0), step k-1 at t targets the teacher at t+k;
    teacher_logits: [T, V] target logits; depth: D <= K. Returns (alpha [N, D] float64, valid [N, D] bool).
    """
    pos, valid, laws = _speculator_laws(step_logits, teacher_logits, draft_to_target, prompt_len, depth)
    alpha = torch.zeros(pos.shape[0], depth, dtype=torch.float64)  # [N, D]
    for k, (teacher, draft) in enumerate(laws):
        if params.greedy:
            a = metrics.greedy_alpha(teacher, draft)  # [N]
        else:
            a = metrics.sampled_alpha(logits_to_probs(teacher, params), logits_to_probs(draft, params))  # [N]
        alpha[:, k] = a.double()
    return alpha * valid, valid


def speculator_alpha_scaled(step_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor,
                            draft_to_target: torch.Tensor, prompt_len: int, params: SamplingParams, depth: int,
                            scales: Sequence[float]) -> dict[float, tuple[torch.Tensor, torch.Tensor]]:
    """`speculator_alpha` at T > 0 with the draft sampling softmax(z / s) for each scale s (the draft-calibration
    scan); the teacher's law is computed once for every scale. Returns {s: (alpha [N, D] float64, valid [N, D])}."""
    if params.greedy:
        raise ValueError("the draft-calibration scan needs sampling (temperature > 0)")
    pos, valid, laws = _speculator_laws(step_logits, teacher_logits, draft_to_target, prompt_len, depth)
    teacher = [logits_to_probs(t, params) for t, _ in laws]  # D x [N, V]
    out = {}
    for s in scales:
        alpha = torch.zeros(pos.shape[0], depth, dtype=torch.float64)  # [N, D]
        for k, (p, (_, draft)) in enumerate(zip(teacher, laws, strict=True)):
            alpha[:, k] = metrics.sampled_alpha(p, logits_to_probs(draft / s, params)).double()
        out[s] = (alpha * valid, valid)
    return out


def speculator_block_alpha(step_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor,
                           draft_to_target: torch.Tensor, prompt_len: int, params: SamplingParams,
                           depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculator_alpha` for block verification of the sampled chain (T > 0): per-depth ratios of
    `metrics.block_reach` on the same filtered laws. Returns (alpha [N, D] float64, valid [N, D] bool)."""
    if params.greedy:
        raise ValueError("block verification needs sampled drafts (temperature > 0)")
    pos, valid, laws = _speculator_laws(step_logits, teacher_logits, draft_to_target, prompt_len, depth)
    if pos.numel() == 0:
        return torch.zeros(0, depth, dtype=torch.float64), valid
    target = [logits_to_probs(teacher, params) for teacher, _ in laws]  # D x [N, V]
    draft = [logits_to_probs(d, params) for _, d in laws]  # D x [N, V]
    return metrics.block_alpha(target, draft) * valid, valid


def _speculator_laws(step_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor, draft_to_target: torch.Tensor,
                     prompt_len: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(draft positions [N], valid [N, D], per depth k: (teacher logits [N, V], draft logits on the target vocab
    [N, V]))."""
    total, vocab = teacher_logits.shape
    if depth > len(step_logits):
        raise ValueError(f"depth {depth} exceeds the speculator's {len(step_logits)} steps")
    pos = positions(total, prompt_len)  # [N]
    valid = valid_matrix(pos, total, depth)  # [N, D]
    if pos.numel() == 0:
        return pos, valid, []
    laws = [(_teacher_rows(teacher_logits, pos, k).float(),  # [N, V]
             to_target_vocab(step_logits[k - 1][pos].float(), draft_to_target, vocab))  # [N, V]
            for k in range(1, depth + 1)]
    return pos, valid, laws


def ngram_alpha(token_ids: Sequence[int], teacher_logits: torch.Tensor, prompt_len: int, params: SamplingParams,
                depth: int, propose: Proposer) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced acceptance of a deterministic proposer (n-gram prompt lookup) on one sequence.

    At position t the committed context is x[:t+2] (root x[t+1] included); the proposal's depth-k token x'_k is
    accepted with probability p_{t+k}(x'_k) — i.e. `metrics.sampled_alpha(p, onehot(x'_k))`, computed as a gather.
    Missing proposals (shorter than D) are rejections. Returns (alpha [N, D] float64, valid [N, D] bool).
    """
    ids = list(token_ids)
    total = len(ids)
    pos = positions(total, prompt_len)  # [N]
    valid = valid_matrix(pos, total, depth)  # [N, D]
    alpha = torch.zeros(pos.shape[0], depth, dtype=torch.float64)  # [N, D]
    if pos.numel() == 0:
        return alpha, valid
    proposals = torch.full((pos.shape[0], depth), -1, dtype=torch.long)  # [N, D]
    for n, t in enumerate(pos.tolist()):
        drafted = list(propose(ids[: t + 2], depth))[:depth]
        if drafted:
            proposals[n, : len(drafted)] = torch.tensor(drafted, dtype=torch.long)
    for k in range(1, depth + 1):
        probs = logits_to_probs(_teacher_rows(teacher_logits, pos, k).float(), params)  # [N, V]
        tok = proposals[:, k - 1]  # [N]
        has = tok >= 0
        alpha[has, k - 1] = probs[has, tok[has]].double()
    return alpha * valid, valid


def teacher_ceilings(teacher_logits: torch.Tensor, prompt_len: int, params: SamplingParams, depth: int, topk: int,
                     draft_to_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a sampled draft's per-position acceptance sum_v min(p, q) at T > 0 can reach, set by what it is taught
    rather than by how well it learned it: a draft equal to the target's top-`topk` renormalised (the optimum of a
    top-k teacher) gets the top-k mass of p; no draft over the reduced vocabulary gets more than p's mass on that
    vocabulary (a true upper bound). Returns (top-k optimum [N, D], draft-vocab bound [N, D], valid [N, D]), laid
    out like `speculator_alpha`."""
    total = teacher_logits.shape[0]
    pos = positions(total, prompt_len)  # [N]
    valid = valid_matrix(pos, total, depth)  # [N, D]
    top = torch.zeros(pos.shape[0], depth, dtype=torch.float64)
    voc = torch.zeros(pos.shape[0], depth, dtype=torch.float64)
    for k in range(1, depth + 1):
        if pos.numel() == 0:
            break
        p = logits_to_probs(_teacher_rows(teacher_logits, pos, k).float(), params)  # [N, V]
        top[:, k - 1] = p.topk(min(topk, p.shape[-1]), dim=-1).values.sum(-1).double()
        voc[:, k - 1] = p[:, draft_to_target.to(p.device)].sum(-1).double()
    return top * valid, voc * valid, valid


@dataclass
class AlphaAccumulator:
    """Collects alpha/valid matrices per cohort and summarizes them with `speculators.core.metrics`."""

    depth: int
    alphas: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    valids: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def add(self, cohort: str, alpha: torch.Tensor, valid: torch.Tensor) -> None:
        self.alphas.setdefault(cohort, []).append(alpha)
        self.valids.setdefault(cohort, []).append(valid)
        self.rows[cohort] = self.rows.get(cohort, 0) + 1

    def summary(self) -> dict:
        """{"cohorts": {name: CohortSummary dict}, "overall": pooled summary, "mean_tau": mean of cohort taus}."""
        cohorts = {c: summarize(torch.cat(self.alphas[c]), torch.cat(self.valids[c]), self.rows[c])
                   for c in sorted(self.alphas)}
        if not cohorts:
            return {"cohorts": {}, "overall": None, "mean_tau": None}
        pooled = summarize(torch.cat([a for c in sorted(self.alphas) for a in self.alphas[c]]),
                           torch.cat([v for c in sorted(self.valids) for v in self.valids[c]]),
                           sum(self.rows.values()))
        mean_tau = sum(s["simulated_tau"] for s in cohorts.values()) / len(cohorts)
        return {"cohorts": cohorts, "overall": pooled, "mean_tau": round(mean_tau, 4)}


def summarize(alpha: torch.Tensor, valid: torch.Tensor, rows: int) -> dict:
    """Chain reach E_k, per-position acceptance a_k, simulated tau and tau at every depth d <= D."""
    reach = metrics.chain_reach(alpha, valid)  # [D]
    per_pos = metrics.per_position_from_reach(reach)
    tau_by_depth = [metrics.simulated_tau(per_pos[:d]) for d in range(1, len(per_pos) + 1)]
    return {
        "rows": rows,
        "positions": int(valid[:, 0].sum().item()) if valid.numel() else 0,
        "per_position_acceptance": [round(a, 4) for a in per_pos],
        "chain_reach": [round(e, 4) for e in reach],
        "simulated_tau": round(metrics.simulated_tau(per_pos), 4),
        "tau_by_depth": [round(t, 4) for t in tau_by_depth],
    }


def truncate(summary: dict, depth: int) -> dict:
    """An `AlphaAccumulator.summary()` restricted to depths 1..depth (to compare drafters at equal chain depth)."""

    def cut(s: dict | None) -> dict | None:
        if s is None:
            return None
        d = min(depth, len(s["per_position_acceptance"]))
        return {**s, "per_position_acceptance": s["per_position_acceptance"][:d], "chain_reach": s["chain_reach"][:d],
                "tau_by_depth": s["tau_by_depth"][:d], "simulated_tau": s["tau_by_depth"][d - 1] if d else 1.0}

    cohorts = {c: cut(s) for c, s in summary["cohorts"].items()}
    mean = round(sum(s["simulated_tau"] for s in cohorts.values()) / len(cohorts), 4) if cohorts else None
    return {"cohorts": cohorts, "overall": cut(summary["overall"]), "mean_tau": mean}
