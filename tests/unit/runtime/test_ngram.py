"""N-gram prompt lookup: the pure proposal rule, the drafter's chains and trees, and tree pruning."""

from __future__ import annotations

import torch

from speculators.core.config import TreeConfig
from speculators.core.sampling import SamplingParams
from speculators.core.trees import DraftTree, ancestor_mask
from speculators.runtime.drafters.load import prune_tree
from speculators.runtime.drafters.model_free import NgramDrafter
from speculators.runtime.drafters.ngram import ngram_continuations, ngram_propose


def test_propose_follows_most_recent_match_of_longest_suffix() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # suffix [2, 3] (n=2) ... but n=3 first: [5, 2, 3] never occurred -> n=2: [2, 3] at 1 and 5; most recent is 5
    assert ngram_propose(context, k=3) == [8, 5, 2]
    # a longer matching suffix wins over a more recent shorter one
    context = [7, 2, 3, 4, 6, 0, 3, 5, 1, 7, 2, 3]
    assert ngram_propose(context, k=2) == [4, 6]  # [7, 2, 3] at 0, not [3] at 6
    assert ngram_propose(context, k=2, max_ngram=1) == [5, 1]  # [3] most recently at 6


def test_propose_edge_cases() -> None:
    assert ngram_propose([], k=4) == []
    assert ngram_propose([5], k=4) == []
    assert ngram_propose([1, 2, 3, 4], k=4) == []  # nothing recurs
    assert ngram_propose([1, 2, 1], k=0) == []
    assert ngram_propose([1, 2, 1], k=5) == [2, 1]  # continuation shorter than k near the end
    assert ngram_propose([4, 4, 4], k=3) == [4]  # overlapping repeats: [4, 4] at 0 -> followed by 4
    assert ngram_propose([1, 2, 9, 1, 2], k=2, min_ngram=3) == []


def test_continuations_have_distinct_first_tokens_most_recent_first() -> None:
    context = [1, 5, 1, 6, 1, 5, 1, 7, 1]
    conts = ngram_continuations(context, k=2, max_ngram=1, num=3)
    assert conts == [[7, 1], [5, 1], [6, 1]]


def _tree(drafter: NgramDrafter, context: list[int], cfg: TreeConfig, greedy: bool = True) -> DraftTree:
    state = drafter.new_state(64, "cpu")
    ids = torch.tensor(context)
    drafter.absorb(state, {"input_ids": ids[:-1]}, ids[1:])
    return drafter.propose(state, context[-1], cfg, SamplingParams(temperature=0.0 if greedy else 1.0), None)


def test_drafter_chain_and_tree_shapes_and_modes() -> None:
    drafter = NgramDrafter(max_ngram=1, min_ngram=1)
    context = [1, 5, 2, 1, 6, 3, 1]
    chain = _tree(drafter, context, TreeConfig(kind="chain", depth=2))
    assert chain.tokens.tolist() == [1, 6, 3] and chain.parents.tolist() == [-1, 0, 1] and chain.mode == "greedy"
    tree = _tree(drafter, context, TreeConfig(kind="dynamic", depth=2, topk=2, budget=3), greedy=False)
    assert tree.mode == "deterministic"
    assert tree.tokens.tolist() == [1, 6, 3, 5] and tree.parents.tolist() == [-1, 0, 1, 0]  # budget cut [5, 2]
    assert _tree(drafter, [1, 2, 3], TreeConfig(kind="chain", depth=4)).size == 1  # no match: root only


def test_prune_tree_keeps_ancestor_closed_prefix() -> None:
    #                    0   1  2  3  4  5
    tree = DraftTree(tokens=torch.tensor([9, 1, 2, 3, 4, 5]), parents=torch.tensor([-1, 0, 0, 1, 3, 2]),
                     mode="iid", draft_probs=torch.eye(6)[[1, 2, 3, 4, 5, 0]])
    by_depth = prune_tree(tree, max_depth=1, max_nodes=10)
    assert by_depth.tokens.tolist() == [9, 1, 2] and by_depth.parents.tolist() == [-1, 0, 0]
    by_count = prune_tree(tree, max_depth=5, max_nodes=4)
    assert by_count.tokens.tolist() == [9, 1, 2, 3] and by_count.parents.tolist() == [-1, 0, 0, 1]
    assert torch.equal(by_count.draft_probs, tree.draft_probs[:4])
    assert ancestor_mask(by_count.parents).sum().item() == 1 + 2 + 2 + 3
    assert prune_tree(tree, max_depth=9, max_nodes=99) is tree
