"""The protocol every tree builder drafts through, and the stepper of per-depth drafters.

A stepper is anything with `max_depth`, `room`, `root_logits() -> [Vd]` (the law of the root's children) and
`step(nodes, tokens, parents, depth) -> [F, Vd]`: run the F nodes `nodes` (builder-chosen ids; parents are earlier
ids or -1 for the root; `tokens` their target ids; all at `depth` >= 1) in ONE batched draft forward and return the
laws of their children. `PathIndependentStepper` adds `depth_logits(d)`: the law of every node at depth d, whatever
its path (what best-first trees need). `MarginalStepper` is the stepper of drafters whose laws are per depth
([K, Vd], one per depth: Medusa, DFlash).

Not here: the tree builders (drafting.py, static_trees.py), the models' own steppers (recurrent.py), verification.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

__all__ = ["Stepper", "PathIndependentStepper", "MarginalStepper"]


class Stepper(Protocol):
    max_depth: int

    @property
    def room(self) -> int: ...

    def root_logits(self) -> torch.Tensor: ...

    def step(self, nodes: list[int], tokens: torch.Tensor, parents: list[int], depth: int) -> torch.Tensor: ...


class PathIndependentStepper(Stepper, Protocol):
    """A stepper whose law at each depth does not depend on the path there (what "best_first" trees need)."""

    path_independent: bool  # True

    def depth_logits(self, depth: int) -> torch.Tensor: ...  # [Vd] the law of every node at `depth` (>= 1)


class MarginalStepper:
    """Drafting view of per-depth laws at one root (Medusa heads, a DFlash block): every node at depth d gets law
    d + 1 for its children, whatever its path."""

    room = 1 << 30
    path_independent: ClassVar[bool] = True

    def __init__(self, head_logits: torch.Tensor, choices: list[list[int]] | None = None) -> None:
        self.head_logits = head_logits  # [K, Vd]; row d-1 = the law of the tokens at depth d
        self.max_depth = int(head_logits.shape[0])
        self.choices = choices  # static trees: the drafter's own choices (None: the defaults)

    def root_logits(self) -> torch.Tensor:  # [Vd]
        return self.head_logits[0]

    def depth_logits(self, depth: int) -> torch.Tensor:  # [Vd]
        return self.head_logits[depth - 1]

    def step(self, nodes: list[int], tokens: torch.Tensor, parents: list[int], depth: int) -> torch.Tensor:
        return self.head_logits[depth].expand(len(nodes), -1)  # [F, Vd]
