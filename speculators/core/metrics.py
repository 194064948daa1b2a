"""The glossary and the ONE implementation of every acceptance formula (training, evaluation and runtime share it).

Glossary (docs/architecture.md §5):
- target call: one verification forward of the target.
- committed tokens per call = accepted drafts + 1 (the corrected token on rejection, or the bonus token when
  every drafted depth was accepted).
- tau (acceptance length) = committed tokens / target calls, bonus included.
- per-position acceptance a_k = P(depth-k draft accepted | depths 1..k-1 accepted), k = 1..K.
- teacher-forced (analytic) acceptance on held-out data, per position t and draft depth k:
    greedy:   alpha_{t,k} = 1[argmax q = argmax p]
    sampling: alpha_{t,k} = sum_v min(p(v), q(v))   (p, q after the same temperature / top-k / top-p)
  chain reach E_k = mean_t prod_{j<=k} alpha_{t,j};  a_k = E_k / E_{k-1};  simulated tau = 1 + sum_k E_k
  (= 1 + sum_k prod_{j<=k} a_j).
- block verification of a sampled chain (Sun et al. 2024; `serving.verify` mode "block"), per position t:
    P(>= k drafts accepted) = E[w_k],  w_0 = 1,  w_k = min(1, w_{k-1} p_k(X_k) / q_k(X_k)),  X_k ~ q_k
  with the depth-k laws taken as given (the same teacher-forced approximation as alpha). Never below
  prod_{j<=k} alpha_{t,j} (w_k >= prod_j min(1, p_j/q_j)); `block_reach` computes it on a log-grid (bounds),
  and `block_alpha` turns it into per-depth ratios that `chain_reach` / `simulated_tau` summarise as above.

This module only computes numbers; it does not run models, load files or print reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def temperature_key(temperature: float) -> str:
    """The key of a temperature in every per-temperature map a report holds (evaluation, selection, the live
    check, the export's summary): str(float(T)), so 0 and 0.0 both read "0.0"."""
    return str(float(temperature))


def tau(committed_tokens: int, target_calls: int) -> float:
    """Acceptance length: committed tokens per target call (bonus included)."""
    return committed_tokens / target_calls if target_calls else 0.0


def simulated_tau(per_position: Sequence[float]) -> float:
    """Expected committed tokens per call of a chain whose depth-k conditional acceptance is a_k."""
    total, reach = 1.0, 1.0
    for a in per_position:
        reach *= a
        total += reach
    return total


def committed_distribution(per_position: Sequence[float], depth: int) -> list[float]:
    """P(one call commits j tokens), j = 1..depth+1, for a chain drafted to `depth` with conditional acceptance a_k:
    j-1 drafts accepted then one rejected (the corrected token makes j), or all `depth` accepted plus the bonus.
    sum_j j * P(j) = simulated_tau(per_position[:depth])."""
    out, reach = [], 1.0
    for k in range(depth):
        a = float(per_position[k]) if k < len(per_position) else 0.0
        out.append(reach * (1.0 - a))
        reach *= a
    out.append(reach)
    return out


def greedy_alpha(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Teacher-forced greedy acceptance: 1[argmax q == argmax p] per row.  [..., V] x [..., V] -> [...]"""
    return (target_logits.argmax(-1) == draft_logits.argmax(-1)).to(target_logits.dtype)


def sampled_alpha(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Teacher-forced sampling acceptance: sum_v min(p(v), q(v)) per row.  [..., V] x [..., V] -> [...]"""
    return torch.minimum(target_probs, draft_probs).sum(-1)


def chain_reach(alpha: torch.Tensor, valid: torch.Tensor | None = None) -> list[float]:
    """E_k = prod_{j<=k} a_j, the chance that a depth-k chain is accepted through depth k.

    alpha: [N, K] per-position, per-depth acceptance (greedy 0/1 or sampled probability);
    valid: [N, K] bool, whether depth k exists for position t (end of sequence / loss mask). A position counts
    for depth k only if depths 1..k are all valid, so a_k is estimated as a conditional over the positions where
    depth k exists: a_k = sum_t reach_{t,k} / sum_t reach_{t,k-1} (both over those positions). Without masks this is
    the plain mean of prod_{j<=k} alpha_{t,j}; with masks it never exceeds 1 (positions near a sequence's end, which
    have depth k-1 but not depth k, leave both sums).
    """
    a = alpha.double()
    if valid is None:
        valid = torch.ones_like(a, dtype=torch.bool)
    ok = torch.cumprod(valid.double(), dim=1)  # [N, K]
    reach = torch.cumprod(a * ok, dim=1)  # [N, K]
    before = torch.cat([torch.ones_like(reach[:, :1]), reach[:, :-1]], dim=1) * ok  # [N, K] reach_{t,k-1}
    num, den = reach.sum(0), before.sum(0)  # [K]
    cond = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))  # [K] a_k
    return torch.cumprod(cond, dim=0).tolist()


