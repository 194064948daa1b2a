"""Exact proofs of what block and traversal verification add over token-wise verification.

The losslessness of every mode (block, traversal, traversal_iid included) is proved in test_verify_exact.py;
here, with the same exact machinery (verify_harness): block mode has the law of Sun et al.'s algorithm as
written; expected accepted drafts per step are never below the token-wise rule on the same drafts, equal where
theory says so (no ratio p/q can recover, depth-1 drafts) and strictly above where a drafted path recovers;
the enumerated traversal cases contain the events token-wise verification cannot produce.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from verify_controls import sun_block_verify
from verify_harness import FLAVORS, REF_OPS, DraftSpec, LoopLaw, ToyTables, Variant, draft_tree, enumerate_law

from speculators.runtime.verify.lossless import Tree, walk_tree

CHAIN = (-1, 0, 1, 2)
LONG_CHAIN = (-1, 0, 1, 2, 3)
WIDE = (-1, 0, 0, 0)
SMALL = (-1, 0, 0, 1)
DEEP_WIDE = (-1, 0, 0, 1, 1, 3)
BUSHY = (-1, 0, 0, 0, 1, 1)


def iid(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("iid", parents)


def wor(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("wor", parents)


@pytest.mark.parametrize("flavor", ["generic", "q_near_p", "p_zero", "filtered", "q_equals_p", "depth_only"])
def test_block_mode_is_sun_et_al_algorithm(flavor: str) -> None:
    """The walk's block mode (leaf-to-root scan) and Sun et al.'s forward algorithm (all coins drawn, tau =
    the last position whose coin falls under h_i) give the same law of (emitted tokens, accepted count)."""
    for spec, vocab in ((iid(CHAIN), 3), (iid(LONG_CHAIN), 2)):
        if flavor == "p_zero" and vocab < 3:
            continue
        tables = ToyTables(vocab, 111, flavor)
        ours = LoopLaw(tables, spec, "block").step()
        assert ours == LoopLaw(tables, spec, "block", Variant(verify=sun_block_verify)).step()


# (better mode, token-wise mode on the same drafts, draft spec, vocab)
OPTIMALITY_CASES = [
    ("block", "iid", iid(CHAIN), 3),
    ("block", "iid", iid(LONG_CHAIN), 2),
    ("traversal", "without_replacement", wor(DEEP_WIDE), 3),
    ("traversal", "without_replacement", wor(BUSHY), 3),
    ("traversal_iid", "iid", iid(DEEP_WIDE), 3),
    ("traversal_iid", "iid", iid(SMALL), 4),
]
NO_RECOVERY_FLAVORS = ("disjoint", "onehot", "q_onehot", "q_equals_p")  # every ratio p/q is 0, 1/q(t), <= 1 or 1


def _opt_id(case: tuple) -> str:
    return f"{case[0]}-vs-{case[1]}-{case[2].kind}{case[2].parents}-V{case[3]}".replace(" ", "")


def _chain_recovers(tables: ToyTables, depth: int) -> bool:
    """Whether some drafted chain has a ratio p/q > 1 after its weight fell into (0, 1): exactly then block
    verification accepts more than token-wise (w_i = min(1, w_{i-1} rho_i) >= prod_j min(1, rho_j), with
    equality on every path iff no such recovery)."""
    paths = [((), Fraction(1))]
    for _ in range(depth):
        grown = []
        for ctx, w in paths:
            p, q = tables.p(ctx), tables.q(ctx)
            for x in range(tables.vocab):
                if q[x] > 0:
                    rho = p[x] / q[x]
                    if 0 < w < 1 and rho > 1:
                        return True
                    grown.append((ctx + (x,), min(Fraction(1), w * rho)))
        paths = grown
    return False


@pytest.mark.parametrize("case", OPTIMALITY_CASES, ids=[_opt_id(c) for c in OPTIMALITY_CASES])
def test_block_and_traversal_never_accept_less_than_token_wise(case: tuple) -> None:
    """Exact expected accepted drafts per step on every flavor: >= the token-wise rule on the same drafts; equal
    where no ratio can recover (one-hot target or draft, q = p, disjoint supports); strictly more when the draft
    is a perturbed target; for chains, strictly more exactly when some drafted chain recovers."""
    better, token_wise, spec, vocab = case
    strict = 0
    for flavor in FLAVORS:
        if flavor == "p_zero" and vocab < 3:
            continue  # p is zero on q's two favourites: no law left on two tokens
        for seed in (101, 102):
            tables = ToyTables(vocab, seed, flavor)
            ours = LoopLaw(tables, spec, better).expected_accepted()
            theirs = LoopLaw(tables, spec, token_wise).expected_accepted()
            assert ours >= theirs, (flavor, seed, ours, theirs)
            if flavor in NO_RECOVERY_FLAVORS:
                assert ours == theirs, (flavor, seed)
            if flavor == "q_near_p":
                assert ours > theirs, (flavor, seed)
            if better == "block" and flavor != "depth_only":
                assert (ours > theirs) == _chain_recovers(tables, len(spec.parents) - 1), (flavor, seed)
            strict += ours > theirs
    assert strict >= 2


@pytest.mark.parametrize(
    "better,token_wise,spec",
    [
        ("traversal", "without_replacement", wor(WIDE)),
        ("traversal_iid", "iid", iid(WIDE)),
        ("block", "iid", iid((-1, 0))),
        ("traversal", "without_replacement", wor((-1, 0))),
    ],
)
def test_depth_one_drafts_verify_exactly_as_token_wise(better: str, token_wise: str, spec: DraftSpec) -> None:
    """With every draft at depth 1 the root keeps weight 1: the same coins, residuals and law, step by step."""
    for flavor in ("generic", "q_near_p", "filtered"):
        tables = ToyTables(3, 112, flavor)
        assert LoopLaw(tables, spec, better).step() == LoopLaw(tables, spec, token_wise).step()


def test_traversal_cases_stop_inside_the_tree_and_revive_later_siblings() -> None:
    """The enumerated traversal cases contain what token-wise verification cannot do: stop at an inner node after
    its subtree was rejected (next token from its weighted residual), and accept a later sibling below the root
    after the first sibling's subtree was rejected."""
    tables = ToyTables(3, 84, "generic")
    spec = wor(DEEP_WIDE)

    def program(rng: object) -> tuple[bool, bool]:
        d = draft_tree(spec, tables, (), rng)
        tree = Tree.from_parents(d.tokens, d.parents)
        accepted, _ = walk_tree(tree, mode="traversal", target_row=lambda i: tables.p(d.contexts[i]),
                                draft_row=lambda i: tables.q(d.contexts[i]), ops=REF_OPS, rng=rng)
        last = accepted[-1] if accepted else 0
        inner_stop = last > 0 and bool(tree.children[last])
        later_sibling = any(node != tree.children[d.parents[node]][0] for node in accepted[1:])
        return inner_stop, later_sibling

    law = enumerate_law(program)
    assert sum(w for (inner, _), w in law.items() if inner) > 0
    assert sum(w for (_, later), w in law.items() if later) > 0


