"""The verify_tree API contract and the torch backend of the verification core.

- TorchRowOps does the reference arithmetic (verify_harness.RefOps) in float64; TorchRandomness never accepts a
  zero-probability token.
- verify_tree: what each mode returns on hand-made inputs, reproducibility with a seed, every dtype, one clear
  ValueError per malformed input, and cost at a real vocabulary size (a ratio against a softmax over the same
  rows, timed in the same test).
"""

from __future__ import annotations

import time

import pytest
import torch
from verify_harness import REF_OPS

from speculators.runtime.verify.lossless import (
    TorchRandomness,
    TorchRowOps,
    chain_parents,
    remove_token,
    residual,
    verify_tree,
)


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
    for mode in ("deterministic", "iid", "without_replacement", "traversal", "traversal_iid"):
        got = verify_tree(tokens, parents, target, uniform, mode=mode, generator=torch.Generator().manual_seed(1))
        assert got == ([2, 3], 1)
    chain = torch.tensor([-1, 0, 1, 2])
    got = verify_tree(torch.tensor([0, 2, 0, 3]), chain, target, uniform, mode="block", generator=torch.Generator())
    assert got == ([1, 2], 4)  # nodes 1, 2 carry the argmax of their parents' rows, node 3 does not


def test_verify_tree_greedy_skips_duplicate_children() -> None:
    eye = torch.eye(3)
    target = torch.stack([eye[1], eye[2], eye[0]])  # node 1 (first tok 1) says 2, node 2 (dup) says 0
    got = verify_tree(torch.tensor([0, 1, 1]), torch.tensor([-1, 0, 0]), target, mode="greedy", generator=None)
    assert got == ([1], 2)


def test_verify_tree_is_reproducible_with_a_seed() -> None:
    for mode in ("deterministic", "iid", "without_replacement", "traversal", "traversal_iid"):
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


# dyadic rows: every probability is exact in bfloat16 and float16, so each dtype must verify exactly as float64 does
DYADIC_TARGET = torch.tensor([[0.5, 0.25, 0.125, 0.125, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0],
                              [0.0, 0.5, 0.5, 0.0, 0.0], [0.125, 0.125, 0.25, 0.5, 0.0]])  # [4, 5]
DYADIC_DRAFT = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0],
                             [0.0, 0.25, 0.25, 0.5, 0.0], [0.5, 0.0, 0.0, 0.0, 0.5]])  # [4, 5]


def test_verify_tree_accepts_any_real_dtype_rows() -> None:
    tokens, parents = torch.tensor([0, 1, 2, 3]), chain_parents(4)
    for mode in ("deterministic", "iid", "block"):
        reference = [verify_tree(tokens, parents, DYADIC_TARGET.double(), DYADIC_DRAFT.double(), mode=mode,
                                 generator=torch.Generator().manual_seed(seed)) for seed in range(12)]
        for accepted, token in reference:
            assert accepted == list(range(1, len(accepted) + 1)) and len(accepted) <= 2, (mode, accepted)  # node 3's
            assert 0 <= token < 4, (mode, token)  # token has p_T = 0 in row 2; token 4 has p_T = 0 everywhere
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = [verify_tree(tokens, parents, DYADIC_TARGET.to(dtype), DYADIC_DRAFT.to(dtype), mode=mode,
                               generator=torch.Generator().manual_seed(seed)) for seed in range(12)]
            assert got == reference, (mode, dtype)
    # the deterministic mode's outcome depends on the draw: the seeds above are not all alike
    outcomes = {str(verify_tree(tokens, parents, DYADIC_TARGET, DYADIC_DRAFT, mode="deterministic",
                                generator=torch.Generator().manual_seed(seed))) for seed in range(12)}
    assert len(outcomes) > 2, outcomes


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
    ("block-tree", dict(parents=torch.tensor([-1, 0, 0, 1])), "block", "verifies a chain, but node 0 has 2"),
    ("block-draft-missing", dict(draft_probs=None), "block", "needs draft_probs"),
    ("traversal-draft-zero", dict(tokens=torch.tensor([0, 1, 2, 3]), draft_probs=torch.eye(5)[:4]), "traversal",
     "probability 0"),
    ("traversal-iid-generator", dict(generator=None), "traversal_iid", "needs a torch.Generator"),
]


@pytest.mark.parametrize("name,changes,mode,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_verify_tree_rejects_bad_input(name: str, changes: dict, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        verify_tree(**_bad(**changes), mode=mode)


def test_without_replacement_rejects_duplicate_siblings_iid_allows_them() -> None:
    probs = torch.full((3, 4), 0.25)
    tokens, parents = torch.tensor([0, 2, 2]), torch.tensor([-1, 0, 0])
    for mode in ("without_replacement", "traversal"):
        with pytest.raises(ValueError, match=f"duplicate child tokens.*{mode} drafts are distinct"):
            verify_tree(tokens, parents, probs, probs, mode=mode, generator=torch.Generator())
    for mode in ("iid", "traversal_iid"):
        # draft law = target law: the first child (token 2) is always accepted, then the bonus token is drawn from
        # node 1's uniform row
        got = [verify_tree(tokens, parents, probs, probs, mode=mode, generator=torch.Generator().manual_seed(seed))
               for seed in range(40)]
        assert {tuple(accepted) for accepted, _ in got} == {(1,)}, (mode, got)
        assert {token for _, token in got} == {0, 1, 2, 3}, (mode, got)


def test_draft_rows_of_leaves_are_not_read() -> None:
    inp = _inputs()
    draft = inp["draft_probs"].clone()
    draft[-1] = 0.0  # the chain's leaf: its children were never drawn
    for seed in range(10):
        args = (inp["tokens"], inp["parents"], inp["target_probs"])
        with_leaf = verify_tree(*args, inp["draft_probs"], mode="iid", generator=torch.Generator().manual_seed(seed))
        zeroed = verify_tree(*args, draft, mode="iid", generator=torch.Generator().manual_seed(seed))
        assert zeroed == with_leaf, seed


def _fastest(fn, repeats: int = 3) -> float:
    """The least disturbed of `repeats` timed calls (seconds)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_verify_tree_large_vocab_costs_a_few_passes_over_its_rows() -> None:
    """At a real vocabulary size, verifying a 64-node tree costs about as much as one softmax over the [N, V] target
    rows (1-2x measured on one core): no mode does per-node work over the whole [N, V] tensor (that would be ~64x).
    The bound is a ratio against that softmax, timed in the same process, so a slow or shared runner moves both."""
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
        chain = torch.arange(-1, n - 1)  # the same nodes as one chain (block mode)
        for mode in ("greedy", "deterministic", "iid", "without_replacement", "traversal", "traversal_iid", "block"):
            shape = chain if mode == "block" else parents
            verify_tree(tokens, shape, target, draft, mode=mode, generator=gen)  # warm-up
            softmax = _fastest(lambda: torch.softmax(target, dim=-1))
            verify = _fastest(lambda: verify_tree(tokens, shape, target, draft, mode=mode, generator=gen))  # noqa: B023
            assert verify < 10 * softmax, (mode, verify, softmax)
    finally:
        torch.set_num_threads(threads)
