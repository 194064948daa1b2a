"""Exact proofs that every plan of the plan controller (runtime/adaptive.py) is lossless, and switching between them.

Each speculative step drafts by the plan a function of the committed context picks (as the controller's choice
depends only on earlier cycles and the context): plain decoding (the root alone), prompt lookup alone (the runtime's
`ngram_continuations` over prompt + context, as a chain), the model drafter's top-k tree, and that tree with the
lookup grafted on by the runtime's own `graft_chain`. The real `walk_tree` verifies each tree (rational arithmetic,
every coin enumerated: verify_harness); the law of the first tokens the loop commits must equal the target's exactly,
at T > 0 ("deterministic": the lookup's and the grafted tokens are deterministic proposals) and at T = 0 ("greedy"
on one-hot targets). A broken graft that credits the lookup's tokens without verifying them is caught.
"""

from __future__ import annotations

import pytest
import torch
from verify_harness import REF_OPS, Ctx, LoopLaw, ToyTables, enumerate_law, truth_law

from speculators.core.trees import DraftTree
from speculators.runtime.adaptive import Plan
from speculators.runtime.drafters.graft import graft_chain
from speculators.runtime.drafters.ngram import ngram_continuations
from speculators.runtime.verify.lossless import Tree, walk_tree

PROMPT = (0, 1, 2, 0, 1, 2, 0)  # a context whose suffixes recur: the lookup proposes in most steps
PLANS = (Plan(), Plan("", 0, 2), Plan("dynamic", 2), Plan("dynamic", 2, 2))
MODEL_SHAPE = (-1, 0, 0, 1)  # the model's top-k tree: two children of the root, one grandchild
N_TOKENS = 3


def plan_for(ctx: Ctx) -> Plan:
    """The plan of the step from `ctx`: a deterministic function of the context, so every plan meets every other."""
    return PLANS[(len(ctx) + sum(ctx)) % len(PLANS)]


def lookup(ctx: Ctx, k: int) -> list[int]:
    found = ngram_continuations(list(PROMPT + ctx), k, max_ngram=2, min_ngram=1, num=1)
    return found[0] if found else []


def model_tree(tables: ToyTables, ctx: Ctx, root: int) -> tuple[list[int], list[int]]:
    """The top-k tree of `MODEL_SHAPE` under the draft law q (child j of a node: q's rank-j token, ties: lower id)."""
    tokens, parents, contexts, rank = [root], [-1], [ctx], {}
    for i in range(1, len(MODEL_SHAPE)):
        parent = MODEL_SHAPE[i]
        q = tables.q(contexts[parent])
        j = rank.get(parent, 0)
        rank[parent] = j + 1
        tok = sorted(range(tables.vocab), key=lambda t: (-q[t], t))[j]
        tokens.append(tok)
        parents.append(parent)
        contexts.append(contexts[parent] + (tok,))
    return tokens, parents


def plan_tree(tables: ToyTables, ctx: Ctx) -> DraftTree:
    """The tree the engine's `draft_tree` builds for the plan of `ctx`."""
    plan, root = plan_for(ctx), ctx[-1] if ctx else PROMPT[-1]
    continuation = lookup(ctx, plan.depth + plan.lookup if plan.depth else plan.lookup)
    if plan.depth == 0:
        drafts = continuation[:plan.lookup]
        return DraftTree.chain(root, drafts, "deterministic") if drafts else DraftTree.root_only(root, "deterministic")
    tokens, parents = model_tree(tables, ctx, root)
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), mode="deterministic")
    return graft_chain(tree, continuation, plan.lookup) if plan.lookup and continuation else tree


def plan_step(tables: ToyTables, mode: str, ctx: Ctx, rng, skip_verify: bool = False) -> tuple[Ctx, int]:
    tree = plan_tree(tables, ctx)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    contexts = [ctx]
    for i in range(1, len(tokens)):
        contexts.append(contexts[parents[i]] + (tokens[i],))
    if skip_verify and len(tokens) > 1:  # broken: the lookup's chain is committed as if it were verified
        return tuple(tokens[1:]) + (0,), len(tokens) - 1
    accepted, nxt = walk_tree(Tree.from_parents(tuple(tokens), tuple(parents)), mode=mode,
                              target_row=lambda i: tables.p(contexts[i]), draft_row=lambda i: tables.q(contexts[i]),
                              ops=REF_OPS, rng=rng)
    return tuple(tokens[i] for i in accepted) + (nxt,), len(accepted)


class PlanLoopLaw(LoopLaw):
    """`LoopLaw` whose steps draft by `plan_for(ctx)` instead of one fixed spec."""

    def __init__(self, tables: ToyTables, mode: str, broken: bool = False) -> None:
        super().__init__(tables, spec=None, mode=mode)
        self.broken = broken

    def step(self, ctx: Ctx = ()) -> dict:
        if ctx not in self._steps:
            self._steps[ctx] = enumerate_law(lambda rng: plan_step(self.tables, self.mode, ctx, rng, self.broken))
        return self._steps[ctx]


@pytest.mark.parametrize("mode,vocab,seed,flavor", [("deterministic", 3, 1, "generic"),
                                                    ("deterministic", 4, 2, "p_zero"),
                                                    ("deterministic", 3, 3, "filtered"),
                                                    ("deterministic", 3, 4, "q_near_p"),
                                                    ("greedy", 3, 5, "onehot")])
def test_switching_plans_is_lossless_exactly(mode: str, vocab: int, seed: int, flavor: str) -> None:
    tables = ToyTables(vocab, seed, flavor)
    loop = PlanLoopLaw(tables, mode)
    assert loop.first_tokens(N_TOKENS) == truth_law(tables, N_TOKENS)
    assert loop.within_step_mismatches() == []
    if flavor == "onehot":  # one path only: not every plan is met on it
        return
    # every plan drafted somewhere on the way, and the lookup's nodes really were grafted and verified
    reached = list(loop._steps)
    assert {plan_for(ctx).source for ctx in reached} == {"plain", "lookup", "model", "model+lookup"}
    grafted = [ctx for ctx in reached if plan_for(ctx).source == "model+lookup"
               and plan_tree(tables, ctx).size > len(MODEL_SHAPE)]
    assert grafted


def test_a_lookup_committed_without_verification_is_caught() -> None:
    tables = ToyTables(3, 1, "generic")
    assert PlanLoopLaw(tables, "deterministic", broken=True).first_tokens(N_TOKENS) != truth_law(tables, N_TOKENS)
