"""Exact proofs that tree verification is lossless (the API contract: test_verify_api.py).

The real decision code (`walk_tree`) runs with rational arithmetic and a randomness source that
enumerates every coin and draw with its exact probability (verify_harness). For toy vocabularies the
law of the first N tokens committed by the speculative loop must equal prod_i p(y_i | y_<i) exactly,
for every mode and tree; closed forms pin the acceptance; broken variants must be caught.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from verify_controls import (
    FrozenWeightOps,
    NoResidualOps,
    OneUniform,
    ReusedCoins,
    UnfilteredResidualOps,
    UnweightedResidualOps,
    per_path_verify,
)
from verify_harness import (
    REF_OPS,
    DraftSpec,
    LoopLaw,
    ToyTables,
    Variant,
    draft_tree,
    enumerate_law,
    total_variation,
    truth_law,
)

N_TOKENS = 3

CHAIN = (-1, 0, 1, 2)
WIDE = (-1, 0, 0, 0)
SMALL = (-1, 0, 0, 1)
DEEP_WIDE = (-1, 0, 0, 1, 1, 3)  # nodes 2 and 4 are leaves above the deepest level
BUSHY = (-1, 0, 0, 0, 1, 1)  # three siblings (may exhaust a 3-token support) and two under the first
LONG_CHAIN = (-1, 0, 1, 2, 3)
WIDE_DEEP = (-1, 0, 0, 0, 2)  # three siblings, the second one with a child


def topk(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("topk", parents)


def iid(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("iid", parents)


def wor(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("wor", parents)


def best_first(parents: tuple[int, ...]) -> DraftSpec:
    """The runtime's best-first (DDTree) tree with the node count and depth of `parents`."""
    return DraftSpec("best_first", parents)


# fixed children with duplicate siblings (nodes 1, 2) and a child under the duplicate (node 5)
FIXED_DUPLICATES = DraftSpec("fixed", (-1, 0, 0, 0, 1, 2), (0, 1, 1, 2, 0, 2))

# (mode, vocab, seed, flavor, spec)
LOSSLESS_CASES = [
    ("deterministic", 4, 1, "generic", topk(CHAIN)),
    ("deterministic", 4, 2, "generic", topk(DEEP_WIDE)),
    ("deterministic", 3, 3, "p_zero", topk(WIDE)),
    ("deterministic", 4, 4, "disjoint", topk(SMALL)),
    ("deterministic", 5, 5, "q_near_p", topk(DEEP_WIDE)),
    ("deterministic", 4, 6, "filtered", topk(WIDE)),
    ("deterministic", 3, 7, "generic", FIXED_DUPLICATES),
    ("deterministic", 4, 8, "onehot", topk(DEEP_WIDE)),
    ("deterministic", 3, 9, "generic", iid(SMALL)),  # sampled drafts verified by the delta rule
    ("deterministic", 4, 101, "generic", best_first(DEEP_WIDE)),  # the runtime's best-first builder
    ("deterministic", 3, 102, "depth_only", best_first(BUSHY)),  # the draft's laws really are per depth
    ("deterministic", 4, 103, "p_zero", best_first(WIDE_DEEP)),
    ("deterministic", 5, 104, "filtered", best_first(DEEP_WIDE)),
    ("deterministic", 3, 105, "q_onehot", best_first(LONG_CHAIN)),  # one finite token per depth: a chain
    ("iid", 3, 11, "generic", iid(CHAIN)),
    ("iid", 3, 12, "generic", iid(WIDE)),  # duplicate siblings are drawn often
    ("iid", 4, 13, "p_zero", iid(SMALL)),
    ("iid", 4, 14, "disjoint", iid(SMALL)),
    ("iid", 3, 15, "q_near_p", iid(WIDE)),
    ("iid", 4, 16, "filtered", iid(CHAIN)),
    ("iid", 3, 17, "onehot", iid(SMALL)),
    ("without_replacement", 3, 21, "generic", wor(WIDE)),  # 3 siblings may exhaust q's support
    ("without_replacement", 4, 22, "generic", wor(SMALL)),
    ("without_replacement", 4, 23, "p_zero", wor(WIDE)),
    ("without_replacement", 4, 24, "disjoint", wor(SMALL)),
    ("without_replacement", 3, 25, "q_near_p", wor(CHAIN)),
    ("without_replacement", 5, 26, "filtered", wor((-1, 0, 0))),
    ("greedy", 4, 31, "onehot", topk(DEEP_WIDE)),
    ("greedy", 3, 32, "onehot", FIXED_DUPLICATES),
    ("greedy", 4, 33, "onehot", best_first(DEEP_WIDE)),
    ("block", 3, 71, "generic", iid(CHAIN)),
    ("block", 4, 72, "p_zero", iid(CHAIN)),
    ("block", 4, 73, "disjoint", iid(CHAIN)),
    ("block", 3, 74, "q_near_p", iid(CHAIN)),
    ("block", 4, 75, "filtered", iid(CHAIN)),
    ("block", 3, 76, "onehot", iid(CHAIN)),
    ("block", 3, 77, "q_onehot", iid(CHAIN)),
    ("block", 2, 78, "generic", iid(LONG_CHAIN)),
    ("traversal", 3, 81, "generic", wor(DEEP_WIDE)),
    ("traversal", 3, 82, "generic", wor(BUSHY)),
    ("traversal", 4, 83, "p_zero", wor(SMALL)),
    ("traversal", 4, 84, "disjoint", wor(SMALL)),
    ("traversal", 3, 85, "q_near_p", wor(DEEP_WIDE)),
    ("traversal", 4, 86, "filtered", wor(SMALL)),
    ("traversal", 3, 87, "onehot", wor(BUSHY)),
    ("traversal_iid", 3, 91, "generic", iid(DEEP_WIDE)),
    ("traversal_iid", 3, 92, "generic", iid(BUSHY)),  # duplicate siblings are drawn often
    ("traversal_iid", 4, 93, "p_zero", iid(SMALL)),
    ("traversal_iid", 4, 94, "disjoint", iid(SMALL)),
    ("traversal_iid", 3, 95, "q_near_p", iid(SMALL)),
    ("traversal_iid", 4, 96, "filtered", iid(SMALL)),
    ("traversal_iid", 3, 97, "q_onehot", iid(DEEP_WIDE)),
]


