"""Predicted serving acceptance: the runtime's draft -> verify -> commit cycles replayed on the target's own
continuation, without running the target.

Why: the teacher-forced numbers of `alpha.py` average over EVERY position of a sequence. A server drafts only at
the positions where a cycle starts (the root after the last commit): after an easy stretch it jumps far, after a
hard one it moves one token. Cycle starts therefore sample hard positions more often than the every-position
average does, and its tau overstates what serving measures (tau is a harmonic-like mean over cycles). This
module predicts what a server measures by walking the same cycles.

One definition (`metrics.AcceptanceStats`, one record per target call): cycle c starts at root x[t+1] (the first
cycle at the last prompt token, t = P-2); it drafts up to depth min(K, remaining - 1) (the runtime's cap), accepts
L drafts, commits L + 1 tokens (L when the last accepted draft is the end of the output, e.g. EOS) and the next
cycle starts at t + L + 1.

- Deterministic drafts (argmax chains, top-k / static trees, n-gram): the runtime's verification accepts exactly
  the drafts that equal the target's own next tokens — greedy at T = 0, and at T > 0 "deterministic" verification
  (accept a child with the target's probability of it, renormalise on rejection) is distributed exactly as "draw
  the target's token, accept the child that equals it". The continuation IS such a draw, so L = the longest
  drafted prefix of the continuation: the replay is exact (per sample path at T = 0, in distribution at T > 0).
  `replay_drafter` drives any drafter through the runtime protocol (`new_state` / `absorb` / `propose`, the
  runtime's own `prune_tree` and depth rule) with the teacher pass's features.
- Sampled chains at T > 0 (verified with min(1, p/q) and the residual): P(L >= k) = sum over draft paths of
  prod_j min(p_j, q_j). With the continuation x ~ p, the importance weight w_j = min(1, q_j(x_j) / p_j(x_j))
  gives an unbiased estimate prod_{j<=k} w_j (each factor in [0, 1]); the laws q_j come from `forward_train`
  (teacher-forced prefix = the continuation) after the same temperature / top-k / top-p as p_j. At T = 0 w_j is
  the greedy indicator. `chain_weights` computes w; `replay_chain` runs the cycles in expectation (the position
  of the next cycle is a distribution; every position carries the probability that a cycle starts there).

Both return `CycleCounts` (float counters laid out like `AcceptanceStats`). This module does not run the target,
load checkpoints or write files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators.core import metrics
from speculators.core.sampling import SamplingParams, logits_to_probs
from speculators.evaluate.alpha import to_target_vocab
from speculators.runtime.drafters.load import prune_tree

Z95 = 1.959963984540054


@dataclass
class CycleCounts:
    """Per-depth attempts / accepts (expected or counted), target calls and committed tokens of a set of cycles."""

    depth: int
    attempts: list[float] = field(default_factory=list)  # attempts[k-1]: cycles that drafted depth k with 1..k-1 in
    accepts: list[float] = field(default_factory=list)  # accepts[k-1]: cycles that accepted depth k
    calls: float = 0.0
    committed: float = 0.0
    committed_sq: float = 0.0  # sum over cycles of committed^2 (spread of tau; counted replays only)

    def __post_init__(self) -> None:
        self.attempts = self.attempts or [0.0] * self.depth
        self.accepts = self.accepts or [0.0] * self.depth

    def add_cycle(self, weight: float, reach: Sequence[float], cap: int, committed_if: Sequence[float]) -> None:
        """One cycle start with probability `weight`: reach[k] = P(L >= k) for k = 0..cap (reach[0] = 1);
        committed_if[l] = tokens committed when exactly l drafts are accepted."""
        for k in range(1, cap + 1):
            self.attempts[k - 1] += weight * reach[k - 1]
            self.accepts[k - 1] += weight * reach[k]
        self.calls += weight
        for n in range(cap + 1):
            p_exact = reach[n] - (reach[n + 1] if n < cap else 0.0)
            self.committed += weight * p_exact * committed_if[n]
            self.committed_sq += weight * p_exact * committed_if[n] ** 2

    def merge(self, other: CycleCounts) -> None:
        for k in range(min(self.depth, other.depth)):
            self.attempts[k] += other.attempts[k]
            self.accepts[k] += other.accepts[k]
        self.calls += other.calls
        self.committed += other.committed
        self.committed_sq += other.committed_sq

    @property
    def tau(self) -> float:
        return self.committed / self.calls if self.calls else 0.0

    def per_position(self) -> list[float]:
        """a_k for every depth attempted at least once (as `AcceptanceStats.per_position_acceptance`)."""
        return [a / n for a, n in zip(self.accepts, self.attempts, strict=True) if n > 0]

    def to_dict(self) -> dict:
        return {"tau": round(self.tau, 4), "target_calls": round(self.calls, 2),
                "committed_tokens": round(self.committed, 2),
                "per_position_acceptance": [round(a, 4) for a in self.per_position()],
                "attempts": [round(a, 2) for a in self.attempts], "accepts": [round(a, 2) for a in self.accepts]}


def from_stats(stats: metrics.AcceptanceStats, depth: int) -> CycleCounts:
    """The runtime's counters as `CycleCounts` (live measurements)."""
    c = CycleCounts(depth)
    for k in range(min(depth, len(stats.attempts))):
        c.attempts[k] = float(stats.attempts[k])
        c.accepts[k] = float(stats.accepts[k])
    c.calls, c.committed = float(stats.target_calls), float(stats.committed_tokens)
    return c


