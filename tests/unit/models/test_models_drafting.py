"""Runtime drafting: tree validity, EAGLE-2 selection, best-first (DDTree) selection, chains vs the training path,
d2t, draft KV isolation."""

from __future__ import annotations

import itertools
import math
import typing

import pytest
import torch
from models_helpers import (
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    reduced_vocab,
    target_features,
)

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams, logits_to_probs
from speculators.core.trees import depths_of
from speculators.models.drafting import (
    TREE_KINDS,
    build_best_first_tree,
    build_dynamic_tree,
    build_sampled_tree,
    propose_tree,
    sampled_tree_widths,
    to_target_logits,
    tree_verify_mode,
)
from speculators.models.steppers import MarginalStepper
from speculators.runtime.verify.lossless import verify_tree

GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)


def _absorbed(family, t=12, seed=0, d2t=None, num_steps=4, max_len=96, **kw):
    """A randomised speculator whose state has absorbed positions 0..t-2 of a random sequence; root = ids[t-1]."""
    model, _, target = build(family, num_steps=num_steps, d2t=d2t, **kw)
    randomize(model, seed=seed)
    ids = torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))
    feats = target_features(target, ids, getattr(model, "layer_ids", None))
    state = model.new_state(max_len, "cpu")
    model.absorb(state, {k: v[0, : t - 1] for k, v in feats.items()}, ids[0, 1:t])
    return model, state, ids, feats


def _check_tree(tree, cfg, allowed_tokens=None):
    n = tree.size
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))
    assert n - 1 <= cfg.budget
    assert int(depths_of(tree.parents).max()) <= cfg.depth
    toks = tree.tokens.tolist()
    assert all(0 <= x < VOCAB for x in toks)
    siblings = {}
    for i in range(1, n):
        siblings.setdefault(parents[i], []).append(toks[i])
        if allowed_tokens is not None:
            assert toks[i] in allowed_tokens
    if tree.mode in ("greedy", "deterministic", "traversal", "without_replacement"):
        assert all(len(s) == len(set(s)) for s in siblings.values()), "duplicate sibling tokens"


@pytest.mark.parametrize("family", ["eagle3", "mtp", "medusa"])
@pytest.mark.parametrize("cfg", [TreeConfig(kind="dynamic", depth=4, topk=3, budget=10),
                                 TreeConfig(kind="dynamic", depth=6, topk=4, budget=25),
                                 TreeConfig(kind="dynamic", depth=2, topk=8, budget=5),
                                 TreeConfig(kind="static", depth=3, budget=12),
                                 TreeConfig(kind="chain", depth=5, budget=5),
                                 TreeConfig(kind="sampled", depth=4, topk=3, budget=8)])
def test_trees_are_valid(family, cfg):
    d2t, ids = reduced_vocab(VOCAB, 50) if family == "eagle3" else (None, None)
    model, state, seq, _ = _absorbed(family, d2t=d2t)
    allowed = set(ids.tolist()) if ids is not None else None
    warm_mode = {"chain": "block", "sampled": "traversal"}.get(cfg.kind, "deterministic")
    for sampling, mode in ((GREEDY, "greedy"), (WARM, warm_mode)):
        tree = model.propose(state, int(seq[0, -1]), cfg, sampling, torch.Generator().manual_seed(0))
        assert tree.mode == mode and int(tree.tokens[0]) == int(seq[0, -1])
        _check_tree(tree, cfg, allowed)
        assert tree.size > 1
        if cfg.kind == "dynamic" and family != "medusa":
            assert tree.size - 1 == cfg.budget  # random drafts always fill the budget
    assert state.length == seq.shape[1] - 1  # propose commits nothing


