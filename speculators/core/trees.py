"""Draft trees: the data structure every drafter returns and the engine verifies, and its attention layout.

A `DraftTree` is a flat, topologically ordered list of nodes: node 0 is the root (the last committed token, not
yet in the target's KV cache); `parents[i] < i`; `depths[i]` = distance from the root. The target verifies the
whole tree in one forward with `ancestor_mask` (node i sees the committed prefix, itself and its ancestors) at
positions `committed_len + depths`.

It is also the one home of the verify modes (`VERIFY_MODES`, `SAMPLED_MODES`) and of the rule that picks one:
`verify_mode` (temperature 0 verifies every tree greedily) and `tree_verify_mode` (the mode of a tree kind drafted
under given sampling; the kinds drafted by sampling the draft's law at T > 0 are `SAMPLED_KINDS`).

This module holds pure tensor code (no models, no I/O). Tree-building policies live with the drafters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speculators.core.sampling import SamplingParams

VERIFY_MODES = ("greedy", "deterministic", "iid", "without_replacement", "block", "traversal", "traversal_iid")
SAMPLED_MODES = ("iid", "without_replacement", "block", "traversal", "traversal_iid")  # need draft_probs
# the tree kinds drafted by sampling the draft's law at T > 0 -> their mode when verified as a sequence (the
# default, `TreeConfig.verify` "sequence") and token by token ("token"); every other kind is a top-k tree
SAMPLED_KIND_MODES: dict[str, tuple[str, str]] = {"chain": ("block", "iid"),
                                                   "sampled": ("traversal", "without_replacement")}
SAMPLED_KINDS = tuple(SAMPLED_KIND_MODES)  # ("chain", "sampled")
TOKEN_WISE_MODES = dict(SAMPLED_KIND_MODES.values())  # a sequence mode -> the same draft verified token by token


def verify_mode(sampling: SamplingParams, drafted: str = "deterministic") -> str:
    """The mode a tree is verified in: "greedy" at temperature 0 whatever it was drafted for, else `drafted` (the
    mode its drafter built it for; "deterministic" for any draft without draft_probs: top-k, n-gram, lookup)."""
    return "greedy" if sampling.greedy else drafted


def tree_verify_mode(kind: str, sampling: SamplingParams, verify: str = "sequence") -> str:
    """How a tree of `kind` (`TreeConfig.kind`) drafted under `sampling` is verified (`verify`: "sequence" or
    "token", see `TreeConfig.verify`): sampled chains by "block" / "iid", sampled trees by "traversal" /
    "without_replacement", top-k trees "deterministic"; all "greedy" at temperature 0 (`verify_mode`)."""
    modes = SAMPLED_KIND_MODES.get(kind)
    return verify_mode(sampling, "deterministic" if modes is None else modes[0 if verify == "sequence" else 1])


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long; node 0 = root
    parents: torch.Tensor  # [N] long; parents[0] = -1, parents[i] < i
    mode: str  # how verify_tree must treat the children: one of VERIFY_MODES
    draft_probs: torch.Tensor | None = None  # [N, V] law node i's children were drawn from (SAMPLED_MODES)

    def __post_init__(self) -> None:
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"unknown verify mode {self.mode!r}; expected one of {VERIFY_MODES}")

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depths(self) -> torch.Tensor:  # [N]
        return depths_of(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item()) if self.size else 0

    @staticmethod
    def root_only(token: int, mode: str = "greedy") -> DraftTree:
        return DraftTree(tokens=torch.tensor([token], dtype=torch.long),
                         parents=torch.tensor([-1], dtype=torch.long), mode=mode)

    @staticmethod
    def chain(root: int, drafts: list[int], mode: str, draft_probs: torch.Tensor | None = None) -> DraftTree:
        n = len(drafts) + 1
        return DraftTree(tokens=torch.tensor([root, *drafts], dtype=torch.long),
                         parents=torch.arange(-1, n - 1, dtype=torch.long), mode=mode, draft_probs=draft_probs)


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root = 0).  [N] -> [N]"""
    p = parents.tolist()
    d = [0] * len(p)
    for i in range(1, len(p)):
        d[i] = d[p[i]] + 1
    return torch.tensor(d, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[i, j] = True iff j == i or j is an ancestor of i.  [N] -> [N, N] bool"""
    p = parents.tolist()
    n = len(p)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if p[i] >= 0:
            mask[i] = mask[p[i]]
        mask[i, i] = True
    return mask


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's first child down to `node` (root excluded)."""
    out = []
    p = parents.tolist()
    while node > 0:
        out.append(node)
        node = p[node]
    return out[::-1]
