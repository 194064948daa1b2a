"""verify_tree_lazy and TargetRows: the same decisions as verify_tree on the same rows, with only the visited rows made.

- verify_tree_lazy with rows read from a table returns exactly what verify_tree returns on that table, with the
  same generator state afterwards, in every mode, on random trees (chains in block mode; sampled trees with draft
  laws that make the drafted tokens possible); it asks for each row at most once, root first; token-wise modes
  only along one root->leaf path, block / traversal modes in depth-first pre-order (a node after its parent).
- TargetRows makes the same rows as one product over every node, in first-child-chain blocks: the root's block
  is the root and its first-child chain; a node off that chain gets its own block; no row is made twice.
- Bad trees and modes fail as in verify_tree.
"""

from __future__ import annotations

import pytest
import torch

from speculators.core.trees import path_to
from speculators.runtime.forward.target_rows import TargetRows
from speculators.runtime.verify.lossless import verify_tree, verify_tree_lazy

VOCAB = 12


def _random_tree(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, VOCAB, (n,), generator=gen)
    return tokens, torch.tensor(parents)


def _distinct_siblings(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Re-label children so that siblings carry distinct tokens (without_replacement needs it)."""
    out = tokens.clone()
    used: dict[int, set[int]] = {}
    for i, p in enumerate(parents.tolist()[1:], 1):
        taken = used.setdefault(p, set())
        tok = int(out[i])
        while tok in taken:
            tok = (tok + 1) % VOCAB
        taken.add(tok)
        out[i] = tok
    return out


def _rows(gen: torch.Generator, n: int, peaked: torch.Tensor | None = None) -> torch.Tensor:
    logits = torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) * 2
    if peaked is not None:  # make the drafted tokens likely, so that paths get accepted
        logits[torch.arange(n), peaked] += 4
    return torch.softmax(logits, dim=-1)  # [N, V]


SAMPLED = ("iid", "without_replacement", "block", "traversal", "traversal_iid")


@pytest.mark.parametrize("mode", ["greedy", "deterministic", *SAMPLED])
def test_lazy_equals_verify_tree_and_reads_only_the_walked_path(mode: str) -> None:
    gen = torch.Generator().manual_seed(5)
    longest = 0
    for trial in range(60):
        n = 1 + trial % 9
        tokens, parents = _random_tree(gen, n)
        if mode == "block":
            parents = torch.arange(-1, n - 1)
        if mode in ("without_replacement", "traversal"):
            tokens = _distinct_siblings(tokens, parents)
        first_child = torch.zeros(n, dtype=torch.long)  # each node's first child's token (its own if a leaf)
        for i in range(n - 1, 0, -1):
            first_child[int(parents[i])] = tokens[i]
        target = _rows(gen, n, first_child)  # [N, V]
        draft = _rows(gen, n) * 0.5 + 0.5 / VOCAB if mode in SAMPLED else None
        if mode == "greedy" and trial % 2:  # argmax rows that follow the tree's first children
            target = torch.nn.functional.one_hot(first_child, VOCAB).double()
        seed = 1000 + trial
        want = verify_tree(tokens, parents, target, draft, mode=mode,
                           generator=torch.Generator().manual_seed(seed))
        asked: list[int] = []

        def row(i: int, asked: list[int] = asked, target: torch.Tensor = target) -> torch.Tensor:
            asked.append(i)
            return target[i]

        g = torch.Generator().manual_seed(seed)
        got = verify_tree_lazy(tokens, parents, row, draft, vocab_size=VOCAB, mode=mode, generator=g)
        assert got == want
        ref = torch.Generator().manual_seed(seed)
        verify_tree(tokens, parents, target, draft, mode=mode, generator=ref)
        assert torch.equal(g.get_state(), ref.get_state()), "the lazy walk drew a different number of randoms"
        accepted, _ = got
        last = accepted[-1] if accepted else 0
        if mode in ("block", "traversal", "traversal_iid"):
            assert asked[0] == 0 and len(set(asked)) == len(asked), asked
            assert all(asked.index(int(parents[i])) < k for k, i in enumerate(asked) if i > 0), asked
            assert set(accepted) <= set(asked), (asked, accepted)
        else:
            assert asked == [0, *accepted], f"rows read {asked}, walk {accepted}"
            assert asked == [0, *path_to(parents, last)]
        longest = max(longest, len(accepted))
    assert longest >= 3, "no trial accepted a path: the test would prove little"


def test_lazy_rejects_what_verify_tree_rejects() -> None:
    tokens, parents = torch.tensor([1, 2]), torch.tensor([-1, 0])

    def row(i: int) -> torch.Tensor:
        return torch.full((VOCAB,), 1.0 / VOCAB)

    with pytest.raises(ValueError, match="mode must be one of"):
        verify_tree_lazy(tokens, parents, row, vocab_size=VOCAB, mode="typical", generator=None)
    with pytest.raises(ValueError, match="needs a torch.Generator"):
        verify_tree_lazy(tokens, parents, row, vocab_size=VOCAB, mode="deterministic", generator=None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_tree_lazy(torch.tensor([1, VOCAB]), parents, row, vocab_size=VOCAB, mode="greedy", generator=None)
    with pytest.raises(ValueError, match="needs draft_probs"):
        verify_tree_lazy(tokens, parents, row, vocab_size=VOCAB, mode="iid", generator=torch.Generator())
    with pytest.raises(ValueError, match="every parent must precede"):
        verify_tree_lazy(tokens, torch.tensor([-1, 1]), row, vocab_size=VOCAB, mode="greedy", generator=None)


def test_target_rows_make_first_child_chains_once() -> None:
    # 0 -> 1 -> 3 -> 5 (the first-child chain), 0 -> 2 -> 4, 1 -> 6
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 1])
    hidden = torch.randn(7, 5)  # [N, H]
    weight = torch.randn(VOCAB, 5)
    products: list[list[int]] = []

    def head(rows: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        products.append([int(torch.nonzero((hidden == r).all(-1))[0]) for r in rows])
        return rows @ weight.t()

    def law(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1)

    rows = TargetRows(hidden, parents, head, law)
    every = law(hidden @ weight.t())  # [N, V]: the rows made all at once
    assert torch.allclose(rows(3), every[3])  # asking inside a chain makes the chain from there
    assert products == [[3, 5]]
    assert torch.allclose(rows(0), every[0])
    assert products[-1] == [0, 1]  # stops at rows already made
    assert torch.allclose(rows(5), every[5]) and len(products) == 2  # made already: no product
    assert torch.allclose(rows(2), every[2])
    assert products[-1] == [2, 4]
    assert torch.allclose(rows(6), every[6]) and products[-1] == [6]
    assert rows.made == 7 and rows.products == 4


def test_target_rows_cover_a_chain_in_one_product() -> None:
    parents = torch.arange(-1, 5)  # a chain of 6 nodes
    hidden = torch.randn(6, 4)
    calls: list[int] = []

    def head(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ torch.ones(4, VOCAB)

    rows = TargetRows(hidden, parents, head, lambda x: torch.softmax(x, -1))
    for i in range(6):
        rows(i)
    assert calls == [6] and rows.products == 1
