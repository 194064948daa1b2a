"""Lossless verification of a draft tree (docs/architecture.md §7).

What it does: given a drafted tree (node tokens + parent pointers; node 0 is the root = the last committed
token), the target's next-token law after the path to every node and, for sampled drafts, the law each
node's children were drawn from, it picks the accepted root->leaf path and one more token (the correction
on rejection, the bonus token when a leaf is reached). A generation loop that commits
`tokens[accepted] + [next_token]` emits tokens distributed exactly as sampling from the target rows alone.

Modes (children of a node are always tried in node-index order):
  greedy               walk to the child carrying argmax(target row); stop when none does; next = argmax.
  deterministic        children chosen by any deterministic mechanism (top-k, n-gram, static choices):
                       accept child c w.p. r(tok_c), else r <- r with tok_c zeroed, renormalised; if none is
                       accepted, next ~ r. Later duplicate sibling tokens are skipped.
  iid                  siblings drawn i.i.d. from draft_probs[parent] (SpecInfer multi-step rule): accept
                       w.p. min(1, r(x)/q(x)), else r <- norm(max(0, r - q)). Duplicate tokens are legal.
  without_replacement  siblings drawn one after another without replacement from draft_probs[parent]
                       (recursive rejection sampling): as iid, and after each rejection q loses x
                       (q <- q with x zeroed, renormalised). Duplicate siblings are rejected as invalid input.
  traversal            siblings drawn without replacement as above, verified leaf-to-root with sequence-level
                       acceptance (traversal verification, Weng et al. 2025, arXiv 2505.12398; see below).
  traversal_iid        the same for siblings drawn i.i.d. (q keeps every token after a rejection).
  block                a chain drafted by sampling draft_probs (one child per node), verified jointly (block
                       verification, Sun et al. 2024, arXiv 2403.10444): `traversal` restricted to a chain.
In the token-wise modes r starts as the target row of each node; a node without children emits next ~ its
target row.

Traversal / block verification. Every node v carries a weight w(v) in [0, 1]: the probability that the path to v
survives, as a sequence, against the draft. w(root) = 1; when v is entered, a child c (token x) of v gets
w(c) = min(1, w(v) r_v(x) / q_v(x)) with r_v, q_v v's current target and draft laws. Subtrees are verified in
post-order (children in index order, each child's whole subtree before the next child, v itself last): a node
whose children are all rejected is accepted with probability w(v) (the root always is), and then next ~ r_v;
else v and its subtree are rejected and its parent u updates
    s = sum(max(0, w(u) r_u - q_u)),   w(u) <- s / (s + 1 - w(u)),   r_u <- norm(max(0, w(u) r_u - q_u)),
and q_u loses x in `traversal` (its next child was drawn without x). Invariant (proved by induction over the
subtree, and by exact enumeration in the tests): the output passes through v with probability w(v), and then its
next token has law r_v, so at the root (w = 1) the output law is the target's. On a chain the post-order is the
leaf-to-root scan of block verification: w is Sun et al.'s p_i, the updated weight their h_i, and the accepted
length their tau = max{i : eta_i <= h_i}. A child with weight 0 is rejected with its whole subtree without
looking at it (every weight below it is 0 too). On a chain, for every drafted prefix x_1..x_i, P(>= i accepted |
prefix) = w_i >= prod_{j<=i} min(1, p_j/q_j), the token-wise probability, so block verification never accepts fewer
tokens in expectation over the drafts (it may on one given draft); on trees the tests check the same inequality
exactly on every enumerated case; depth-1 trees verify exactly as token-wise.

Randomness injection: the decision logic (`walk_tree`) never touches a generator or a tensor. It reads rows
through a `RowOps` (arithmetic on rows: probability of a token, argmax, residuals) and makes every random
decision through a `RandomSource` (`accept(prob)`: one fresh Bernoulli coin; `draw(row)`: one categorical
draw). `verify_tree` plugs in `TorchRowOps` (float64 tensors) and `TorchRandomness` (float64 uniforms from
the caller's torch.Generator); `verify_tree_lazy` does the same with target rows made on demand (the engine
then runs the target's output head only for the nodes the walk visits). The tests plug in exact rational
arithmetic and a source that enumerates every outcome of every coin and draw with its exact probability, so the
very same decision code is proved lossless by enumeration (tests/unit/runtime/test_verify_exact.py).

Not here: computing or filtering probabilities (`sampling.logits_to_probs` makes the target rows), drafting
or building trees, KV-cache commits, EOS/stop handling, batching several requests, acceptance statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Protocol, TypeVar

import torch

from speculators.core.sampling import sample
from speculators.core.trees import SAMPLED_MODES, VERIFY_MODES
from speculators.runtime.verify.inputs import check_draft, check_rows, describe

__all__ = [
    "RandomSource",
    "RowOps",
    "TorchRandomness",
    "TorchRowOps",
    "Tree",
    "chain_parents",
    "remove_token",
    "residual",
    "verify_tree",
    "verify_tree_lazy",
    "walk_tree",
]

_TRAVERSAL_MODES = ("block", "traversal", "traversal_iid")  # of `trees.SAMPLED_MODES`: verified as sequences
_DISTINCT_SIBLING_MODES = ("without_replacement", "traversal")

Row = TypeVar("Row")


class RowOps(Protocol[Row]):
    """Arithmetic on probability rows. `remove` / `residual` return None when no mass is left;
    `weighted_residual(r, q, w)` returns (s, norm(max(0, w r - q))) with s = sum(max(0, w r - q)), row None
    when s is 0."""

    def prob(self, row: Row, token: int) -> Real: ...

    def argmax(self, row: Row) -> int: ...

    def remove(self, row: Row, token: int) -> Row | None: ...

    def residual(self, r: Row, q: Row) -> Row | None: ...

    def weighted_residual(self, r: Row, q: Row, weight: Real) -> tuple[Real, Row | None]: ...


class RandomSource(Protocol[Row]):
    """Every random decision of the verifier: a fresh coin per `accept`, a fresh draw per `draw`."""

    def accept(self, prob: Real) -> bool: ...

    def draw(self, row: Row) -> int: ...


@dataclass(frozen=True)
class Tree:
    """A draft tree as plain Python data: node tokens and, per node, its children in index order."""

    tokens: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> Tree:
        if len(tokens) != len(parents) or len(tokens) == 0:
            raise ValueError(
                f"tokens and parents must have the same non-zero length, got {len(tokens)} and {len(parents)}"
            )
        if parents[0] != -1:
            raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {parents[0]}")
        children: list[list[int]] = [[] for _ in tokens]
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise ValueError(
                    f"parents[{i}] = {parents[i]}: every parent must precede its child (0 <= parent < {i})"
                )
            children[parents[i]].append(i)
        return cls(tuple(int(t) for t in tokens), tuple(tuple(c) for c in children))


def walk_tree(
    tree: Tree,
    *,
    mode: str,
    target_row: Callable[[int], Row],
    draft_row: Callable[[int], Row] | None,
    ops: RowOps[Row],
    rng: RandomSource[Row],
) -> tuple[list[int], int]:
    """The decision core of `verify_tree`, generic in row arithmetic and randomness (see module docstring).

    target_row(i): the target law after the path to node i; draft_row(i): the law node i's children were
    drawn from (read only in the sampled modes, only for nodes with children).
    Returns (accepted node indices root->leaf, root excluded; next token).
    """
    if mode in _TRAVERSAL_MODES:
        return _traverse_tree(tree, mode, target_row, draft_row, ops, rng)
    accepted: list[int] = []
    node = 0
    while True:
        if mode == "greedy":
            best = ops.argmax(target_row(node))
            child = next((c for c in tree.children[node] if tree.tokens[c] == best), None)
            if child is None:
                return accepted, best
        else:
            child, r = _try_children(tree, node, mode, target_row, draft_row, ops, rng)
            if child is None:
                return accepted, rng.draw(r)
        accepted.append(child)
        node = child


def _try_children(
    tree: Tree,
    node: int,
    mode: str,
    target_row: Callable[[int], Row],
    draft_row: Callable[[int], Row] | None,
    ops: RowOps[Row],
    rng: RandomSource[Row],
) -> tuple[int | None, Row]:
    """Try node's children in order; return (accepted child, _) or (None, law the next token is drawn from)."""
    r = target_row(node)
    kids = tree.children[node]
    if not kids:
        return None, r
    if mode == "deterministic":
        tried: set[int] = set()
        for c in kids:
            x = tree.tokens[c]
            if x in tried:  # same token, same context: r(x) is already 0
                continue
            tried.add(x)
            if rng.accept(ops.prob(r, x)):
                return c, r
            r = _or_keep(ops.remove(r, x), r)
        return None, r
    if mode not in ("iid", "without_replacement"):
        raise ValueError(f"mode must be one of {VERIFY_MODES}, got {mode!r}")
    if draft_row is None:
        raise ValueError(f"mode {mode!r} needs the draft law of every node with children (draft_probs)")
    q: Row | None = draft_row(node)
    for c in kids:
        x = tree.tokens[c]
        qx = _draft_prob(ops, q, c, x, mode)
        rx = ops.prob(r, x)
        if rng.accept(rx / qx if rx < qx else 1):
            return c, r
        r = _or_keep(ops.residual(r, q), r)
        if mode == "without_replacement":
            q = ops.remove(q, x)  # exact law of the next sibling given the ones before it
    return None, r