BLOCK_GRID_BINS = 2048  # log-weight bins on [log BLOCK_GRID_FLOOR, 0]
BLOCK_GRID_FLOOR = 1e-4  # weights below it count as 0 (lower bound) or as the floor (upper bound)


def block_reach_bounds(target_probs: Sequence[torch.Tensor], draft_probs: Sequence[torch.Tensor],
                       bins: int = BLOCK_GRID_BINS, floor: float = BLOCK_GRID_FLOOR
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds of P(block verification accepts >= k drafts) for every row, k = 1..K.

    target_probs / draft_probs: K tensors [N, V], the depth-k target and draft laws of each row (the chain's
    depth-k draft is X_k ~ q_k, independent across depths). The law of log w_k is carried on a grid of `bins`
    steps h over [log floor, 0]: the log-ratios log(p/q) of each depth are rounded down (lower bound) or up (upper
    bound) to multiples of h, w below the floor counts as 0 (lower) or as the floor (upper); each depth is one
    convolution (FFT) of the carried law with the histogram of log-ratios under q, folded at 0 (w <= 1). Both bounds
    are exact expectations of a chain whose ratios are rounded monotonically, so they bracket the true value; their
    gap is at most about k h relative plus the floor. Returns (lower [N, K], upper [N, K]) float64."""
    n_rows = int(target_probs[0].shape[0]) if len(target_probs) else 0
    k_max = len(target_probs)
    h = -math.log(floor) / bins
    size = 1
    while size < 3 * bins + 2:
        size *= 2
    # per depth, once for both bounds and only over the tokens some row's draft can draw (a token no draft draws
    # carries no mass): log-ratios in grid steps, the draft mass, and the mass the upper bound keeps (p > 0)
    depths = []
    for k in range(k_max):
        cols = (draft_probs[k] > 0).any(0).nonzero().squeeze(1)  # [C] tokens some draft can draw
        q = draft_probs[k][:, cols].to(torch.float64)  # [N, C]
        p = target_probs[k][:, cols].to(torch.float64)  # [N, C]
        ratio = (torch.log(p) - torch.log(q)) / h  # [N, C]; -inf where p = 0, +inf where q = 0 < p
        mass = torch.where(q > 0, q, torch.zeros_like(q))  # [N, C]
        depths.append((ratio, mass, torch.where(p > 0, mass, torch.zeros_like(mass))))
    out = []
    for upper in (False, True):
        law = torch.zeros(n_rows, bins + 1, dtype=torch.float64)  # [N, G+1] mass at log w = (j - G) h
        law[:, bins] = 1.0
        reach = torch.zeros(n_rows, k_max, dtype=torch.float64)  # [N, K]
        values = torch.exp((torch.arange(bins + 1, dtype=torch.float64) - bins) * h)  # [G+1]
        for k, (ratio, mass, kept) in enumerate(depths):
            steps = torch.ceil(ratio) if upper else torch.floor(ratio)
            steps = steps.nan_to_num(nan=-(bins + 1), neginf=-(bins + 1), posinf=bins).clamp(-(bins + 1), bins)
            kernel = torch.zeros(n_rows, 2 * bins + 2, dtype=torch.float64)  # [N, 2G+2]: shift s at s + G + 1
            # a token the target excludes sends w to 0 in both bounds (the lower bound drops shifts off the grid)
            kernel.scatter_add_(1, (steps + bins + 1).long(), kept if upper else mass)
            if not upper:
                kernel[:, 0] = 0.0  # shifts that leave the grid from every point: w -> 0
            if k == 0:  # the law is still the point mass at w = 1: the convolution is the kernel, shifted by G
                full = torch.zeros(n_rows, 3 * bins + 2, dtype=torch.float64)  # [N, 3G+2]
                full[:, bins:] = kernel
            else:
                full = torch.fft.irfft(torch.fft.rfft(law, size) * torch.fft.rfft(kernel, size), size)  # [N, size]
                full = full[:, : 3 * bins + 2].clamp_min_(0.0)  # index m <-> log w = (m - G - 1) h
            new = torch.zeros_like(law)
            new[:, :bins] = full[:, bins + 1: 2 * bins + 1]
            new[:, bins] = full[:, 2 * bins + 1:].sum(-1)  # w capped at 1
            if upper:
                new[:, 0] += full[:, : bins + 1].sum(-1)  # below the floor: counted at the floor
            law = new
            reach[:, k] = law @ values
        out.append(reach)
    return out[0], torch.maximum(out[1], out[0])


def block_reach(target_probs: Sequence[torch.Tensor], draft_probs: Sequence[torch.Tensor]) -> torch.Tensor:
    """P(block verification accepts >= k drafts) per row: the midpoint of `block_reach_bounds`.  -> [N, K]"""
    lower, upper = block_reach_bounds(target_probs, draft_probs)
    return (lower + upper) / 2


def block_alpha(target_probs: Sequence[torch.Tensor], draft_probs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-depth ratios reach_k / reach_{k-1} of `block_reach` (0 where nothing is left), so that `chain_reach` of
    them is the block reach, with the same validity masks as token-wise alpha.  -> [N, K] float64"""
    reach = block_reach(target_probs, draft_probs)  # [N, K]
    before = torch.cat([torch.ones_like(reach[:, :1]), reach[:, :-1]], dim=1)  # [N, K]
    return torch.where(before > 0, reach / before.clamp_min(1e-300), torch.zeros_like(reach)).clamp_(0.0, 1.0)


def per_position_from_reach(reach: Sequence[float]) -> list[float]:
    """a_k = E_k / E_{k-1} (E_0 = 1)."""
    out, prev = [], 1.0
    for e in reach:
        out.append(e / prev if prev > 0 else 0.0)
        prev = e
    return out


@dataclass
class AcceptanceStats:
    """Live acceptance counters of a runtime (or an evaluation of one), per verification step.

    `record(accepted, drafted_depth, verified_nodes)` is called once per target call: `accepted` drafts were
    accepted (root excluded), the draft tree/chain reached depth `drafted_depth`, and `verified_nodes` draft nodes
    were sent to the target.
    """

    max_depth: int = 16
    target_calls: int = 0
    committed_tokens: int = 0
    drafted_tokens: int = 0  # draft nodes verified (root excluded)
    accepted_tokens: int = 0
    bonus_tokens: int = 0  # calls where every drafted depth was accepted (the extra token is a bonus)
    attempts: list[int] = field(default_factory=list)  # attempts[k-1]: calls that reached depth k
    accepts: list[int] = field(default_factory=list)  # accepts[k-1]: calls that accepted depth k
    histogram: list[int] = field(default_factory=list)  # histogram[n]: calls that accepted exactly n drafts
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accept_seconds: float = 0.0

    def __post_init__(self) -> None:
        n = self.max_depth
        self.attempts = self.attempts or [0] * n
        self.accepts = self.accepts or [0] * n
        self.histogram = self.histogram or [0] * (n + 1)

    def record(self, accepted: int, drafted_depth: int, verified_nodes: int, committed: int | None = None) -> None:
        if accepted > drafted_depth:
            raise ValueError(f"accepted {accepted} > drafted depth {drafted_depth}")
        depth = min(drafted_depth, self.max_depth)
        self.target_calls += 1
        self.committed_tokens += accepted + 1 if committed is None else committed
        self.drafted_tokens += verified_nodes
        self.accepted_tokens += accepted
        if drafted_depth > 0 and accepted == drafted_depth:
            self.bonus_tokens += 1
        for k in range(min(accepted + 1, depth)):
            self.attempts[k] += 1
        for k in range(min(accepted, depth)):
            self.accepts[k] += 1
        self.histogram[min(accepted, self.max_depth)] += 1

    def merge(self, other: AcceptanceStats) -> None:
        for name in ("target_calls", "committed_tokens", "drafted_tokens", "accepted_tokens", "bonus_tokens",
                     "draft_seconds", "verify_seconds", "accept_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("attempts", "accepts", "histogram"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(theirs) > len(mine):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def tau(self) -> float:
        return tau(self.committed_tokens, self.target_calls)

    @property
    def per_position_acceptance(self) -> list[float]:
        """a_k for every depth that was attempted at least once."""
        return [acc / att for acc, att in zip(self.accepts, self.attempts, strict=True) if att > 0]

    @property
    def bonus_rate(self) -> float:
        return self.bonus_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def wasted_verified_tokens(self) -> int:
        return self.drafted_tokens - self.accepted_tokens

    def to_dict(self) -> dict:
        last = max((i for i, v in enumerate(self.histogram) if v), default=0)
        return {
            "tau": round(self.tau, 4), "target_calls": self.target_calls, "committed_tokens": self.committed_tokens,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "per_position_acceptance": [round(a, 4) for a in self.per_position_acceptance],
            "accepted_length_histogram": self.histogram[: last + 1], "bonus_rate": round(self.bonus_rate, 4),
            "wasted_verified_tokens": self.wasted_verified_tokens,
            "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4),
            "accept_seconds": round(self.accept_seconds, 4),
        }


# ----------------------------------------------------------------------------------------------------------------
# chain speculation counted the way vLLM counts it


@dataclass
class ChainCounts:
    """Counters of chain speculation as vLLM keeps them (`vllm:spec_decode_*` on /metrics): `drafts` verification
    steps that carried drafts, `draft_tokens` drafted tokens, and accepted[j] = drafts whose first j+1 tokens were
    all accepted (vLLM's `num_accepted_tokens_per_pos`, an unconditional count). Floats where they are expected
    counts (`evaluate.chain_prediction.predict_sampled_rows`)."""

    k: int
    drafts: float = 0
    draft_tokens: float = 0
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = self.accepted or [0] * self.k

    def record(self, accepted: int, drafted: int) -> None:
        if not 0 <= accepted <= drafted <= self.k:
            raise ValueError(f"accepted {accepted} / drafted {drafted} outside 0..k={self.k}")
        self.drafts += 1
        self.draft_tokens += drafted
        for j in range(accepted):
            self.accepted[j] += 1

    def merge(self, other: ChainCounts) -> None:
        if other.k != self.k:
            raise ValueError(f"cannot merge chain counts of k={other.k} into k={self.k}")
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted, strict=True)]

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's figure: 1 + accepted tokens / drafts (= tau of a chain, bonus included)."""
        return 1.0 + sum(self.accepted) / self.drafts if self.drafts else 0.0

    @property
    def reach(self) -> list[float]:
        """P(the first j drafts are all accepted), j = 1..k (vLLM's per-position acceptance rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted]

    @property
    def per_position_acceptance(self) -> list[float]:
        """a_k = P(depth k accepted | depths 1..k-1 accepted), as in the glossary."""
        return per_position_from_reach(self.reach)

    def to_dict(self) -> dict:
        return {"k": self.k, "drafts": round(self.drafts, 2), "draft_tokens": round(self.draft_tokens, 2),
                "accepted": [round(a, 2) for a in self.accepted],
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "reach": [round(r, 4) for r in self.reach],
                "per_position_acceptance": [round(a, 4) for a in self.per_position_acceptance]}


def walk_chain(reach: Sequence[int], k: int, total: int) -> ChainCounts:
    """Greedy chain speculation along one known output, step by step as an engine runs it.

    The first output token comes from the prefill; then every verification step drafts k tokens from the last
    committed token (output index i), accepts the first reach[i] of them (how many leading drafts equal the
    target's own next tokens there; capped at k) and commits reach[i] + 1 tokens, until `total` tokens are
    committed. The last step is counted in full even where it runs past `total` (vLLM verifies all k drafts and
    counts their acceptance before it truncates at max_tokens or EOS), so reach must cover indices up to total-1.
    Because it visits exactly the positions an engine visits, it predicts the engine's counters; averaging the
    acceptance over every position instead (`chain_reach`) weights positions an engine skips."""
    counts = ChainCounts(k)
    i, committed = 0, 1
    while committed < total:
        if i >= len(reach):
            raise ValueError(f"reach covers {len(reach)} positions; the walk needs index {i} (total {total})")
        a = min(int(reach[i]), k)
        counts.record(a, k)
        committed += a + 1
        i += a + 1
    return counts
