"""Exact proofs that tree verification is lossless, plus the verify_tree API contract.

The real decision code (`walk_tree`) runs with rational arithmetic and a randomness source that
enumerates every coin and draw with its exact probability (verify_harness). For toy vocabularies the
law of the first N tokens committed by the speculative loop must equal prod_i p(y_i | y_<i) exactly,
for every mode and tree; closed forms pin the acceptance; broken variants must be caught.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest
import torch
from verify_harness import (
    REF_OPS,
    DraftSpec,
    LoopLaw,
    NoResidualOps,
    ReusedCoins,
    ToyTables,
    UnfilteredResidualOps,
    Variant,
    draft_tree,
    enumerate_law,
    per_path_verify,
    total_variation,
    truth_law,
)

from speculators.serving.verify import (
    TorchRandomness,
    TorchRowOps,
    chain_parents,
    remove_token,
    residual,
    verify_tree,
)

N_TOKENS = 3

CHAIN = (-1, 0, 1, 2)
WIDE = (-1, 0, 0, 0)
SMALL = (-1, 0, 0, 1)
DEEP_WIDE = (-1, 0, 0, 1, 1, 3)  # nodes 2 and 4 are leaves above the deepest level


def topk(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("topk", parents)


def iid(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("iid", parents)


def wor(parents: tuple[int, ...]) -> DraftSpec:
    return DraftSpec("wor", parents)


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
    for spec in (topk(DEEP_WIDE), FIXED_DUPLICATES, topk(CHAIN)):
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


# ------------------------------------------------------------------------------------------------
# torch backend vs reference arithmetic


def test_torch_row_ops_match_reference_arithmetic() -> None:
    gen = torch.Generator().manual_seed(0)
    ops = TorchRowOps()
    for _ in range(20):
        r = torch.distributions.Dirichlet(torch.full((7,), 0.5)).sample()
        r = r * (torch.rand(7, generator=gen) > 0.2)
        r = (r / r.sum()).double() if r.sum() > 0 else torch.full((7,), 1 / 7, dtype=torch.float64)
        q = torch.rand(7, generator=gen, dtype=torch.float64)
        q /= q.sum()
        rr, qq = tuple(r.tolist()), tuple(q.tolist())
        res, ref = ops.residual(r, q), REF_OPS.residual(rr, qq)
        assert (res is None) == (ref is None)
        if ref is not None:
            assert torch.allclose(res, torch.tensor(ref, dtype=torch.float64), atol=1e-12)
        tok = int(torch.argmax(r))
        rem, ref_rem = ops.remove(r, tok), REF_OPS.remove(rr, tok)
        assert (rem is None) == (ref_rem is None)
        if ref_rem is not None:
            assert torch.allclose(rem, torch.tensor(ref_rem, dtype=torch.float64), atol=1e-12)
        assert ops.argmax(r) == REF_OPS.argmax(rr)


def test_residual_helpers() -> None:
    r = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(r, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert residual(r, r) is None
    assert torch.allclose(remove_token(r, 0), torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))
    assert remove_token(torch.tensor([0.0, 1.0]), 1) is None
    assert r.tolist() == pytest.approx([0.5, 0.3, 0.2])  # inputs are not modified
    assert chain_parents(4).tolist() == [-1, 0, 1, 2]


def test_torch_randomness_never_accepts_zero_probability() -> None:
    rng = TorchRandomness(torch.Generator().manual_seed(0))
    assert not any(rng.accept(0.0) for _ in range(1000))
    assert all(rng.accept(1.0) for _ in range(1000))


# ------------------------------------------------------------------------------------------------
# verify_tree: the public API


def _inputs(n: int = 4, vocab: int = 5, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1)  # [N, V]
    return dict(
        tokens=torch.randint(0, vocab, (n,), generator=gen),
        parents=chain_parents(n),
        target_probs=probs,
        draft_probs=probs.flip(-1).contiguous(),
        generator=gen,
    )


def test_verify_tree_greedy_walks_argmax_children() -> None:
    eye = torch.eye(5)
    # root -> {1: tok 3, 2: tok 2}; node 2 -> {3: tok 4}; argmax: root 2, node2 4, node3 1
    target = torch.stack([eye[2], eye[0], eye[4], eye[1]])  # [4, 5]
    tokens = torch.tensor([0, 3, 2, 4])
    parents = torch.tensor([-1, 0, 0, 2])
    assert verify_tree(tokens, parents, target, mode="greedy", generator=None) == ([2, 3], 1)
    # with one-hot targets every sampled mode must agree with greedy
    uniform = torch.full((4, 5), 0.2)
    for mode in ("deterministic", "iid", "without_replacement"):
        got = verify_tree(tokens, parents, target, uniform, mode=mode, generator=torch.Generator().manual_seed(1))
        assert got == ([2, 3], 1)


def test_verify_tree_greedy_skips_duplicate_children() -> None:
    eye = torch.eye(3)
    target = torch.stack([eye[1], eye[2], eye[0]])  # node 1 (first tok 1) says 2, node 2 (dup) says 0
    got = verify_tree(torch.tensor([0, 1, 1]), torch.tensor([-1, 0, 0]), target, mode="greedy", generator=None)
    assert got == ([1], 2)


def test_verify_tree_is_reproducible_with_a_seed() -> None:
    for mode in ("deterministic", "iid", "without_replacement"):
        runs = []
        for _ in range(2):
            inp = _inputs(6, 50, seed=3)
            inp["parents"] = torch.tensor([-1, 0, 0, 1, 1, 2])
            inp["tokens"] = torch.tensor([0, 1, 2, 3, 4, 5])
            runs.append([verify_tree(**inp, mode=mode) for _ in range(20)])
        assert runs[0] == runs[1]


def test_verify_tree_root_only_samples_the_target_row() -> None:
    target = torch.tensor([[0.0, 0.0, 1.0]])
    assert verify_tree(
        torch.tensor([1]), torch.tensor([-1]), target, mode="deterministic", generator=torch.Generator()
    ) == ([], 2)


def test_verify_tree_accepts_any_real_dtype_rows() -> None:
    inp = _inputs()
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        out = verify_tree(
            inp["tokens"],
            inp["parents"],
            inp["target_probs"].to(dtype),
            inp["draft_probs"].to(dtype),
            mode="iid",
            generator=inp["generator"],
        )
        assert isinstance(out[1], int)


def _bad(**changes: object) -> dict:
    inp = _inputs()
    inp.update(changes)
    return inp


BAD_INPUTS = [
    ("mode", dict(), "nucleus", "mode must be one of"),
    ("parents0", dict(parents=torch.tensor([0, 0, 1, 2])), "iid", "parents[0] must be -1"),
    ("parent-order", dict(parents=torch.tensor([-1, 0, 3, 2])), "iid", "must precede"),
    ("shape", dict(parents=torch.tensor([-1, 0, 1])), "iid", "same non-zero length"),
    ("float-tokens", dict(tokens=torch.zeros(4)), "iid", "1-D integer tensor"),
    ("token-range", dict(tokens=torch.tensor([0, 1, 9, 2])), "iid", "outside the vocabulary"),
    ("target-rows", dict(target_probs=torch.rand(3, 5)), "iid", "expected [4,"),
    ("target-sum", dict(target_probs=torch.full((4, 5), 0.3)), "iid", "sums to 1.5"),
    ("target-nan", dict(target_probs=torch.full((4, 5), float("nan"))), "deterministic", "sums to nan"),
    ("target-neg", dict(target_probs=torch.tensor([[1.5, -0.5, 0, 0, 0]] * 4)), "deterministic", "negative"),
    ("target-1d", dict(target_probs=torch.full((5,), 0.2)), "greedy", "floating-point tensor [N, V]"),
    ("draft-missing", dict(draft_probs=None), "iid", "needs draft_probs"),
    ("draft-vocab", dict(draft_probs=torch.full((4, 6), 1 / 6)), "without_replacement", "expected [4, 5]"),
    ("draft-sum", dict(draft_probs=torch.full((4, 5), 0.1)), "iid", "draft_probs[0] sums to 0.5"),
    ("draft-zero", dict(tokens=torch.tensor([0, 1, 2, 3]), draft_probs=torch.eye(5)[:4]), "iid", "probability 0"),
    ("generator", dict(generator=None), "deterministic", "needs a torch.Generator"),
]


@pytest.mark.parametrize("name,changes,mode,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_verify_tree_rejects_bad_input(name: str, changes: dict, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        verify_tree(**_bad(**changes), mode=mode)


def test_without_replacement_rejects_duplicate_siblings_iid_allows_them() -> None:
    probs = torch.full((3, 4), 0.25)
    tokens, parents = torch.tensor([0, 2, 2]), torch.tensor([-1, 0, 0])
    with pytest.raises(ValueError, match="duplicate child tokens"):
        verify_tree(tokens, parents, probs, probs, mode="without_replacement", generator=torch.Generator())
    verify_tree(tokens, parents, probs, probs, mode="iid", generator=torch.Generator())


def test_draft_rows_of_leaves_are_not_read() -> None:
    inp = _inputs()
    draft = inp["draft_probs"].clone()
    draft[-1] = 0.0  # the chain's leaf: its children were never drawn
    verify_tree(inp["tokens"], inp["parents"], inp["target_probs"], draft, mode="iid", generator=inp["generator"])


def test_verify_tree_large_vocab_is_fast() -> None:
    n, vocab = 64, 150_000
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(n, vocab, generator=gen) * 3, dim=-1)  # [N, V]
    draft = torch.softmax(torch.randn(n, vocab, generator=gen) * 3, dim=-1)  # [N, V]
    parents = torch.tensor([-1] + [(i - 1) // 4 for i in range(1, n)])
    ranks = torch.topk(draft[parents[1:]], 4, dim=-1).indices  # [N-1, 4] distinct tokens per parent
    sibling = (torch.arange(1, n) - 1) % 4  # [N-1] rank of each node among its siblings
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), ranks[torch.arange(n - 1), sibling]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for mode in ("greedy", "deterministic", "iid", "without_replacement"):
            verify_tree(tokens, parents, target, draft, mode=mode, generator=gen)  # warm-up
            start = time.perf_counter()
            verify_tree(tokens, parents, target, draft, mode=mode, generator=gen)
            assert time.perf_counter() - start < 1.0, mode  # ~5-20 ms on one core; loose for shared CI
    finally:
        torch.set_num_threads(threads)