class _FakeStepper:
    """Path-dependent pseudo-random draft laws (no model): lets the tree builder be checked against a reference."""

    max_depth = 1 << 20
    room = 1 << 20

    def __init__(self, vocab=40, seed=0):
        self.vocab, self.seed = vocab, seed
        self.paths = {-1: ()}
        self.calls = []

    def law(self, path):
        g = torch.Generator().manual_seed(hash((self.seed, path)) % (1 << 31))
        return torch.randn(self.vocab, generator=g) * 3

    def root_logits(self):
        return self.law(())

    def step(self, nodes, tokens, parents, depth):
        self.calls.append(len(nodes))
        for n, t, p in zip(nodes, tokens.tolist(), parents, strict=False):
            self.paths[n] = self.paths[p] + (t,)
        return torch.stack([self.law(self.paths[n]) for n in nodes])


def _reference_eagle2(stepper, depth, topk, budget):
    """EAGLE-2 without any pruning: expand the global top-k frontier at every level, rerank everything."""
    cands = []  # (path, score)
    lp = torch.log_softmax(stepper.root_logits(), -1)
    s, i = torch.topk(lp, topk)
    frontier = []
    for sc, tok in zip(s.tolist(), i.tolist(), strict=False):
        frontier.append(len(cands))
        cands.append(((tok,), sc))
    for _ in range(1, depth):
        new = []
        for f in sorted(frontier):
            path, score = cands[f]
            lp = torch.log_softmax(stepper.law(path), -1) + score
            s, i = torch.topk(lp, topk)
            for sc, tok in zip(s.tolist(), i.tolist(), strict=False):
                new.append(len(cands))
                cands.append((path + (tok,), sc))
        best = sorted(new, key=lambda c: (-cands[c][1], c))[:topk]
        frontier = best
    chosen = sorted(range(len(cands)), key=lambda c: (-cands[c][1], c))[:budget]
    return {cands[c][0] for c in chosen}


def _paths(tree):
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("depth,topk,budget", [(3, 2, 5), (4, 3, 10), (6, 4, 12), (5, 5, 60), (7, 2, 3)])
def test_dynamic_tree_equals_reference_eagle2(depth, topk, budget):
    for seed in range(3):
        stepper = _FakeStepper(seed=seed)
        tree = build_dynamic_tree(stepper, 999, depth, topk, budget, torch.arange(40), "deterministic")
        assert _paths(tree) == _reference_eagle2(_FakeStepper(seed=seed), depth, topk, budget)
        assert len(stepper.calls) <= depth - 1 and all(c <= topk for c in stepper.calls)  # one forward per level


def test_dynamic_tree_skips_levels_that_cannot_enter_the_budget():
    stepper = _FakeStepper(seed=1)
    build_dynamic_tree(stepper, 0, 8, 4, 3, torch.arange(40), "greedy")
    assert sum(stepper.calls) < 7 * 4


def _reference_best_first(laws, depth, budget):
    """Brute force: every prefix (draft ids) of depth <= `depth`, scored by the sum of its per-depth log-probs (the
    product of marginals); -> (the best `budget` finite ones, the score of every prefix)."""
    lp = torch.log_softmax(laws.float(), -1).tolist()  # the builder's precision: identical sums
    prefixes = [p for d in range(1, depth + 1) for p in itertools.product(range(laws.shape[-1]), repeat=d)]
    score = {p: sum(lp[d][t] for d, t in enumerate(p)) for p in prefixes}
    finite = [p for p in prefixes if score[p] > -math.inf]
    return sorted(finite, key=lambda p: -score[p])[:budget], score


