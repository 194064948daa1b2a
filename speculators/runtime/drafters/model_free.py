"""The model-free drafters, behind the runtime's drafter protocol (`Drafter`, documented in load.py):
`NgramDrafter` (prompt lookup: a chain or a small tree of the continuations of earlier matches of the context's
last n-gram) and `NoDrafter` (plain decoding through the same loop: root-only trees). No models, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.trees import DraftTree, verify_mode
from speculators.models.base import FeatureRequest
from speculators.runtime.drafters.ngram import ngram_continuations, ngram_propose

if TYPE_CHECKING:
    from speculators.core.sampling import SamplingParams


@runtime_checkable
class Drafter(Protocol):
    def required_features(self) -> FeatureRequest: ...
    def new_state(self, max_len: int, device: torch.device | str) -> Any: ...
    def absorb(self, state: Any, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    def propose(self, state: Any, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree: ...


LOOKUP_DEPTH = 6  # the prompt-lookup chain's length: the n-gram drafter's default tree, and the lookup drafted alone


class NoDrafter:
    """Plain decoding through the same loop: every tree is the root alone."""

    name = "none"
    needs_token_ids = False
    samples_drafts = False

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=False)

    def new_state(self, max_len: int, device: torch.device | str) -> None:
        return None

    def absorb(self, state: Any, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        return None

    def propose(self, state: Any, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        return DraftTree.root_only(int(root_token), verify_mode(sampling))


@dataclass
class NgramState:
    tokens: list[int] = field(default_factory=list)  # the committed context, ending with the next root


class NgramDrafter:
    """Prompt lookup: a chain (kind "chain") or a small tree of the continuations of several matches."""

    name = "ngram"
    needs_token_ids = True
    samples_drafts = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        # min_ngram 2: single-token matches are mostly noise (measured on the house target: tau 1.42 vs 1.38 on
        # code completion, and fewer wasted verification nodes)
        if not 1 <= min_ngram <= max_ngram:
            raise SpeculatorsError(f"n-gram drafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: list[int], k: int) -> list[int]:
        """The chain of up to k tokens this drafter proposes after `context` (the root included): what evaluation
        scores as the n-gram baseline, so that it is the prompt lookup a server runs."""
        return ngram_propose(context, k, self.max_ngram, self.min_ngram)

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=False)

    def default_tree(self) -> TreeConfig:
        return TreeConfig(kind="chain", depth=LOOKUP_DEPTH, topk=1, budget=LOOKUP_DEPTH)

    def new_state(self, max_len: int, device: torch.device | str) -> NgramState:
        return NgramState()

    def absorb(self, state: NgramState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        if not state.tokens:
            state.tokens.extend(int(t) for t in features["input_ids"][:1].tolist())
        state.tokens.extend(int(t) for t in next_tokens.reshape(-1).tolist())

    def propose(self, state: NgramState, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        context = state.tokens or [int(root_token)]
        width = 1 if tree.kind == "chain" else max(1, tree.topk)
        conts = ngram_continuations(context, tree.depth, self.max_ngram, self.min_ngram, num=width)
        tokens, parents = [int(root_token)], [-1]
        budget = max(0, tree.budget) if tree.kind != "chain" else tree.depth
        for cont in conts:  # distinct first tokens: disjoint branches under the root
            parent = 0
            for tok in cont:
                if len(tokens) - 1 >= budget:
                    break
                tokens.append(int(tok))
                parents.append(parent)
                parent = len(tokens) - 1
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long),
                         parents=torch.tensor(parents, dtype=torch.long), mode=verify_mode(sampling))