def _case_id(case: tuple) -> str:
    mode, vocab, seed, flavor, spec = case
    return f"{mode}-{spec.kind}{len(spec.parents) - 1}-{flavor}-V{vocab}-s{seed}"


@pytest.mark.parametrize("case", LOSSLESS_CASES, ids=[_case_id(c) for c in LOSSLESS_CASES])
def test_loop_law_equals_target_law_exactly(case: tuple) -> None:
    mode, vocab, seed, flavor, spec = case
    tables = ToyTables(vocab, seed, flavor)
    loop = LoopLaw(tables, spec, mode)
    assert loop.first_tokens(N_TOKENS) == truth_law(tables, N_TOKENS)
    assert loop.within_step_mismatches() == []
    if flavor in ("generic", "q_near_p", "filtered") and spec.kind != "fixed":
        assert 0 < loop.expected_accepted() < len(spec.parents) - 1  # both branches of the walk occur


def test_cases_cover_duplicates_exhaustion_and_rejection() -> None:
    """The enumerated cases really contain the situations they claim to cover."""
    dup_trees = [t for t in _iid_trees(ToyTables(3, 12, "generic"), WIDE) if len(set(t)) < 3]
    assert dup_trees, "iid wide tree never drew duplicate siblings"
    counts = LoopLaw(ToyTables(4, 2, "generic"), topk(DEEP_WIDE), "deterministic").accepted_counts()
    assert set(counts) == {0, 1, 2, 3}  # every depth, including the all-accepted bonus case
    exhausted = ToyTables(3, 21, "generic")  # q at the root has 2 live tokens: the third sibling is dropped
    sizes = enumerate_law(lambda rng: len(draft_tree(wor(WIDE), exhausted, (), rng).tokens))
    assert sizes == {3: 1}
    p_zero = ToyTables(3, 3, "p_zero")
    assert all(p_zero.p(())[t] == 0 for t in draft_tree(topk(WIDE), p_zero, (), None).tokens[1:3])


def _iid_trees(tables: ToyTables, parents: tuple[int, ...]) -> list[tuple[int, ...]]:
    law = enumerate_law(lambda rng: draft_tree(iid(parents), tables, (), rng).tokens[1:])
    return list(law)


# ------------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("seed", [41, 42, 43])
def test_greedy_commits_the_argmax_path(seed: int) -> None:
    """With any target rows, greedy verification commits exactly what greedy decoding would."""
    tables = ToyTables(4, seed, "generic")
    ctx: tuple[int, ...] = ()
    for _ in range(N_TOKENS):
        ctx += (REF_OPS.argmax(tables.p(ctx)),)
    for spec in (topk(DEEP_WIDE), FIXED_DUPLICATES, topk(CHAIN), best_first(DEEP_WIDE)):
        assert LoopLaw(tables, spec, "greedy").first_tokens(N_TOKENS) == {ctx: 1}


