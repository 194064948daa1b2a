"""Test-only machinery for the losslessness proofs of `speculators.runtime.verify.lossless`.

- `RefOps`: the verifier's row arithmetic on tuples of Python numbers (Fraction: exact; float: fast).
- `ScriptedRandomness` / `enumerate_law`: run a program once per outcome of its random choices (coins,
  draws) and add up the exact probability of every result. Fed to the real `walk_tree`, this turns the
  production decision code into a probability-propagating verifier.
- Toy target/draft tables keyed by the full context, tree drafters (top-k, fixed tokens, i.i.d., without
  replacement, the runtime's best-first builder), one speculative step, and the exact law of the first n tokens of
  the generation loop.
Broken verifiers (negative controls) and the literal block-verification reference live in verify_controls.py.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Any, Protocol

import torch

from speculators.core.trees import depths_of
from speculators.models.drafting import build_best_first_tree
from speculators.models.steppers import MarginalStepper
from speculators.runtime.verify.lossless import Tree, walk_tree

Row = tuple  # a probability row: tuple of Fraction or float, one entry per token
Ctx = tuple[int, ...]


# ------------------------------------------------------------------------------------------------
# reference arithmetic


def normalise(values: Sequence[Any]) -> Row | None:
    total = sum(values)
    return tuple(v / total for v in values) if total > 0 else None


class RefOps:
    """`RowOps` on tuples of Python numbers; exact with Fractions."""

    def prob(self, row: Row, token: int) -> Any:
        return row[token]

    def argmax(self, row: Row) -> int:
        return max(range(len(row)), key=row.__getitem__)  # first maximal index, like torch.argmax

    def remove(self, row: Row, token: int) -> Row | None:
        return normalise([0 if t == token else v for t, v in enumerate(row)])

    def residual(self, r: Row, q: Row) -> Row | None:
        return normalise([max(0, a - b) for a, b in zip(r, q, strict=True)])

    def weighted_residual(self, r: Row, q: Row, weight: Any) -> tuple[Any, Row | None]:
        diff = [max(0, weight * a - b) for a, b in zip(r, q, strict=True)]
        return sum(diff), normalise(diff)


REF_OPS = RefOps()


# ------------------------------------------------------------------------------------------------
# enumerating randomness


class ScriptedRandomness:
    """`RandomSource` that follows a script of outcome indices, then takes outcome 0 of each new choice.

    It records every choice's number of possible outcomes and multiplies the probabilities of the
    outcomes taken, so `enumerate_law` can replay every branch once. Zero-probability outcomes are pruned.
    """

    def __init__(self, script: Sequence[int]) -> None:
        self.script = script
        self.taken: list[int] = []
        self.arity: list[int] = []
        self.weight: Any = 1

    def choose(self, options: Sequence[tuple[Any, Any]]) -> Any:
        total = sum(w for w, _ in options)
        assert all(w >= 0 for w, _ in options) and abs(total - 1) < 1e-9, f"not a law: {options}"
        live = [(w, v) for w, v in options if w > 0]
        pos = len(self.taken)
        k = self.script[pos] if pos < len(self.script) else 0
        self.taken.append(k)
        self.arity.append(len(live))
        w, value = live[k]
        self.weight *= w
        return value

    def accept(self, prob: Any) -> bool:
        return self.choose([(prob, True), (1 - prob, False)])

    def draw(self, row: Row) -> int:
        return self.choose([(w, t) for t, w in enumerate(row)])


def enumerate_law(program: Callable[[ScriptedRandomness], Hashable]) -> dict[Hashable, Any]:
    """Exact law of program's result: program runs once per branch of its random choices."""
    law: dict[Hashable, Any] = defaultdict(int)
    pending: list[tuple[int, ...]] = [()]
    while pending:
        script = pending.pop()
        rng = ScriptedRandomness(script)
        result = program(rng)
        law[result] += rng.weight
        for pos in range(len(script), len(rng.taken)):
            for alt in range(1, rng.arity[pos]):
                pending.append(tuple(rng.taken[:pos]) + (alt,))
    assert abs(sum(law.values()) - 1) < 1e-9
    return dict(law)