@pytest.mark.parametrize("depth,budget,vd", [(1, 4, 6), (3, 5, 6), (4, 12, 5), (4, 40, 4), (5, 3, 7), (3, 200, 4)])
def test_best_first_tree_is_the_top_budget_prefixes(depth, budget, vd):
    """best_first = the `budget` best prefixes by product of the per-depth marginals (brute force), as target ids of a
    reduced vocab; ancestor-closed with distinct siblings, nodes in score order, so the first m nodes are the tree of
    budget m (what `prune_tree` keeps)."""
    _, kept = reduced_vocab(VOCAB, vd, seed=vd)
    draft_of = {t: i for i, t in enumerate(kept.tolist())}
    cfg = TreeConfig(kind="best_first", depth=depth, budget=budget)
    for seed in range(4):
        laws = torch.randn(depth + 2, vd, generator=torch.Generator().manual_seed(seed)) * 2  # [K, Vd]
        tree = build_best_first_tree(MarginalStepper(laws), 7, depth, budget, kept, "deterministic")
        best, score = _reference_best_first(laws, depth, budget)
        assert _paths(tree) == {tuple(kept[list(p)].tolist()) for p in best}
        assert tree.size - 1 == min(budget, len(score)) and tree.mode == "deterministic" and tree.draft_probs is None
        _check_tree(tree, cfg, set(kept.tolist()))
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()
        path = [()]
        for i in range(1, tree.size):
            path.append(path[parents[i]] + (draft_of[toks[i]],))
        scores = [score[p] for p in path[1:]]
        assert scores == sorted(scores, reverse=True)
        half = build_best_first_tree(MarginalStepper(laws), 7, depth, max(1, budget // 2), kept, "deterministic")
        assert half.tokens.tolist() == toks[: half.size] and half.parents.tolist() == parents[: half.size]


def test_best_first_tree_skips_tokens_the_draft_cannot_produce():
    """-inf entries (outside a filtered law) and non-finite laws start no node; the stepper's depth caps the tree."""
    laws = torch.full((2, 6), float("-inf"))  # [K, Vd]
    laws[0, 1], laws[0, 4], laws[1, 2] = 0.0, 1.0, 0.0
    tree = build_best_first_tree(MarginalStepper(laws), 5, 4, 20, torch.arange(6) + 10, "greedy")
    assert tree.tokens.tolist() == [5, 14, 12, 11, 12] and tree.parents.tolist() == [-1, 0, 1, 0, 3]
    laws[1] = float("nan")  # an overflowed law: its depth holds nothing
    d2t = torch.arange(6)
    assert build_best_first_tree(MarginalStepper(laws), 5, 4, 20, d2t, "greedy").tokens.tolist() == [5, 4, 1]
    assert build_best_first_tree(MarginalStepper(laws[1:]), 5, 4, 20, d2t, "greedy").size == 1


def test_best_first_verify_modes_and_refusals():
    """Verified "greedy" at T=0 and "deterministic" at T>0 (either `verify` setting), never with draft_probs; a
    stepper that drafts each node from its path is refused in one line, and so is a sampled verify mode."""
    laws = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))  # [K, V]
    for sampling, verify, mode in ((GREEDY, "sequence", "greedy"), (WARM, "sequence", "deterministic"),
                                   (WARM, "token", "deterministic")):
        assert tree_verify_mode("best_first", sampling, verify) == mode
        cfg = TreeConfig(kind="best_first", depth=3, budget=8, verify=verify)
        tree = propose_tree(MarginalStepper(laws), 7, cfg, sampling, torch.Generator().manual_seed(0),
                            torch.arange(VOCAB), VOCAB)
        assert tree.mode == mode and tree.draft_probs is None and tree.size == 9
        target = torch.softmax(torch.randn(tree.size, VOCAB), -1)  # [N, V]
        verify_tree(tree.tokens, tree.parents, target, None, mode=mode, generator=torch.Generator().manual_seed(1))
    with pytest.raises(SpeculatorsError, match="path") as err:
        build_best_first_tree(_FakeStepper(), 0, 3, 8, torch.arange(40), "deterministic")
    assert "\n" not in str(err.value)
    with pytest.raises(SpeculatorsError, match="draft_probs"):
        build_best_first_tree(MarginalStepper(laws), 0, 3, 8, torch.arange(VOCAB), "block")
    assert TREE_KINDS == typing.get_args(typing.get_type_hints(TreeConfig)["kind"])


