"""Test-only verifiers that the losslessness proofs compare the real core with.

- Negative controls: broken variants of the verification core (wrong residuals, reused coins, per-path target
  samples, frozen weights, ...) that the exact and chi-square checks must reject.
- `sun_block_verify`: a literal transcription of block verification as Sun et al. (arXiv 2403.10444,
  Algorithm 2) state it (forward, one coin per position, tau = max{i : eta_i <= h_i}), whose law the walk's block
  mode must have.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from verify_harness import REF_OPS, RefOps, Row, ScriptedRandomness, normalise

from speculators.runtime.verify.lossless import Tree


class NoResidualOps(RefOps):
    """(b) rejected siblings are not zeroed and the residual is never updated."""

    def __init__(self, base: Any = REF_OPS) -> None:
        self.base = base

    def prob(self, row: Any, token: int) -> Any:
        return self.base.prob(row, token)

    def argmax(self, row: Any) -> int:
        return self.base.argmax(row)

    def remove(self, row: Any, token: int) -> Any:
        return row

    def residual(self, r: Any, q: Any) -> Any:
        return r

    def weighted_residual(self, r: Any, q: Any, weight: Any) -> tuple[Any, Any]:
        return self.base.weighted_residual(r, q, weight)[0], r


class UnfilteredResidualOps(RefOps):
    """(e) accept against the filtered target, but build residuals from the unfiltered row."""

    def __init__(self, raw_of: Callable[[Any], Any] = lambda row: getattr(row, "raw", row), base: Any = REF_OPS):
        self.raw_of, self.base = raw_of, base

    def prob(self, row: Any, token: int) -> Any:
        return self.base.prob(row, token)

    def argmax(self, row: Any) -> int:
        return self.base.argmax(row)

    def remove(self, row: Any, token: int) -> Any:
        return self.base.remove(self.raw_of(row), token)

    def residual(self, r: Any, q: Any) -> Any:
        return self.base.residual(self.raw_of(r), q)

    def weighted_residual(self, r: Any, q: Any, weight: Any) -> tuple[Any, Any]:
        return self.base.weighted_residual(self.raw_of(r), q, weight)


class FrozenWeightOps(NoResidualOps):
    """(f) traversal / block: a rejected subtree leaves its parent's weight unchanged (the residual law is still
    updated): the mass reported is the weight itself, so s / (s + 1 - w) = w."""

    def remove(self, row: Any, token: int) -> Any:
        return self.base.remove(row, token)

    def residual(self, r: Any, q: Any) -> Any:
        return self.base.residual(r, q)

    def weighted_residual(self, r: Any, q: Any, weight: Any) -> tuple[Any, Any]:
        return weight, self.base.weighted_residual(r, q, weight)[1]


class UnweightedResidualOps(FrozenWeightOps):
    """(g) traversal / block: the weight is updated, but the next token is drawn from norm(max(0, r - q)), as in
    token-wise verification, instead of norm(max(0, w r - q))."""

    def weighted_residual(self, r: Any, q: Any, weight: Any) -> tuple[Any, Any]:
        return self.base.weighted_residual(r, q, weight)[0], self.base.residual(r, q)


class ReusedCoins:
    """(d) the k-th coin tried at a depth level is the same uniform U_k at every level of one step.

    Exact version: each U_k is tracked as the interval it is known to lie in; a coin `U_k < a` splits it.
    """

    def __init__(self, base: ScriptedRandomness) -> None:
        self.base = base
        self.intervals: dict[int, tuple[Fraction, Fraction]] = {}
        self.rank = 0

    def accept(self, prob: Any) -> bool:
        lo, hi = self.intervals.get(self.rank, (Fraction(0), Fraction(1)))
        cut = min(max(Fraction(prob), lo), hi)
        p_accept = (cut - lo) / (hi - lo)
        accepted = self.base.choose([(p_accept, True), (1 - p_accept, False)])
        self.intervals[self.rank] = (lo, cut) if accepted else (cut, hi)
        self.rank = 0 if accepted else self.rank + 1
        return accepted

    def draw(self, row: Row) -> int:
        return self.base.draw(row)


class OneUniform(ReusedCoins):
    """(d) block: every coin of a step compares the SAME uniform eta with its threshold."""

    def accept(self, prob: Any) -> bool:
        accepted = super().accept(prob)
        self.rank = 0
        return accepted


def sun_block_verify(
    tree: Tree, *, mode: str, target_row: Callable[[int], Any], draft_row: Callable[[int], Any], ops: Any, rng: Any
) -> tuple[list[int], int]:
    """Block verification of a chain exactly as Sun et al. write it (Algorithm 2): draw eta_1..eta_g, set
    p_0 = 1, p_i = min(1, p_{i-1} M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1})), h_i = p_g (i = g) else
    s_i / (s_i + 1 - p_i) with s_i = sum_x max(0, p_i M_b(x | X^i) - M_s(x | X^i)); tau = the last i with
    eta_i <= h_i (0 if none); emit X^tau and Y ~ M_b(. | X^g) if tau = g, else norm(max(0, p_tau M_b - M_s))."""
    chain = [0]
    while tree.children[chain[-1]]:
        (child,) = tree.children[chain[-1]]
        chain.append(child)
    g = len(chain) - 1
    weights: list[Any] = [1]
    for i in range(1, g + 1):
        parent = chain[i - 1]
        x = tree.tokens[chain[i]]
        weights.append(min(1, weights[-1] * target_row(parent)[x] / draft_row(parent)[x]))
    tau = 0
    for i in range(1, g + 1):
        if i == g:
            h = weights[g]
        else:
            s = sum(max(0, weights[i] * a - b) for a, b in zip(target_row(chain[i]), draft_row(chain[i]), strict=True))
            h = s / (s + 1 - weights[i]) if s + 1 - weights[i] > 0 else 1  # 0/0 only when p_i = 1 and M_b = M_s
        if rng.accept(h):
            tau = i
    if tau == g:
        return chain[1:], rng.draw(target_row(chain[g]))
    node = chain[tau]
    rest = normalise([max(0, weights[tau] * a - b) for a, b in zip(target_row(node), draft_row(node), strict=True)])
    return chain[1 : tau + 1], rng.draw(rest)


def per_path_verify(
    tree: Tree, *, mode: str, target_row: Callable[[int], Any], draft_row: Any, ops: Any, rng: Any
) -> tuple[list[int], int]:
    """(c) Medusa-nucleus style: each root->leaf path samples the target independently and keeps
    its longest matching prefix; the longest over all paths wins (first path on ties)."""
    best: tuple[list[int], int] | None = None
    leaves = [i for i, kids in enumerate(tree.children) if not kids and i > 0] or [0]
    for leaf in leaves:
        path = []
        node = leaf
        while node > 0:
            path.append(node)
            node = _parent_of(tree, node)
        path.reverse()
        accepted: list[int] = []
        node = 0
        nxt = None
        for child in path:
            y = rng.draw(target_row(node))
            if y != tree.tokens[child]:
                nxt = y
                break
            accepted.append(child)
            node = child
        if nxt is None:
            nxt = rng.draw(target_row(node))
        if best is None or len(accepted) > len(best[0]):
            best = (accepted, nxt)
    assert best is not None
    return best


def _parent_of(tree: Tree, node: int) -> int:
    return next(p for p, kids in enumerate(tree.children) if node in kids)