def total_variation(a: dict[Hashable, Any], b: dict[Hashable, Any]) -> Any:
    return sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)) / 2


# ------------------------------------------------------------------------------------------------
# toy target / draft tables


class Tables(Protocol):
    vocab: int

    def p(self, ctx: Ctx) -> Row: ...

    def q(self, ctx: Ctx) -> Row: ...


class FilteredRow(tuple):
    """A filtered target row that remembers the unfiltered row it came from (for negative control e)."""

    raw: Row


FLAVORS = ("generic", "p_zero", "disjoint", "q_near_p", "onehot", "filtered", "depth_only", "q_onehot", "q_equals_p")


@dataclass
class ToyTables:
    """Exact target p and draft q keyed by the full context (or by its length for flavor depth_only).

    generic: independent random rows with some zeros; p_zero: p is 0 on q's two favourite tokens;
    disjoint: p and q have disjoint supports; q_near_p: q is a small perturbation of p; onehot: p is a
    point mass; filtered: p is the top-2 of a raw row, renormalised (row.raw keeps the raw row); q_onehot: q is
    a point mass (a deterministic draft seen as a law); q_equals_p: the draft is the target.
    """

    vocab: int
    seed: int
    flavor: str = "generic"
    _cache: dict[tuple[str, Ctx], Row] = field(default_factory=dict, repr=False)

    def p(self, ctx: Ctx) -> Row:
        return self._row("p", ctx)

    def q(self, ctx: Ctx) -> Row:
        return self._row("q", ctx)

    def _row(self, kind: str, ctx: Ctx) -> Row:
        key = (kind, (len(ctx),) if self.flavor == "depth_only" else ctx)
        if key not in self._cache:
            self._cache[key] = self._make(kind, key[1])
        return self._cache[key]

    def _rand(self, kind: str, key: Ctx) -> random.Random:
        return random.Random(f"{self.seed}/{self.flavor}/{kind}/{key}")

    def _weights(self, rnd: random.Random, lo: int = 0, hi: int = 5) -> list[int]:
        w = [rnd.randint(lo, hi) for _ in range(self.vocab)]
        if sum(w) == 0:
            w[rnd.randrange(self.vocab)] = 1
        return w

    def _make(self, kind: str, key: Ctx) -> Row:
        rnd = self._rand(kind, key)
        v = self.vocab
        if self.flavor == "q_near_p":
            base = self._weights(self._rand("p", key), 20, 40)
            if kind == "p":
                return normalise([Fraction(x) for x in base])
            return normalise([Fraction(x + rnd.randint(-2, 2)) for x in base])
        if self.flavor == "q_equals_p" and kind == "q":
            return self.p(key)
        if self.flavor == "q_onehot" and kind == "q":
            return _one_hot(rnd.randrange(v), v)
        if self.flavor == "disjoint":
            support = set(self._rand("support", key).sample(range(v), v // 2))
            mine = support if kind == "p" else set(range(v)) - support
            return normalise([Fraction(rnd.randint(1, 5)) if t in mine else Fraction(0) for t in range(v)])
        if kind == "q":
            return normalise([Fraction(x) for x in self._weights(rnd)])
        if self.flavor == "p_zero":
            q = self.q(key)
            favourites = sorted(range(v), key=lambda t: (-q[t], t))[:2]
            w = [0 if t in favourites else rnd.randint(1, 5) for t in range(v)]
            return normalise([Fraction(x) for x in w])
        if self.flavor == "onehot":
            return _one_hot(rnd.randrange(v), v)
        if self.flavor == "filtered":
            raw = normalise([Fraction(x) for x in self._weights(rnd, 1, 6)])
            keep = sorted(range(v), key=lambda t: (-raw[t], t))[:2]
            row = FilteredRow(normalise([raw[t] if t in keep else Fraction(0) for t in range(v)]))
            row.raw = raw
            return row
        return normalise([Fraction(x) for x in self._weights(rnd)])


def _one_hot(token: int, vocab: int) -> Row:
    return tuple(Fraction(int(t == token)) for t in range(vocab))


def truth_law(tables: Tables, n: int, ctx: Ctx = ()) -> dict[Ctx, Any]:
    """Law of n tokens sampled from the target alone: prod_i p(y_i | ctx, y_<i)."""
    if n == 0:
        return {(): 1}
    law: dict[Ctx, Any] = {}
    for y, w in enumerate(tables.p(ctx)):
        if w > 0:
            for rest, w2 in truth_law(tables, n - 1, ctx + (y,)).items():
                law[(y,) + rest] = w * w2
    return law


# ------------------------------------------------------------------------------------------------
# drafting


@dataclass(frozen=True)
class DraftSpec:
    """How a tree is drafted. parents: tree shape (parents[0] = -1).

    topk: child j of a node carries the rank-j token of q at that node (ties: lower id).
    fixed: node i carries tokens[i] whatever the context.
    iid: every node is drawn independently from q at its parent.
    wor: siblings are drawn one after another without replacement from q at their parent
         (a sibling whose law has no mass left is dropped with its subtree).
    best_first: the runtime's `build_best_first_tree` (DDTree) over a path-independent draft whose law at depth d is
         q at the context followed by d - 1 zeros; `parents` only sets the budget (its node count) and the depth.
    """

    kind: str
    parents: tuple[int, ...]
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    contexts: tuple[Ctx, ...]  # context after the path to node i (root: the committed context)


def draft_tree(spec: DraftSpec, tables: Tables, ctx: Ctx, rng: Any) -> Draft:
    root = ctx[-1] if ctx else 0
    if spec.kind == "best_first":
        return best_first_draft(spec, tables, ctx, root)
    tokens, parents, contexts = [root], [-1], [ctx]
    new_index: dict[int, int] = {0: 0}
    sibling_law: dict[int, Row | None] = {}  # wor: remaining law at each parent (new index)
    sibling_rank: dict[int, int] = defaultdict(int)
    for i in range(1, len(spec.parents)):
        parent = new_index.get(spec.parents[i])
        if parent is None:  # ancestor dropped
            continue
        q = tables.q(contexts[parent])
        if spec.kind == "topk":
            token = sorted(range(tables.vocab), key=lambda t: (-q[t], t))[sibling_rank[parent]]
        elif spec.kind == "fixed":
            token = spec.tokens[i]
        elif spec.kind == "iid":
            token = rng.draw(q)
        elif spec.kind == "wor":
            law = sibling_law.get(parent, q)
            if law is None:
                continue
            token = rng.draw(law)
            sibling_law[parent] = REF_OPS.remove(law, token)
        else:
            raise ValueError(spec.kind)
        sibling_rank[parent] += 1
        new_index[i] = len(tokens)
        tokens.append(token)
        parents.append(parent)
        contexts.append(contexts[parent] + (token,))
    return Draft(tuple(tokens), tuple(parents), tuple(contexts))


def best_first_draft(spec: DraftSpec, tables: Tables, ctx: Ctx, root: int) -> Draft:
    """The runtime's best-first tree on the per-depth laws q(ctx + (0,) * (d - 1)), d = 1..depth (see DraftSpec)."""
    depth = int(depths_of(torch.tensor(spec.parents)).max())
    laws = torch.tensor([[float(x) for x in tables.q(ctx + (0,) * d)] for d in range(depth)]).log()  # [D, V]
    tree = build_best_first_tree(MarginalStepper(laws), root, depth, len(spec.parents) - 1,
                                 torch.arange(tables.vocab), "deterministic")
    tokens, parents = tuple(tree.tokens.tolist()), tuple(tree.parents.tolist())
    contexts = [ctx]
    for i in range(1, len(tokens)):
        contexts.append(contexts[parents[i]] + (tokens[i],))
    return Draft(tokens, parents, tuple(contexts))


# ------------------------------------------------------------------------------------------------
# one speculative step and the loop


Verifier = Callable[..., tuple[list[int], int]]  # walk_tree's signature


@dataclass(frozen=True)
class Variant:
    """What the step verifies with: the real core by default; negative controls swap one piece."""

    verify: Verifier = walk_tree
    ops: Any = REF_OPS
    wrap_rng: Callable[[Any], Any] | None = None


REAL = Variant()


def speculative_step(
    tables: Tables, spec: DraftSpec, mode: str, ctx: Ctx, rng: Any, variant: Variant = REAL
) -> tuple[Ctx, int]:
    """Draft a tree at ctx, verify it; return (emitted tokens, number of accepted drafts)."""
    d = draft_tree(spec, tables, ctx, rng)
    verifier_rng = variant.wrap_rng(rng) if variant.wrap_rng else rng
    accepted, nxt = variant.verify(
        Tree.from_parents(d.tokens, d.parents),
        mode=mode,
        target_row=lambda i: tables.p(d.contexts[i]),
        draft_row=lambda i: tables.q(d.contexts[i]),
        ops=variant.ops,
        rng=verifier_rng,
    )
    return tuple(d.tokens[i] for i in accepted) + (nxt,), len(accepted)


class LoopLaw:
    """Exact laws of the speculative generation loop (steps from each context, memoised)."""

    def __init__(self, tables: Tables, spec: DraftSpec, mode: str, variant: Variant = REAL) -> None:
        self.tables, self.spec, self.mode, self.variant = tables, spec, mode, variant
        self._steps: dict[Ctx, dict[tuple[Ctx, int], Any]] = {}
        self._firsts: dict[tuple[Ctx, int], dict[Ctx, Any]] = {}

    def step(self, ctx: Ctx = ()) -> dict[tuple[Ctx, int], Any]:
        """Law of (emitted tokens, accepted count) of one step from ctx."""
        if ctx not in self._steps:
            program = partial(speculative_step, self.tables, self.spec, self.mode, ctx, variant=self.variant)
            self._steps[ctx] = enumerate_law(lambda rng: program(rng=rng))
        return self._steps[ctx]

    def emitted(self, ctx: Ctx = ()) -> dict[Ctx, Any]:
        law: dict[Ctx, Any] = defaultdict(int)
        for (tokens, _), w in self.step(ctx).items():
            law[tokens] += w
        return dict(law)

    def accepted_counts(self, ctx: Ctx = ()) -> dict[int, Any]:
        law: dict[int, Any] = defaultdict(int)
        for (_, n_acc), w in self.step(ctx).items():
            law[n_acc] += w
        return dict(law)

    def expected_accepted(self, ctx: Ctx = ()) -> Any:
        return sum(n * w for n, w in self.accepted_counts(ctx).items())

    def first_tokens(self, n: int, ctx: Ctx = ()) -> dict[Ctx, Any]:
        """Law of the first n tokens the loop commits from ctx (run until >= n, truncate)."""
        key = (ctx, n)
        if key not in self._firsts:
            law: dict[Ctx, Any] = defaultdict(int)
            for tokens, w in self.emitted(ctx).items():
                if len(tokens) >= n:
                    law[tokens[:n]] += w
                else:
                    for rest, w2 in self.first_tokens(n - len(tokens), ctx + tokens).items():
                        law[tokens + rest] += w * w2
            self._firsts[key] = dict(law)
        return self._firsts[key]

    def within_step_mismatches(self, ctx: Ctx = ()) -> list[tuple[Ctx, int, Any, Any]]:
        """Check E_{m+1} | (E_1..E_m, more than m emitted) ~ p(. | ctx, E_1..E_m) inside one step."""
        joint: dict[Ctx, dict[int, Any]] = defaultdict(lambda: defaultdict(int))
        for tokens, w in self.emitted(ctx).items():
            for m in range(len(tokens)):
                joint[tokens[:m]][tokens[m]] += w
        bad = []
        for prefix, by_token in joint.items():
            mass = sum(by_token.values())
            p = self.tables.p(ctx + prefix)
            for y in range(self.tables.vocab):
                if by_token.get(y, 0) / mass != p[y]:
                    bad.append((prefix, y, by_token.get(y, 0) / mass, p[y]))
        return bad