def test_greedy_equals_deterministic_on_one_hot_targets() -> None:
    tables = ToyTables(4, 44, "onehot")
    for spec in (topk(DEEP_WIDE), FIXED_DUPLICATES):
        greedy = LoopLaw(tables, spec, "greedy")
        deterministic = LoopLaw(tables, spec, "deterministic")
        assert greedy.step() == deterministic.step()


# ------------------------------------------------------------------------------------------------
# acceptance against closed forms


def _depth_rows(tables: ToyTables, depth: int) -> tuple[tuple, tuple]:
    ctx = (0,) * depth  # depth_only tables: only the length of the context matters
    return tables.p(ctx), tables.q(ctx)


@pytest.mark.parametrize("seed", [51, 52])
def test_deterministic_chain_acceptance_closed_form(seed: int) -> None:
    """E[#accepted] = sum_i prod_{j<=i} p_j(x_j), x_j = argmax q_j (context-free tables)."""
    tables = ToyTables(4, seed, "depth_only")
    expected, run = Fraction(0), Fraction(1)
    for depth in range(len(CHAIN) - 1):
        p, q = _depth_rows(tables, depth)
        run *= p[REF_OPS.argmax(q)]
        expected += run
    assert LoopLaw(tables, topk(CHAIN), "deterministic").expected_accepted() == expected


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
@pytest.mark.parametrize("seed", [53, 54])
def test_sampled_chain_acceptance_closed_form(mode: str, seed: int) -> None:
    """E[#accepted] = sum_i prod_{j<=i} beta_j, beta_j = sum min(p_j, q_j) (Leviathan)."""
    tables = ToyTables(4, seed, "depth_only")
    expected, run = Fraction(0), Fraction(1)
    for depth in range(len(CHAIN) - 1):
        p, q = _depth_rows(tables, depth)
        run *= sum(min(a, b) for a, b in zip(p, q, strict=True))
        expected += run
    spec = iid(CHAIN) if mode == "iid" else wor(CHAIN)
    assert LoopLaw(tables, spec, mode).expected_accepted() == expected


@pytest.mark.parametrize("seed", [55, 56])
def test_deterministic_tree_reaches_each_node_with_target_path_probability(seed: int) -> None:
    """P(node v accepted) = prod of p(tok | parent path) along the path; so a node's children are
    accepted with total probability p(children) — optimal for deterministic drafts."""
    tables = ToyTables(4, seed, "generic")
    loop = LoopLaw(tables, topk(DEEP_WIDE), "deterministic")
    d = draft_tree(topk(DEEP_WIDE), tables, (), None)
    for node in range(1, len(d.tokens)):
        path = d.contexts[node]
        reach = math.prod(tables.p(path[:k])[path[k]] for k in range(len(path)))
        observed = sum(w for (toks, n), w in loop.step().items() if n >= len(path) and toks[: len(path)] == path)
        assert observed == reach, node


# ------------------------------------------------------------------------------------------------
# negative controls: every broken variant must be caught by the same checks


def _law(tables: ToyTables, spec: DraftSpec, mode: str, variant: Variant) -> dict:
    return LoopLaw(tables, spec, mode, variant).first_tokens(N_TOKENS)