def _draft_prob(ops: RowOps[Row], q: Row | None, child: int, token: int, mode: str) -> Real:
    """q(token) of a drafted child; a child its parent's law cannot have produced is invalid input."""
    qx = ops.prob(q, token) if q is not None else 0
    if not qx > 0:
        raise ValueError(
            f"node {child} carries token {token}, which has probability 0 under the law its parent's children "
            f"were drawn from ({mode}): draft_probs or the tree is wrong"
        )
    return qx


def _traverse_tree(tree: Tree, mode: str, target_row: Callable[[int], Row], draft_row: Callable[[int], Row] | None,
                   ops: RowOps[Row], rng: RandomSource[Row]) -> tuple[list[int], int]:
    """Traversal / block verification of the whole tree (module docstring)."""
    if draft_row is None:
        raise ValueError(f"mode {mode!r} needs the draft law of every node with children (draft_probs)")
    if mode == "block":
        wide = next((i for i, kids in enumerate(tree.children) if len(kids) > 1), None)
        if wide is not None:
            raise ValueError(f"mode 'block' verifies a chain, but node {wide} has {len(tree.children[wide])} "
                             f"children; use 'traversal' (or 'traversal_iid') for trees")
    found = _traverse(tree, 0, 1, mode, target_row, draft_row, ops, rng)
    assert found is not None  # the root is always accepted
    return found


