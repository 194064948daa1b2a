"""Prompt lookup grafted onto a model drafter's tree: code and quoted text repeat their context, and a model
drafter's tree is only a few levels deep, so the continuation of the context's last n-gram is added as one more
branch.

`NgramGraft(drafter, max_new_nodes)` is itself a drafter (the `drafters.Drafter` protocol; `drafters.load_drafter`
wraps a speculator in it). Each proposal is the model drafter's tree plus the prompt-lookup continuation (the
`drafters.NgramDrafter`'s context and lookup rule: `ngram.ngram_continuations`, longest recurring suffix, most recent
match) walked from the root: while its tokens are already children in the tree the walk follows them, and
from the first token that is not, the rest of the continuation (at most `max_new_nodes` tokens) is appended as a
chain. Siblings therefore stay distinct and parents precede children, so the tree is verified like any other:
"greedy" at T = 0 and "deterministic" for top-k trees at T > 0 (the grafted tokens are deterministic proposals, as
the n-gram drafter's are). Sampled drafts (chains and sampled trees: every node's children carry the law they were
drawn from, `trees.SAMPLED_MODES`) are left as they are. The graft never changes the output's distribution, only how many tokens a cycle may commit.

Not here: the model drafter's own tree policy (models/drafting.py), the lookup rule (ngram.py), the n-gram
drafter's context bookkeeping (drafters.NgramDrafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from speculators.core.config import DEFAULT_NGRAM_GRAFT
from speculators.core.errors import SpeculatorsError
from speculators.core.trees import SAMPLED_MODES, DraftTree
from speculators.runtime.drafters.model_free import NgramDrafter, NgramState
from speculators.runtime.drafters.ngram import ngram_continuations

if TYPE_CHECKING:
    from speculators.core.config import TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.models.base import FeatureRequest


@dataclass
class GraftState:
    inner: Any  # the model drafter's own state
    lookup: NgramState  # the committed context, ending with the next root


def graft_chain(tree: DraftTree, continuation: list[int], max_new_nodes: int) -> DraftTree:
    """`tree` with `continuation` (tokens following the root) walked from the root and its unmatched rest appended
    as a chain of at most `max_new_nodes` nodes."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], {}).setdefault(tokens[i], i)
    node, added = 0, 0
    for tok in continuation:
        nxt = children.get(node, {}).get(int(tok))
        if nxt is None:
            if added >= max_new_nodes:
                break
            tokens.append(int(tok))
            parents.append(node)
            nxt = len(tokens) - 1
            children.setdefault(node, {})[int(tok)] = nxt
            added += 1
        node = nxt
    if added == 0:
        return tree
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=tree.tokens.device),
                     parents=torch.tensor(parents, dtype=torch.long), mode=tree.mode)


class NgramGraft:
    """A model drafter whose trees also carry the prompt-lookup continuation (see the module docstring)."""

    needs_token_ids = True

    def __init__(self, drafter: Any, max_new_nodes: int = DEFAULT_NGRAM_GRAFT, lookup: NgramDrafter | None = None
                 ) -> None:
        if max_new_nodes < 1:
            raise SpeculatorsError(f"n-gram graft needs max_new_nodes >= 1, got {max_new_nodes}")
        self.drafter, self.max_new_nodes = drafter, max_new_nodes
        self.lookup = lookup or NgramDrafter()
        self.name = f"{getattr(drafter, 'name', type(drafter).__name__)}+ngram"
        self.family = getattr(drafter, "family", "?")
        self.samples_drafts = bool(getattr(drafter, "samples_drafts", False))  # sampled drafts pass ungrafted

    def required_features(self) -> FeatureRequest:
        return self.drafter.required_features()

    def default_tree(self) -> TreeConfig | None:
        own = getattr(self.drafter, "default_tree", None)
        return own() if callable(own) else None

    def new_state(self, max_len: int, device: torch.device | str) -> GraftState:
        return GraftState(self.drafter.new_state(max_len, device), self.lookup.new_state(max_len, device))

    def absorb(self, state: GraftState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        self.drafter.absorb(state.inner, features, next_tokens)
        self.lookup.absorb(state.lookup, features, next_tokens)

    def propose(self, state: GraftState, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        drafted = self.drafter.propose(state.inner, root_token, tree, sampling, generator)
        context = state.lookup.tokens
        if drafted.mode in SAMPLED_MODES or not context:
            return drafted
        found = ngram_continuations(context, drafted.max_depth + self.max_new_nodes, self.lookup.max_ngram,
                                    self.lookup.min_ngram, num=1)
        return graft_chain(drafted, found[0], self.max_new_nodes) if found else drafted
