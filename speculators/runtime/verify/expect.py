"""Exact expected number of accepted drafts of ONE verification, for comparing verifiers on the same draft.

`expected_accepted(tokens, parents, target_row, draft_probs, mode)` runs the real decision core
(`verify.walk_tree`, torch row arithmetic) once per outcome of its coins and sums the accepted counts weighted by
each outcome's probability. The final draw (the corrected or bonus token) does not change how many drafts were
accepted, so it is not enumerated. Given one drafted tree and its target rows, the verifiers' expectations differ only
by the verifier: `speculators bench --compare-verify` reports them side by side on the same cycles (a paired
comparison, free of the sampling noise of live acceptance).

Not here: sampling, drafting, the engine. Cost: one walk per coin outcome (at most the number of nodes + 1).
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real

import torch

from speculators.runtime.verify.lossless import TorchRowOps, Tree, walk_tree

__all__ = ["expected_accepted"]


class _ScriptedCoins:
    """RandomSource that follows a script of coin outcomes (then 'accept' where the coin can land so), records each
    coin's probability, and answers every draw with the row's argmax (draws end a walk; they are not enumerated)."""

    def __init__(self, script: tuple[bool, ...]) -> None:
        self.script, self.taken, self.weight = script, [], 1.0
        self.probs: list[float] = []

    def accept(self, prob: Real) -> bool:
        p = min(max(float(prob), 0.0), 1.0)
        pos = len(self.taken)
        outcome = self.script[pos] if pos < len(self.script) else p > 0
        self.taken.append(outcome)
        self.probs.append(p)
        self.weight *= p if outcome else 1.0 - p
        return outcome

    def draw(self, row: torch.Tensor) -> int:
        return int(torch.argmax(row))


def expected_accepted(tokens: torch.Tensor, parents: torch.Tensor, target_row: Callable[[int], torch.Tensor],
                      draft_probs: torch.Tensor | None, mode: str) -> float:
    """E[number of accepted drafts] of verifying the tree (tokens [N], parents [N]) in `mode`, target law of node i
    = target_row(i) [V], draft laws draft_probs [N, V] (sampled modes) — exact over the verifier's coins."""
    tree = Tree.from_parents(tokens.tolist(), parents.tolist())
    ops = TorchRowOps()
    rows: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        if i not in rows:
            rows[i] = target_row(i)
        return rows[i]

    draft_row = draft_probs.__getitem__ if draft_probs is not None else None
    total = 0.0
    pending: list[tuple[bool, ...]] = [()]
    while pending:
        script = pending.pop()
        coins = _ScriptedCoins(script)
        accepted, _ = walk_tree(tree, mode=mode, target_row=row, draft_row=draft_row, ops=ops, rng=coins)
        total += coins.weight * len(accepted)
        for pos in range(len(script), len(coins.taken)):  # branch on every coin this walk decided for the first time
            if 0.0 < coins.probs[pos] < 1.0:
                pending.append(tuple(coins.taken[:pos]) + (not coins.taken[pos],))
    return total