def _traverse(tree: Tree, node: int, weight: Real, mode: str, target_row: Callable[[int], Row],
              draft_row: Callable[[int], Row], ops: RowOps[Row], rng: RandomSource[Row]
              ) -> tuple[list[int], int] | None:
    """Verify the subtree of `node` (entered with `weight`): (accepted path below node, next token), or None when
    node and its whole subtree are rejected."""
    kids = tree.children[node]
    if not kids:
        if node == 0 or rng.accept(weight):
            return [], rng.draw(target_row(node))
        return None
    r = target_row(node)
    q: Row | None = draft_row(node)
    for c in kids:
        x = tree.tokens[c]
        child_weight = weight * ops.prob(r, x) / _draft_prob(ops, q, c, x, mode)
        if child_weight > 0:
            found = _traverse(tree, c, min(child_weight, 1), mode, target_row, draft_row, ops, rng)
            if found is not None:
                return [c, *found[0]], found[1]
        mass, rest = ops.weighted_residual(r, q, weight)
        if rest is None:  # w r <= q everywhere: nothing left here (at the root only through rounding: keep r)
            weight = weight if weight >= 1 else 0
        else:
            weight, r = min(mass / (mass + 1 - weight), 1), rest  # <= 1 in exact arithmetic
        if mode == "traversal":
            q = ops.remove(q, x)  # exact law of the next sibling given the ones before it
    if node == 0 or rng.accept(weight):
        return [], rng.draw(r)
    return None


def _or_keep(new: Row | None, old: Row) -> Row:
    """A residual with no mass can only follow a zero-probability rejection (rounding): keep the old law."""
    return old if new is None else new


# ------------------------------------------------------------------------------------------------
# torch backend


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """norm(max(0, r - q)) for rows r, q [V] (float64 result), or None when r <= q everywhere."""
    diff = (r.to(torch.float64) - q.to(torch.float64)).clamp_min_(0.0)  # [V]
    return _normalised(diff)


def remove_token(row: torch.Tensor, token: int) -> torch.Tensor | None:
    """row [V] with `token` zeroed, renormalised (float64 result), or None when nothing else has mass."""
    out = row.to(torch.float64, copy=True)  # [V]
    out[token] = 0.0
    return _normalised(out)


def _normalised(row: torch.Tensor) -> torch.Tensor | None:
    total = float(row.sum())
    return row / total if total > 0 else None


