"""Draft trees: the data structure every drafter returns and the engine verifies, and its attention layout.

A `DraftTree` is a flat, topologically ordered list of nodes: node 0 is the root (the last committed token, not
yet in the target's KV cache); `parents[i] < i`; `depths[i]` = distance from the root. The target verifies the
whole tree in one forward with `ancestor_mask` (node i sees the committed prefix, itself and its ancestors) at
positions `committed_len + depths`.

This module holds pure tensor code (no models, no I/O). Tree-building policies live with the drafters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VERIFY_MODES = ("greedy", "deterministic", "iid", "without_replacement", "block", "traversal", "traversal_iid")
SAMPLED_MODES = ("iid", "without_replacement", "block", "traversal", "traversal_iid")  # need draft_probs


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