# ----------------------------------------------------------------------------------------------------------------
# chains from forward_train logits


def cycle_roots(total_len: int, prompt_len: int) -> torch.Tensor:
    """Positions t = P-2 .. T-3 whose root x[t+1] may start a cycle (the widest span evaluation scores;
    `alpha.positions` is its tail from P-1).  -> [N] long"""
    start = max(prompt_len - 2, 0)
    return torch.arange(start, max(total_len - 2, start), dtype=torch.long)


Hit = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _depth_weights(step_logits: Sequence[torch.Tensor], token_ids: Sequence[int], prompt_len: int,
                   draft_to_target: torch.Tensor, vocab_size: int, depth: int, hit: Hit) -> torch.Tensor:
    """w [N, depth]: `hit(k, rows [M], next tokens [M], draft logits [M, V])` [M] at every depth k of the cycles
    whose depth-k token is inside the sequence; 0 past the end."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)  # [T]
    total = int(ids.shape[0])
    pos = cycle_roots(total, prompt_len)  # [N] t values (root x[t+1], t+1 <= T-2)
    w = torch.zeros(pos.shape[0], depth, dtype=torch.float64)  # [N, D]
    for k in range(1, min(depth, len(step_logits)) + 1):
        tgt = pos + 1 + k  # [N] index of the token depth k drafts
        ok = tgt <= total - 1
        if not bool(ok.any()):
            break
        rows, nxt = pos[ok], ids[tgt[ok]]  # [M], [M]
        draft_logits = to_target_vocab(step_logits[k - 1][rows].float(), draft_to_target, vocab_size)  # [M, V]
        w[ok.nonzero()[:, 0], k - 1] = hit(k, rows, nxt, draft_logits).double()
    return w


def argmax_chain_weights(step_logits: Sequence[torch.Tensor], token_ids: Sequence[int], prompt_len: int,
                         draft_to_target: torch.Tensor, vocab_size: int, depth: int) -> torch.Tensor:
    """w [N, depth] (as `chain_weights`) of a chain of the draft's argmax drafts: 1 where depth k's argmax (in the
    target vocab) is the token the sequence holds there, else 0; depths past the end get 0."""
    return _depth_weights(step_logits, token_ids, prompt_len, draft_to_target, vocab_size, depth,
                          lambda k, rows, nxt, draft: draft.argmax(-1) == nxt)


def chain_weights(step_logits: Sequence[torch.Tensor], teacher_logits: torch.Tensor, token_ids: Sequence[int],
                  prompt_len: int, draft_to_target: torch.Tensor, params: SamplingParams, depth: int,
                  draft: str = "sampled") -> torch.Tensor:
    """w [N, depth] for cycle roots x[t+1], t = P-2 .. T-3 (row n is t = P-2+n).

    step_logits: K tensors [T, Vd] of `forward_train` (step k-1 at t predicts x[t+1+k] from the teacher-forced
    prefix); teacher_logits [T, V]. draft "sampled": the chain is drawn from the draft law (the runtime's chain at
    T > 0), weighted min(1, q(x)/p(x)) at the token x the sequence holds; "argmax": the draft's argmax (vLLM's
    drafts; the runtime's chain at T = 0: `argmax_chain_weights`; at T > 0 an argmax draft is accepted iff the
    target's draw equals it). Depths past the end of the sequence get 0."""
    vocab = int(teacher_logits.shape[1])
    if params.greedy or draft == "argmax":
        return argmax_chain_weights(step_logits, token_ids, prompt_len, draft_to_target, vocab, depth)

    def ratio(k: int, rows: torch.Tensor, nxt: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        p = logits_to_probs(teacher_logits[rows + k].float(), params)  # [M, V] the target's law at depth k
        q = logits_to_probs(draft_logits, params)  # [M, V]
        px, qx = p.gather(-1, nxt[:, None])[:, 0], q.gather(-1, nxt[:, None])[:, 0]  # [M]
        return torch.where(px > 0, (qx / px.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(px))

    return _depth_weights(step_logits, token_ids, prompt_len, draft_to_target, vocab, depth, ratio)


def cycle_cap(t: int, prompt_len: int, total_len: int, max_new_tokens: int, depth: int,
              as_vllm: bool = False) -> tuple[int, int]:
    """(depth drafted by the cycle rooted at x[t+1], drafts that still fall inside the sequence). The runtime
    drafts min(K, remaining - 1); a depth past the end of an EOS-ended continuation is never counted (`Engine`
    counts only drafts that reach the output), so the cap reaches `room` only when the last token ends it.
    as_vllm: vLLM's count instead — every step drafts and judges all K (the sequence must run K tokens past
    max_new_tokens), and no step starts once max_new_tokens are out (cap -1: no cycle)."""
    room = total_len - 2 - t
    remaining = max_new_tokens - (t + 2 - prompt_len)
    if as_vllm:
        return (max(0, min(depth, room)) if remaining >= 1 else -1), room
    return max(0, min(depth, remaining - 1, room)), room


def _committed_if(cap: int, room: int) -> list[float]:
    """Tokens committed when l = 0..cap drafts are accepted (l, not l + 1, when the last accepted draft is the
    continuation's last token: the EOS that ends the output)."""
    return [float(n) if (cap == room and n == cap) else float(n + 1) for n in range(cap + 1)]


def proposer_chain_weights(token_ids: Sequence[int], prompt_len: int, depth: int,
                           propose: Callable[[list[int], int], Sequence[int]]) -> torch.Tensor:
    """w [N, depth] of a deterministic proposer of token ids (n-gram prompt lookup) for the cycle roots of
    `chain_weights`: at root x[t+1] it proposes from the committed context x[:t+2], and its depth-k token is
    accepted iff it equals the continuation's x[t+1+k]. Exact at T = 0; at T > 0 the continuation is the target's
    draw and a deterministic draft is accepted iff the draw equals it, so the indicator has the serving law. A
    proposal shorter than `depth` (or none) rejects at its end; depths past the sequence get 0."""
    ids = [int(t) for t in token_ids]
    total = len(ids)
    pos = cycle_roots(total, prompt_len)  # [N]
    w = torch.zeros(pos.shape[0], depth, dtype=torch.float64)  # [N, D]
    for n, t in enumerate(pos.tolist()):
        for k, tok in enumerate(list(propose(ids[: t + 2], depth))[:depth], start=1):
            if t + 1 + k > total - 1 or int(tok) != ids[t + 1 + k]:
                break
            w[n, k - 1] = 1.0
    return w


def replay_chain(w: torch.Tensor, prompt_len: int, total_len: int, max_new_tokens: int, depth: int,
                 as_vllm: bool = False) -> CycleCounts:
    """Expected cycles of a depth-`depth` chain over one sequence from `chain_weights` (see the module docstring).
    as_vllm: the steps vLLM runs and counts — its first step drafts from the prefill's token x[P] (the runtime's
    from the last prompt token) and `cycle_cap(as_vllm=True)` judges all K drafts of every step."""
    counts = CycleCounts(depth)
    n_pos = int(w.shape[0])
    if n_pos == 0:
        return counts
    start = max(prompt_len - 2, 0)
    visit = [0.0] * (n_pos + depth + 2)
    visit[1 if as_vllm else 0] = 1.0
    wl = w.tolist()
    for n in range(n_pos):
        v = visit[n]
        if v <= 0.0:
            continue
        cap, room = cycle_cap(start + n, prompt_len, total_len, max_new_tokens, depth, as_vllm)
        if cap < 0:
            continue
        reach = [1.0]
        for k in range(cap):
            reach.append(reach[-1] * wl[n][k])
        counts.add_cycle(v, reach, cap, _committed_if(cap, room))
        for n_acc in range(cap + 1):
            p_exact = reach[n_acc] - (reach[n_acc + 1] if n_acc < cap else 0.0)
            if p_exact > 0:
                visit[n + n_acc + 1] += v * p_exact
    return counts


# ----------------------------------------------------------------------------------------------------------------
# any drafter, through the runtime protocol


def replay_drafter(drafter: Any, features: dict[str, torch.Tensor], token_ids: Sequence[int], prompt_len: int,
                   max_new_tokens: int, tree_at: Callable[[int], Any], params: SamplingParams,
                   depth: int) -> CycleCounts:
    """Counted cycles of a deterministic drafter (see the module docstring) over one sequence.

    features: the teacher pass's features at every position ({"taps": [T, n*H]} and/or {"last_hidden": [T, H]});
    tree_at(d): the runtime's tree settings for a cycle that drafts depth d (`Engine.tree_for`)."""
    ids = [int(t) for t in token_ids]
    total = len(ids)
    counts = CycleCounts(depth)
    if prompt_len < 2 or total <= prompt_len:
        return counts
    device = next(iter(features.values())).device if features else torch.device("cpu")
    wants_ids = getattr(drafter, "needs_token_ids", False)
    state = drafter.new_state(total + 4 * depth * depth + 64, device)
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)

    def absorb(a: int, b: int) -> None:  # positions a..b-1 with their next tokens
        feats = {k: v[a:b] for k, v in features.items()}
        if wants_ids:
            feats["input_ids"] = ids_t[a:b]
        drafter.absorb(state, feats, ids_t[a + 1:b + 1])

    absorb(0, prompt_len - 1)
    t = prompt_len - 2
    while t + 1 <= total - 2:  # a cycle per root until the continuation's last token is committed
        cap, room = cycle_cap(t, prompt_len, total, max_new_tokens, depth)
        accepted, drafted = 0, 0
        if cap > 0:
            tree = drafter.propose(state, ids[t + 1], tree_at(cap), params, None)
            tree = prune_tree(tree, max_depth=cap, max_nodes=1 << 30)
            accepted, drafted = _matched_depth(tree, ids, t), tree.max_depth  # a drafter may propose less
        reach = [1.0] * (accepted + 1) + [0.0] * (drafted - accepted)
        counts.add_cycle(1.0, reach, drafted, _committed_if(drafted, room))
        if t + accepted + 2 >= total - 1:
            break
        absorb(t + 1, t + accepted + 2)
        t += accepted + 1
    return counts


def _matched_depth(tree: Any, ids: list[int], t: int) -> int:
    """Longest drafted prefix of the continuation x[t+2], x[t+3], ... that is a root-to-node path of the tree."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], []).append(i)
    node, d = 0, 0
    while t + 2 + d < len(ids):
        nxt = next((c for c in children.get(node, []) if tokens[c] == ids[t + 2 + d]), None)
        if nxt is None:
            break
        node, d = nxt, d + 1
    return d


# ----------------------------------------------------------------------------------------------------------------
# comparing a prediction with a measurement


def wilson(successes: float, trials: float, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if trials <= 0:
        return (0.0, 1.0)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def tau_interval(stats: metrics.AcceptanceStats, depth: int, z: float = Z95) -> tuple[float, float]:
    """95% interval of a live tau from the binomial (Wilson) intervals of its per-position acceptance: the chain
    tau 1 + sum_k prod_{j<=k} a_j evaluated at every position's lower and upper bound, shifted by the difference
    between the measured tau and the chain tau of the measured a_k (caps near the end of outputs)."""
    trials = [(stats.accepts[k], stats.attempts[k]) for k in range(min(depth, len(stats.attempts)))
              if stats.attempts[k] > 0]
    if not trials:
        return (stats.tau, stats.tau)
    bounds = [wilson(a, n, z) for a, n in trials]
    point = metrics.simulated_tau([a / n for a, n in trials])
    shift = stats.tau - point
    return (metrics.simulated_tau([lo for lo, _ in bounds]) + shift,
            metrics.simulated_tau([hi for _, hi in bounds]) + shift)