class TorchRowOps:
    """RowOps on 1-D probability tensors [V]; derived rows are float64."""

    def prob(self, row: torch.Tensor, token: int) -> float:
        return float(row[token])

    def argmax(self, row: torch.Tensor) -> int:
        return int(torch.argmax(row))

    def remove(self, row: torch.Tensor, token: int) -> torch.Tensor | None:
        return remove_token(row, token)

    def residual(self, r: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
        return residual(r, q)

    def weighted_residual(self, r: torch.Tensor, q: torch.Tensor, weight: Real) -> tuple[float, torch.Tensor | None]:
        diff = (r.to(torch.float64) * float(weight) - q.to(torch.float64)).clamp_min_(0.0)  # [V]
        mass = float(diff.sum())
        return mass, (diff / mass if mass > 0 else None)


class TorchRandomness:
    """RandomSource backed by a torch.Generator: float64 uniforms, strict `u < prob` coins."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def accept(self, prob: Real) -> bool:
        if not prob > 0:  # never accept a zero-probability token, even when u == 0
            return False
        u = float(torch.rand((), dtype=torch.float64, generator=self.generator, device=self.generator.device))
        return u < prob

    def draw(self, row: torch.Tensor) -> int:
        return sample(row, self.generator)


class _NoRandomness:
    """Greedy verification makes no random decision; reaching this is a bug."""

    def accept(self, prob: Real) -> bool:
        raise RuntimeError("greedy verification drew a coin")

    def draw(self, row: torch.Tensor) -> int:
        raise RuntimeError("greedy verification drew a token")


_TORCH_OPS = TorchRowOps()


def chain_parents(num_nodes: int) -> torch.Tensor:
    """Parents [num_nodes] of a chain (root + num_nodes - 1 drafts): [-1, 0, 1, ..., num_nodes - 2]."""
    if num_nodes < 1:
        raise ValueError(f"a chain has at least the root node, got num_nodes={num_nodes}")
    return torch.arange(-1, num_nodes - 1, dtype=torch.long)


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    mode: str,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Verify one draft tree; returns (accepted node indices root->leaf, root excluded; next token).

    tokens [N] and parents [N] are integer tensors (parents[0] = -1, parents[i] < i); target_probs [N, V]
    holds the already-filtered target law after the path to each node; draft_probs [N, V] (sampled modes
    only: iid, without_replacement, block, traversal, traversal_iid; ignored otherwise) holds the law node i's
    children were drawn from — only rows of nodes with children are read. generator may be None only in
    greedy mode. Modes (module docstring): greedy | deterministic (children by any deterministic mechanism) |
    iid | without_replacement (siblings sampled from draft_probs, token-wise recursive rejection) | block (a
    sampled chain, verified jointly: Sun et al. 2024) | traversal | traversal_iid (a tree of siblings sampled
    without replacement / i.i.d., verified leaf-to-root: Weng et al. 2025). block and traversal* never accept
    fewer tokens in expectation than iid / without_replacement on the same draft.
    Raises ValueError on malformed input (a tree that is not a chain in block mode, duplicate siblings in
    without_replacement / traversal).
    """
    tree = _check_tree(tokens, parents, mode, generator)
    vocab = check_rows("target_probs", target_probs, len(tree.tokens), None, None)
    return _walk(tree, parents, target_probs.__getitem__, vocab, draft_probs, mode, generator)  # row i: [V]


def verify_tree_lazy(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_row: Callable[[int], torch.Tensor],
    draft_probs: torch.Tensor | None = None,
    *,
    vocab_size: int,
    mode: str,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """`verify_tree` with the target rows made on demand: target_row(i) -> the filtered target law [V] after the
    path to node i. The walk asks only for the nodes it visits, root first, each once — in the token-wise modes
    the accepted path and the node the next token comes from; in block / traversal modes the nodes whose
    children it tries (depth-first, pre-order) and the accepted node — so a caller can skip the output head of
    every other node. The same
    decisions and random draws as `verify_tree` on the same rows; the rows themselves are not checked (they
    must come from `sampling.logits_to_probs`), the tree and draft_probs are."""
    tree = _check_tree(tokens, parents, mode, generator)
    return _walk(tree, parents, target_row, vocab_size, draft_probs, mode, generator)


def _walk(tree: Tree, parents: torch.Tensor, target_row: Callable[[int], torch.Tensor], vocab: int,
          draft_probs: torch.Tensor | None, mode: str, generator: torch.Generator | None) -> tuple[list[int], int]:
    bad = [i for i, t in enumerate(tree.tokens) if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"verify_tree: tokens[{bad[0]}] = {tree.tokens[bad[0]]} is outside the vocabulary [0, {vocab})"
        )
    sampled = mode in SAMPLED_MODES
    if sampled:
        check_draft(tree.tokens, tree.children, parents, draft_probs, mode, vocab, distinct_siblings=mode in _DISTINCT_SIBLING_MODES)
    return walk_tree(
        tree,
        mode=mode,
        target_row=target_row,
        draft_row=draft_probs.__getitem__ if sampled and draft_probs is not None else None,
        ops=_TORCH_OPS,
        rng=TorchRandomness(generator) if generator is not None else _NoRandomness(),
    )


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor, mode: str, generator: torch.Generator | None) -> Tree:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify_tree: mode must be one of {VERIFY_MODES}, got {mode!r}")
    if mode != "greedy" and not isinstance(generator, torch.Generator):
        raise ValueError(f"verify_tree: mode {mode!r} needs a torch.Generator, got {type(generator).__name__}")
    for name, t in (("tokens", tokens), ("parents", parents)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
            raise ValueError(f"verify_tree: {name} must be a 1-D integer tensor [N], got {describe(t)}")
    return Tree.from_parents(tokens.tolist(), parents.tolist())