@pytest.mark.parametrize("family", ["eagle3", "mtp", "medusa", "dflash"])
def test_best_first_trees_of_the_speculators(family):
    """Medusa's heads and DFlash's block give every node at a depth the same law: their best_first trees are valid
    top-k trees; EAGLE-3 and MTP draft each node from its path and are refused in one line."""
    model, state, seq, _ = _absorbed(family)
    cfg = TreeConfig(kind="best_first", depth=3, budget=10)
    if family in ("eagle3", "mtp"):
        with pytest.raises(SpeculatorsError, match="best_first") as err:
            model.propose(state, int(seq[0, -1]), cfg, GREEDY, None)
        assert "\n" not in str(err.value)
        return
    for sampling, mode in ((GREEDY, "greedy"), (WARM, "deterministic")):
        tree = model.propose(state, int(seq[0, -1]), cfg, sampling, torch.Generator().manual_seed(0))
        assert tree.mode == mode and tree.draft_probs is None and int(tree.tokens[0]) == int(seq[0, -1])
        assert tree.size - 1 == cfg.budget
        _check_tree(tree, cfg)


@pytest.mark.parametrize("family", ["eagle3", "mtp", "medusa"])
def test_greedy_chain_equals_argmax_of_the_training_path(family):
    """Greedy drafts fed back as teacher-forced tokens through forward_train reproduce themselves."""
    d2t, _ = reduced_vocab(VOCAB, 60) if family == "eagle3" else (None, None)
    model, state, ids, feats = _absorbed(family, t=10, d2t=d2t, num_steps=4)
    tree = model.propose(state, int(ids[0, -1]), TreeConfig(kind="chain", depth=4, budget=4), GREEDY, None)
    drafts = tree.tokens[1:]
    assert tree.mode == "greedy" and drafts.numel() == 4
    seq = torch.cat([ids[0], drafts])[None]  # x_0..x_9, then the drafts
    batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq)}
    for key, v in feats.items():
        batch[key] = torch.cat([v, torch.zeros(1, 4, v.shape[-1])], 1)  # features beyond t=8 are never read
    with torch.no_grad():
        train = model.forward_train(batch)
    m = model.draft_to_target
    for k in range(4):
        assert int(m[train[k][0, 8].argmax()]) == int(drafts[k])


def test_sampled_chain_draft_probs_are_the_draft_laws():
    d2t, kept = reduced_vocab(VOCAB, 60)
    model, state, ids, feats = _absorbed("eagle3", t=10, d2t=d2t, num_steps=3)
    cfg = TreeConfig(kind="chain", depth=3, budget=3)
    tree = model.propose(state, int(ids[0, -1]), cfg, WARM, torch.Generator().manual_seed(5))
    again = model.propose(state, int(ids[0, -1]), cfg, WARM, torch.Generator().manual_seed(5))
    assert torch.equal(tree.tokens, again.tokens)  # all randomness from the generator
    assert tree.mode == "block" and tree.draft_probs.shape == (4, VOCAB)
    drafts = tree.tokens[1:]
    seq = torch.cat([ids[0], drafts])[None]
    batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq),
             "taps": torch.cat([feats["taps"], torch.zeros(1, 3, feats["taps"].shape[-1])], 1)}
    with torch.no_grad():
        train = model.forward_train(batch)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[kept] = False
    for k in range(3):
        want = logits_to_probs(to_target_logits(train[k][0, 8], model.draft_to_target, VOCAB), WARM)
        torch.testing.assert_close(tree.draft_probs[k], want, atol=1e-5, rtol=1e-4)
        assert float(tree.draft_probs[k][outside].abs().sum()) == 0.0
        assert float(tree.draft_probs[k][int(drafts[k])]) > 0
    assert float(tree.draft_probs[3].abs().sum()) == 0.0  # leaf row: no children
    target_probs = torch.softmax(torch.randn(4, VOCAB), -1)
    for mode in ("block", "iid"):
        verify_tree(tree.tokens, tree.parents, target_probs, tree.draft_probs, mode=mode,
                    generator=torch.Generator().manual_seed(0))


def test_to_target_logits_scatter():
    logits = torch.tensor([1.0, 2.0, 3.0])
    out = to_target_logits(logits, torch.tensor([2, 5, 7]), 9)
    assert out[[2, 5, 7]].tolist() == [1.0, 2.0, 3.0]
    assert torch.isinf(out[[0, 1, 3, 4, 6, 8]]).all()


