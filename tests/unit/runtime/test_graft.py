"""Prompt lookup grafted onto a model drafter's tree (speculators/runtime/drafters/graft.py): the continuation follows the
tree's own children, the rest becomes one chain, siblings stay distinct, sampled chains are left alone."""

from __future__ import annotations

import pytest
import torch

from speculators.core.errors import SpeculatorsError
from speculators.core.trees import DraftTree, depths_of, path_to
from speculators.runtime.drafters.graft import NgramGraft, graft_chain


def _tree() -> DraftTree:
    # root 1 -> {2, 3}; 2 -> {4}; 3 -> {5}
    return DraftTree(tokens=torch.tensor([1, 2, 3, 4, 5]), parents=torch.tensor([-1, 0, 0, 1, 2]), mode="greedy")


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """The token path from the root to every node."""
    return {tuple(tree.tokens[path_to(tree.parents, i)].tolist()) for i in range(1, tree.size)}


def test_graft_follows_existing_children_then_appends_a_chain() -> None:
    tree = _tree()
    grafted = graft_chain(tree, [2, 4, 7, 8, 9], max_new_nodes=6)
    assert grafted.tokens.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert grafted.parents.tolist() == [-1, 0, 0, 1, 2, 3, 5, 6]
    assert _paths(grafted) == _paths(tree) | {(2, 4, 7), (2, 4, 7, 8), (2, 4, 7, 8, 9)}
    assert grafted.mode == "greedy" and depths_of(grafted.parents).tolist()[-1] == 5


def test_graft_budget_divergence_at_the_root_and_nothing_new() -> None:
    tree = _tree()
    assert graft_chain(tree, [6, 7, 8, 9], max_new_nodes=2).tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert graft_chain(tree, [2, 4], max_new_nodes=3) is tree  # already in the tree
    assert graft_chain(tree, [], max_new_nodes=3) is tree
    siblings = graft_chain(tree, [3, 9], max_new_nodes=3)
    kids = [t for t, p in zip(siblings.tokens.tolist(), siblings.parents.tolist(), strict=True) if p == 2]
    assert sorted(kids) == [5, 9]  # distinct siblings under node 2 (token 3)


class _Fixed:
    """A stand-in model drafter that proposes one fixed tree (for the wrapper's plumbing only)."""

    name, family = "fixed", "eagle3"

    def __init__(self, tree: DraftTree) -> None:
        self.tree, self.absorbed = tree, []

    def required_features(self):
        return None

    def new_state(self, max_len, device):
        return "inner"

    def absorb(self, state, features, next_tokens):
        self.absorbed.append(next_tokens.tolist())

    def propose(self, state, root_token, tree, sampling, generator):
        return self.tree


def test_wrapper_keeps_the_context_and_leaves_sampled_chains_alone() -> None:
    inner = _Fixed(_tree())
    graft = NgramGraft(inner, max_new_nodes=3)
    state = graft.new_state(64, "cpu")
    # context 9 1 2 4 6 | 9 1 : the suffix "9 1" recurs, followed by 2 4 6 9 1
    graft.absorb(state, {"input_ids": torch.tensor([9, 1, 2, 4, 6])}, torch.tensor([1, 2, 4, 6, 9]))
    graft.absorb(state, {"input_ids": torch.tensor([9])}, torch.tensor([1]))
    assert state.lookup.tokens == [9, 1, 2, 4, 6, 9, 1] and inner.absorbed == [[1, 2, 4, 6, 9], [1]]
    tree = graft.propose(state, 1, None, None, None)
    assert _paths(tree) == _paths(_tree()) | {(2, 4, 6), (2, 4, 6, 9), (2, 4, 6, 9, 1)}
    inner.tree = DraftTree.chain(1, [2, 4], mode="iid", draft_probs=torch.full((3, 10), 0.1))
    assert graft.propose(state, 1, None, None, None) is inner.tree
    with pytest.raises(SpeculatorsError, match="max_new_nodes"):
        NgramGraft(inner, max_new_nodes=0)