@pytest.mark.parametrize("seed", [113, 114])
def test_metrics_block_formula_predicts_the_walks_acceptance(seed: int) -> None:
    """For depth-only laws the walk's exact expected accepted drafts in block mode is sum_k E[w_k]: the evaluation
    formula (`metrics.block_reach_bounds`) brackets it, and the token-wise formula gives the iid walk's exactly."""
    import torch

    from speculators.core import metrics

    tables = ToyTables(4, seed, "depth_only")
    depth = len(LONG_CHAIN) - 1
    rows = [((0,) * k) for k in range(depth)]
    p = [torch.tensor([[float(x) for x in tables.p(ctx)]], dtype=torch.float64) for ctx in rows]
    q = [torch.tensor([[float(x) for x in tables.q(ctx)]], dtype=torch.float64) for ctx in rows]
    exact = LoopLaw(tables, iid(LONG_CHAIN), "block").expected_accepted()
    lower, upper = metrics.block_reach_bounds(p, q)
    assert float(lower.sum()) <= float(exact) + 1e-12 <= float(upper.sum()) + 2e-12
    assert float(upper.sum() - lower.sum()) < 0.02
    token_wise = metrics.chain_reach(torch.stack([metrics.sampled_alpha(a, b) for a, b in zip(p, q, strict=True)], 1))
    assert sum(token_wise) == pytest.approx(float(LoopLaw(tables, iid(LONG_CHAIN), "iid").expected_accepted()))
    assert float(exact) > sum(token_wise)


@pytest.mark.parametrize("mode,kind,shape", [("traversal", "wor", DEEP_WIDE), ("without_replacement", "wor", DEEP_WIDE),
                                             ("block", "iid", LONG_CHAIN), ("iid", "iid", LONG_CHAIN),
                                             ("deterministic", "topk", DEEP_WIDE)])
def test_expected_accepted_of_one_tree_is_exact(mode: str, kind: str, shape: tuple[int, ...]) -> None:
    """`verify_expect.expected_accepted` (torch rows, coins enumerated) equals the exact expectation of the core on
    rational rows, for each drafted tree of a case (given one tree, sequence-level verification may accept less than
    token-wise: the optimality holds in expectation over the drafts, test above)."""
    import torch

    from speculators.runtime.verify.expect import expected_accepted

    tables = ToyTables(3 if kind != "iid" else 2, 115, "generic")
    trees = enumerate_law(lambda rng: draft_tree(DraftSpec(kind, shape), tables, (), rng))
    for d in list(trees)[:12]:
        tree = Tree.from_parents(d.tokens, d.parents)

        def program(rng: object, tree: Tree = tree, d: object = d) -> int:
            accepted, _ = walk_tree(tree, mode=mode, target_row=lambda i: tables.p(d.contexts[i]),
                                    draft_row=lambda i: tables.q(d.contexts[i]), ops=REF_OPS, rng=rng)
            return len(accepted)

        exact = sum(n * w for n, w in enumerate_law(program).items())
        rows = torch.tensor([[float(x) for x in tables.p(c)] for c in d.contexts], dtype=torch.float64)
        draft = torch.tensor([[float(x) for x in tables.q(c)] for c in d.contexts], dtype=torch.float64)
        got = expected_accepted(torch.tensor(d.tokens), torch.tensor(d.parents), rows.__getitem__, draft, mode)
        assert got == pytest.approx(float(exact), abs=1e-9)