@pytest.mark.parametrize("family", ["eagle3", "mtp"])
def test_tree_nodes_see_only_their_ancestors(family):
    """A node's law inside a wide level equals its law when drafted alone along the same path."""
    model, state, ids, _ = _absorbed(family)
    wide = model.stepper(state)
    a, b, c = 11, 22, 33
    wide.step([1, 2, 3], torch.tensor([a, b, c]), [-1, -1, -1], 1)
    wide_rows = wide.step([4, 5], torch.tensor([44, 55]), [3, 1], 2)  # children of c and a
    for parent_tok, child_tok, row in ((c, 44, 0), (a, 55, 1)):
        alone = model.stepper(state)
        alone.step([1], torch.tensor([parent_tok]), [-1], 1)
        torch.testing.assert_close(alone.step([2], torch.tensor([child_tok]), [1], 2)[0], wide_rows[row],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["eagle3", "mtp"])
def test_propose_never_touches_committed_state(family):
    model, state, ids, feats = _absorbed(family, t=12, max_len=64)
    n = state.length
    k0, v0 = state.cache.k[:, :, :n].clone(), state.cache.v[:, :, :n].clone()
    big = TreeConfig(kind="dynamic", depth=6, topk=4, budget=30)
    first = model.propose(state, int(ids[0, -1]), big, GREEDY, None)
    assert torch.equal(state.cache.k[:, :, :n], k0) and torch.equal(state.cache.v[:, :, :n], v0)
    assert model.propose(state, int(ids[0, -1]), big, GREEDY, None).tokens.tolist() == first.tokens.tolist()
    # absorbing after a proposal == absorbing everything at once into a fresh state
    fresh = model.new_state(64, "cpu")
    model.absorb(fresh, {k: v[0, :n] for k, v in feats.items()}, ids[0, 1:n + 1])
    torch.testing.assert_close(fresh.last_logits, state.last_logits, atol=1e-6, rtol=1e-6)
    assert model.propose(fresh, int(ids[0, -1]), big, GREEDY, None).tokens.tolist() == first.tokens.tolist()


def test_small_state_shrinks_the_tree_instead_of_failing():
    model, state, ids, _ = _absorbed("eagle3", t=12, max_len=14)  # 11 committed, room for 3 speculative nodes
    tree = model.propose(state, int(ids[0, -1]), TreeConfig(kind="dynamic", depth=6, topk=4, budget=30), GREEDY, None)
    assert tree.size > 1 and int(depths_of(tree.parents).max()) <= 2
    chain = model.propose(state, int(ids[0, -1]), TreeConfig(kind="chain", depth=8, budget=8), GREEDY, None)
    assert chain.size == 5  # root + 1 root draft + 3 drafted from speculative slots
    empty = model.new_state(8, "cpu")
    assert model.propose(empty, 5, TreeConfig(), GREEDY, None).size == 1


def test_static_tree_follows_ranks_of_each_parents_law():
    model, state, ids, _ = _absorbed("mtp")
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 3]]
    tree = model.propose(state, int(ids[0, -1]), TreeConfig(kind="static", depth=3, budget=20, choices=choices),
                         WARM, None)
    assert tree.mode == "deterministic" and tree.size == len(choices) + 1
    toks = tree.tokens.tolist()
    root = model.stepper(state).root_logits()
    assert toks[1:4] == torch.topk(root, 3).indices.tolist()
    s = model.stepper(state)
    law_00 = s.step([1], torch.tensor([toks[1]]), [-1], 1)[0]  # after path [0]
    assert toks[4:6] == torch.topk(law_00, 2).indices.tolist()
    law_01 = s.step([2], torch.tensor([toks[5]]), [1], 2)[0]  # after path [0, 1]
    assert toks[8] == torch.topk(law_01, 4).indices[3].item()
    assert math.isclose(tree.parents.tolist()[8], 5)