BROKEN_CASES = [
    # (a) q(x) in the ratio although the children were chosen by top-k of q
    ("a-q-ratio-with-topk", "iid", ToyTables(4, 61, "generic"), topk(WIDE), Variant()),
    # (b) no sibling zeroing / no residual update, in every sampled mode
    ("b-no-zeroing-det", "deterministic", ToyTables(4, 62, "generic"), topk(WIDE), Variant(ops=NoResidualOps())),
    ("b-no-residual-iid", "iid", ToyTables(3, 63, "generic"), iid(WIDE), Variant(ops=NoResidualOps())),
    ("b-no-residual-wor", "without_replacement", ToyTables(4, 64, "generic"), wor(WIDE), Variant(ops=NoResidualOps())),
    # (c) per-path independent target samples (Medusa nucleus style)
    ("c-per-path", "deterministic", ToyTables(4, 65, "generic"), topk(DEEP_WIDE), Variant(verify=per_path_verify)),
    # (d) the k-th coin of every depth level is the same uniform
    ("d-reused-coin-det", "deterministic", ToyTables(4, 66, "generic"), topk(CHAIN), Variant(wrap_rng=ReusedCoins)),
    ("d-reused-coin-iid", "iid", ToyTables(3, 67, "generic"), iid(CHAIN), Variant(wrap_rng=ReusedCoins)),
    # (e) residual built from the unfiltered target row
    (
        "e-unfiltered-det",
        "deterministic",
        ToyTables(4, 68, "filtered"),
        topk(WIDE),
        Variant(ops=UnfilteredResidualOps()),
    ),
    ("e-unfiltered-iid", "iid", ToyTables(4, 69, "filtered"), iid(CHAIN), Variant(ops=UnfilteredResidualOps())),
    # the same mistakes in block / traversal verification, and theirs of their own:
    ("a-block-on-topk-chain", "block", ToyTables(4, 161, "generic"), topk(CHAIN), Variant()),
    ("b-no-residual-block", "block", ToyTables(3, 162, "generic"), iid(CHAIN), Variant(ops=NoResidualOps())),
    ("b-no-residual-traversal", "traversal", ToyTables(4, 163, "generic"), wor(SMALL), Variant(ops=NoResidualOps())),
    ("d-one-uniform-block", "block", ToyTables(3, 171, "generic"), iid(CHAIN), Variant(wrap_rng=OneUniform)),
    (
        "e-unfiltered-traversal",
        "traversal_iid",
        ToyTables(4, 165, "filtered"),
        iid(SMALL),
        Variant(ops=UnfilteredResidualOps()),
    ),
    # (f) a rejected subtree leaves the parent's weight as it was; (g) the next token after a stop at a node of
    # weight w < 1 is drawn from the token-wise residual norm(max(0, r - q)) instead of norm(max(0, w r - q))
    ("f-frozen-weight-block", "block", ToyTables(3, 166, "generic"), iid(CHAIN), Variant(ops=FrozenWeightOps())),
    ("f-frozen-weight-traversal", "traversal", ToyTables(4, 167, "generic"), wor(SMALL), Variant(ops=FrozenWeightOps())),
    ("g-unweighted-residual-block", "block", ToyTables(3, 168, "generic"), iid(CHAIN), Variant(ops=UnweightedResidualOps())),
    (
        "g-unweighted-residual-traversal",
        "traversal_iid",
        ToyTables(3, 169, "generic"),
        iid(SMALL),
        Variant(ops=UnweightedResidualOps()),
    ),
    # (h) the i.i.d. sibling rule on siblings drawn without replacement (q must lose each rejected token)
    ("h-iid-rule-on-wor-tree", "traversal_iid", ToyTables(4, 170, "generic"), wor(WIDE_DEEP), Variant()),
]


@pytest.mark.parametrize("name,mode,tables,spec,variant", BROKEN_CASES, ids=[c[0] for c in BROKEN_CASES])
def test_broken_variant_gives_wrong_law(
    name: str, mode: str, tables: ToyTables, spec: DraftSpec, variant: Variant
) -> None:
    truth = truth_law(tables, N_TOKENS)
    correct_mode = {"topk": "deterministic", "fixed": "deterministic", "iid": "iid", "wor": "without_replacement"}
    assert LoopLaw(tables, spec, correct_mode[spec.kind]).first_tokens(N_TOKENS) == truth  # same setup, real core
    broken = _law(tables, spec, mode, variant)
    assert broken != truth
    assert total_variation(broken, truth) > Fraction(1, 1000), name


def test_sample_and_match_is_lossless_but_fails_acceptance_closed_form() -> None:
    """Verifying sampled (iid) drafts by the delta rule keeps the law but accepts sum(p*q) < sum(min(p,q))."""
    tables = ToyTables(4, 57, "depth_only")
    loop = LoopLaw(tables, iid(CHAIN), "deterministic")
    assert loop.first_tokens(N_TOKENS) == truth_law(tables, N_TOKENS)
    leviathan, sample_and_match, run_l, run_s = Fraction(0), Fraction(0), Fraction(1), Fraction(1)
    for depth in range(len(CHAIN) - 1):
        p, q = _depth_rows(tables, depth)
        run_l *= sum(min(a, b) for a, b in zip(p, q, strict=True))
        run_s *= sum(a * b for a, b in zip(p, q, strict=True))
        leviathan += run_l
        sample_and_match += run_s
    assert loop.expected_accepted() == sample_and_match
    assert loop.expected_accepted() < leviathan  # the closed-form check rejects it
