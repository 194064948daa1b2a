"""The runtime's one sampling operator: logits -> filtered next-token law -> token.

Every place in the bundled runtime that needs the target's next-token law — plain (non-speculative)
decoding and the target rows handed to `verify.verify_tree` — calls `logits_to_probs` with the same
`SamplingParams`, so speculative and plain decoding sample from bit-identical rows (reference §3.9: a
top-k/top-p operator that differs between verify and plain sampling breaks losslessness).

Filter order (fixed; part of the contract):
  1. temperature == 0  -> one-hot row at argmax(logits); ties go to the lowest token id. Nothing else applies.
  2. z = logits / temperature, computed in float32 (float64 if the logits are float64); p = softmax(z).
  3. Rank tokens by z descending, ties broken by the lower token id (a stable sort; only the top ranks
     are actually sorted).
  4. top-k (top_k > 0): keep ranks < top_k.
  5. top-p (top_p < 1): among the top-k survivors, keep the shortest rank prefix whose mass reaches
     top_p * (mass of the survivors); i.e. keep rank i iff the survivors ranked before i hold
     < top_p of the survivors' mass. The top-ranked token is always kept.
  6. Zero the dropped tokens and renormalise once.
  Steps 4-5 are applied jointly from one sort; the result equals top-k -> renormalise -> top-p -> renormalise.
  With (top_k == 0 or top_k >= V) and top_p == 1 nothing is filtered: the row is exactly softmax(z).

`sample` draws one token from a row by inverse CDF on a float64 uniform from the caller's generator.
It never returns a zero-probability token (also when the uniform is exactly 0). `sample_without_replacement`
draws k distinct tokens one after another, each from the row with the earlier draws removed (what the
verifier's `without_replacement` / `traversal` modes assume of sibling drafts).

`SamplingParams.logprobs` (None, or k >= 0) asks the engine for the log-probability of every generated token and
its k most likely alternatives; those come from the target's unfiltered law (log-softmax of its logits, before
temperature, top-k and top-p), as vLLM reports them by default. They never change which tokens are drawn.

Not here: repetition/presence penalties, min-p, logit bias, grammar masks, stop-string matching (`stop` and
`stop_token_ids` are carried for the engine), and batched sampling of many rows at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["MAX_LOGPROBS", "SamplingParams", "logits_to_probs", "sample", "sample_without_replacement", "inverse_cdf"]

MAX_LOGPROBS = 20  # most alternatives per generated token (OpenAI's top_logprobs limit)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None  # generation also ends after any of these tokens (besides EOS)
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and its k best alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError with one line naming the bad field, its value and the allowed range."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.temperature, (int, float)) or not (0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an int in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or None, got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise ValueError(f"stop must be a list of non-empty strings or None, got {self.stop!r}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0 or None, got {self.stop_token_ids!r}")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32, or float64 for float64 logits); see the module docstring."""
    params.validate()
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a floating-point tensor [..., V]")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    vocab = logits.shape[-1]
    if params.temperature == 0:
        best = torch.argmax(logits, dim=-1, keepdim=True)  # [..., 1] first maximal index
        return torch.zeros(logits.shape, dtype=dtype, device=logits.device).scatter_(-1, best, 1.0)  # [..., V]
    z = logits.to(dtype) / params.temperature  # [..., V]
    probs = torch.softmax(z, dim=-1)  # [..., V]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1:
        return probs
    keep = _top_k_top_p_mask(z, probs, top_k, params.top_p)  # [..., V] bool
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_k_top_p_mask(z: torch.Tensor, probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask [..., V] of the tokens kept by top-k then top-p (0 / 1 mean off).

    Same result as one stable sort of every row by z descending, but only the few top-ranked tokens are
    sorted: a full sort of a 150k vocabulary costs ~15 ms per row on a CPU.
    """
    if top_p >= 1:
        return _top_k_mask(z, top_k)
    vocab = z.shape[-1]
    flat_z = z.reshape(-1, vocab)  # [R, V]
    flat_p = probs.reshape(-1, vocab)  # [R, V]
    keep = torch.zeros_like(flat_z, dtype=torch.bool)  # [R, V]
    for row in range(flat_z.shape[0]):  # rows are independent: a row's mask never depends on the batch
        keep[row, _top_p_ids(flat_z[row], flat_p[row], top_k, top_p)] = True
    return keep.reshape(z.shape)


def _top_k_mask(z: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask [..., V] of the top_k best ranks: all tokens above the k-th value, then the lowest-id ties."""
    threshold = torch.topk(z, top_k, dim=-1).values[..., -1:]  # [..., 1]
    at_least = z >= threshold  # [..., V]
    if bool((at_least.sum(dim=-1) == top_k).all()):  # usual case: no tie straddles the cut
        return at_least
    above = z > threshold  # [..., V]
    ties = at_least & ~above  # [..., V]
    free_slots = top_k - above.sum(dim=-1, keepdim=True)  # [..., 1]
    return above | (ties & (torch.cumsum(ties, dim=-1) <= free_slots))


def _ranked_ids(z: torch.Tensor, m: int) -> torch.Tensor:
    """Ids [m] of the m best tokens of one row z [V], in rank order (z descending, lower id first)."""
    if m >= z.shape[0]:
        return torch.sort(z, descending=True, stable=True).indices
    ids = torch.nonzero(_top_k_mask(z, m)).flatten()  # [m] ascending ids
    return ids[torch.sort(z[ids], descending=True, stable=True).indices]


def _top_p_ids(z: torch.Tensor, probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Ids kept by top-k (0 = off) then top-p (< 1) in one row z, probs [V]."""
    vocab = z.shape[0]
    m = top_k if top_k > 0 else min(vocab, 1024)
    while True:
        ids = _ranked_ids(z, m)  # [m] rank order
        ranked = probs[ids]  # [m]
        prefix = torch.cumsum(ranked, dim=0)  # [m]
        limit = top_p * (prefix[-1] if top_k > 0 else probs.sum())
        # without top-k, grow the candidate list until it holds the cut (every later rank is dropped)
        if top_k > 0 or m >= vocab or prefix[-1] >= limit:
            return ids[(prefix - ranked) < limit]
        m = min(vocab, 4 * m)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """Token t with cdf[t-1] <= u * total < cdf[t] for probs [V] (need not be normalised), u in [0, 1).

    Zero-probability tokens are never returned: u == 0 lands on the first token with mass, and rounding
    that pushes u * total to the end of the table falls back to the last token with mass.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)  # [V]
    total = float(cdf[-1])
    if not (0 < total < math.inf):
        raise ValueError(f"cannot sample: probabilities sum to {total} (need a finite positive sum)")
    token = int(torch.searchsorted(cdf, u * total, right=True))
    if token >= probs.shape[0]:
        token = int(torch.nonzero(probs > 0)[-1])
    return token


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V] (non-negative, any positive sum) with one float64 uniform."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] == 0:
        raise ValueError("sample expects one probability row: a non-empty 1-D tensor [V]")
    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=generator.device))
    return inverse_cdf(probs, u)


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """Up to k distinct token ids drawn one after another without replacement from probs [V] (draw j from the row
    with draws 1..j-1 zeroed and renormalised), in draw order; fewer when fewer tokens have mass.

    Exponential race with one float64 exponential per token: token i finishes at E_i / p_i, E_i ~ Exp(1), so the
    first finisher is i with probability p_i / sum(p), and by memorylessness the rest race again among the others:
    the finishing order (= the keys p_i / E_i in descending order) is a sequential draw without replacement."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] == 0:
        raise ValueError("sample_without_replacement expects one probability row: a non-empty 1-D tensor [V]")
    p = probs.to(torch.float64)  # [V]
    live = p > 0  # [V]
    n = min(int(k), int(live.sum()))
    if n <= 0:
        return []
    race = torch.empty(p.shape, dtype=torch.float64, device=p.device).exponential_(generator=generator)  # [V]
    keys = torch.where(live, p / race, torch.full_like(p, -1.0))  # [V]; inf when E_i == 0 (probability 0)
    return [int(t) for t in torch.topk(keys, n).indices.tolist()]