def test_sampled_chain_ends_where_the_draft_law_is_not_finite():
    """A low-precision draft that overflows ends its chain there: the tree stays valid for block verification."""
    from speculators.models.drafting import build_chain

    class Overflowing:
        max_depth, room = 8, 8

        def root_logits(self):
            return torch.zeros(VOCAB)

        def step(self, nodes, tokens, parents, depth):
            return torch.full((len(nodes), VOCAB), float("nan") if depth >= 2 else 0.0)

    d2t = torch.zeros(VOCAB, dtype=torch.long)
    tree = build_chain(Overflowing(), 3, 5, WARM, torch.Generator().manual_seed(0), d2t, VOCAB)
    assert tree.size == 3 and tree.mode == "block" and torch.isfinite(tree.draft_probs).all()
    probs = torch.softmax(torch.randn(tree.size, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    verify_tree(tree.tokens, tree.parents, probs, tree.draft_probs, mode="block",
                generator=torch.Generator().manual_seed(2))
    nan_root = type("NanRoot", (Overflowing,), {"root_logits": lambda self: torch.full((VOCAB,), float("nan"))})
    alone = build_chain(nan_root(), 3, 5, WARM, torch.Generator().manual_seed(0), d2t, VOCAB)
    assert alone.size == 1 and alone.draft_probs.shape == (1, VOCAB)


def test_sampled_tree_shape_laws_and_modes():
    """A sampled tree is a spine (first draw of each level) with sibling draws: widths by level within the budget,
    siblings distinct and drawn from the spine node's own law (recorded in draft_probs, leaves zero), one draft row
    per level; at T=0 the same shape holds the top ranks."""
    assert sampled_tree_widths(5, 2, 10) == [2, 2, 2, 2, 2]
    assert sampled_tree_widths(4, 3, 7) == [3, 2, 1, 1] and sampled_tree_widths(5, 4, 3) == [1, 1, 1]
    assert sampled_tree_widths(3, 1, 9) == [1, 1, 1]
    stepper = _FakeStepper(vocab=VOCAB, seed=4)
    d2t = torch.arange(VOCAB)
    tree = build_sampled_tree(stepper, 7, [3, 2, 1], WARM, torch.Generator().manual_seed(3), d2t, VOCAB, "traversal")
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 4] and tree.mode == "traversal"
    assert stepper.calls == [1, 1]  # one draft row per level below the root
    toks = tree.tokens.tolist()
    spine_paths = {0: (), 1: (toks[1],), 4: (toks[1], toks[4])}
    for node, path in spine_paths.items():
        want = logits_to_probs(stepper.law(path), WARM)
        torch.testing.assert_close(tree.draft_probs[node], want)
        kids = [i for i, p in enumerate(tree.parents.tolist()) if p == node]
        assert len({toks[i] for i in kids}) == len(kids) and all(float(want[toks[i]]) > 0 for i in kids)
    assert float(tree.draft_probs[[2, 3, 5, 6]].abs().sum()) == 0.0
    again = build_sampled_tree(_FakeStepper(vocab=VOCAB, seed=4), 7, [3, 2, 1], WARM,
                               torch.Generator().manual_seed(3), d2t, VOCAB, "traversal")
    assert torch.equal(again.tokens, tree.tokens)  # all randomness from the generator
    greedy = build_sampled_tree(_FakeStepper(vocab=VOCAB, seed=4), 7, [3, 2], GREEDY, None, d2t, VOCAB, "greedy")
    assert greedy.tokens.tolist()[1:4] == torch.topk(stepper.law(()), 3).indices.tolist()
    assert greedy.draft_probs is None
    assert tree_verify_mode("sampled", WARM) == "traversal" and tree_verify_mode("chain", WARM) == "block"
    assert tree_verify_mode("sampled", WARM, "token") == "without_replacement"
    assert tree_verify_mode("chain", WARM, "token") == "iid" and tree_verify_mode("sampled", GREEDY) == "greedy"
    target = torch.softmax(torch.randn(tree.size, VOCAB), -1)
    for mode in ("traversal", "without_replacement"):
        verify_tree(tree.tokens, tree.parents, target, tree.draft_probs, mode=mode,
                    generator=torch.Generator().manual_seed(0))
