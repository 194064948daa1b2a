"""The engine under the plan controller: every plan (plain, the lookup alone, the model drafter, the model with the
lookup grafted on), switched cycle by cycle and with cycles that capture no features (so the drafter restarts from
the positions captured since), keeps greedy decoding token for token for every family; a drafter that never pays
leaves the engine within a few percent of plain decoding in COUNTED work (target forwards and nodes, captured
forwards, positions the drafter absorbed), not in wall-clock time."""

from __future__ import annotations

import pytest
import torch

from speculators.core.config import TreeConfig
from speculators.core.trees import DraftTree
from speculators.models.base import FeatureRequest
from speculators.runtime import adaptive as adaptive_module
from speculators.runtime.adaptive import Plan
from speculators.runtime.cycle_costs import CostModel
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import FAMILIES, hf_greedy, loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 100, 200, 5, 6], [9, 10, 11, 12, 13, 14, 15, 16, 17, 9, 10, 11]]
MAX_NEW = 40
# cycle i drafts SCRIPT[i % len] and its forward captures features unless NO_CAPTURE holds i % len
SCRIPT = ("model+lookup", "lookup", "plain", "model", "plain", "lookup", "plain", "model", "model+lookup")
NO_CAPTURE = {4, 5}  # the drafter misses these positions: the "model" cycle 7 restarts it from cycle 6's


@pytest.fixture(scope="module")
def spec_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("plan-specs")
    return {f: str(make_speculator_dir(tiny_llama, f, root / f, seed=5)) for f in FAMILIES}


def _scripted(monkeypatch) -> dict[str, int]:
    """Replace the controller's choice by SCRIPT (a model plan without fresh positions waits, as the real one does)."""
    seen = {"cycles": 0}

    def choose_plan(self, remaining, lookup=0, model_ready=True):
        i = seen["cycles"] % len(SCRIPT)
        seen["cycles"] += 1
        source, depth = SCRIPT[i], min(self.max_depth, remaining - 1)
        plan = Plan()
        if source == "lookup" and lookup:
            plan = Plan("", 0, min(lookup, self.lookup_depth, remaining - 1))
        elif source.startswith("model") and depth > 0 and model_ready:
            graft = min(lookup, self.graft_nodes) if source == "model+lookup" and self.kinds[0] in self.graftable else 0
            plan = Plan(self.kinds[0], depth, graft)
        self._capture = i not in NO_CAPTURE
        self._count(plan)
        return plan

    monkeypatch.setattr(adaptive_module.AdaptiveDepth, "choose_plan", choose_plan)
    monkeypatch.setattr(adaptive_module.AdaptiveDepth, "wants_features", lambda self: self._capture)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_switching_plans_and_skipping_features_keeps_greedy_decoding(tiny_llama, spec_dirs, family: str,
                                                                      monkeypatch) -> None:
    _scripted(monkeypatch)
    tree = TreeConfig(kind="dynamic", depth=3, topk=2, budget=6, adaptive=True)
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dirs[family], tree=tree, ngram_graft=3)
    plans: dict[str, int] = {}
    restarts = 0
    for prompt in PROMPTS:
        out = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert out.token_ids == hf_greedy(tiny_llama, prompt, MAX_NEW), f"{family} diverged on {prompt}"
        for source, n in out.stats.adaptive["plan_histogram"].items():
            plans[source] = plans.get(source, 0) + n
        restarts += out.stats.work.restarts
        work = out.stats.work
        assert work.target_forwards == out.stats.target_calls and work.captured_forwards < work.target_forwards
    assert set(plans) == {"plain", "lookup", "model", "model+lookup"}
    assert restarts > 0  # the drafter really restarted after skipped positions


class _Decoy:
    """A drafter that never pays: it taps the target like EAGLE-3, spends a one-layer drafter's matrix products on
    every proposal, and drafts a chain of the token 0, which the target never produces here; it counts the positions
    it absorbs."""

    name = family = "decoy"
    needs_token_ids = False
    samples_drafts = False

    def __init__(self) -> None:
        self.absorbed = 0
        self.weight = torch.randn(2048, 2048) / 64  # [H, H]: what drafting one token costs a small drafter

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=[0, 1], last_hidden=False)

    def new_state(self, max_len, device) -> dict:
        return {"length": 0}

    def absorb(self, state, features, next_tokens) -> None:
        assert features["taps"].shape[0] == next_tokens.shape[0]  # the captured positions, one row each
        state["length"] += int(next_tokens.shape[0])
        self.absorbed += int(next_tokens.shape[0])

    def propose(self, state, root_token, tree, sampling, generator) -> DraftTree:
        x = torch.ones(1, 2048)  # [1, H]
        for _ in range(tree.depth):
            x = torch.tanh(x @ self.weight)
        return DraftTree.chain(int(root_token), [0] * tree.depth, "greedy" if sampling.greedy else "deterministic")


def _fixed_costs() -> CostModel:
    """A machine's costs, frozen: cycles of 10 ms + 1 ms per node, drafting 1 ms per depth; nothing is re-measured."""
    cost = CostModel()
    for n in (1, 2, 4, 8):
        cost.set_cycle(n, 0.010 + 0.001 * (n - 1))
    for depth in range(1, 5):
        cost.set_draft(depth, depth, 0.001 * depth, "chain")
    for name in ("observe_cycle", "observe_draft", "observe_absorb", "observe_total"):
        setattr(cost, name, lambda *args, **kwargs: None)
    return cost


def test_a_drafter_that_never_pays_costs_almost_nothing_in_counted_work(tiny_llama) -> None:
    target = loaded_target(str(tiny_llama))
    prompt, max_new = [9, 10, 11, 12, 13, 14, 15, 16, 17], 300
    reference = hf_greedy(tiny_llama, prompt, max_new)
    assert 0 not in reference  # the decoy's token is never the target's
    decoy = _Decoy()
    engine = Engine(target, decoy, tree=TreeConfig(kind="chain", depth=4, topk=1, budget=4, adaptive=True))
    engine.cost = _fixed_costs()  # the controller's choices follow acceptance only, not this machine's load
    plain = Engine(target).generate(prompt, SamplingParams(max_new_tokens=max_new))
    for _ in range(2):  # the engine's acceptance memory learns that the decoy never pays
        engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    before = decoy.absorbed
    out = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    work, tokens = out.stats.work, len(out.token_ids)
    assert out.token_ids == reference == plain.token_ids
    assert plain.stats.work.target_nodes == plain.stats.work.target_forwards == tokens
    assert work.target_forwards <= plain.stats.work.target_forwards  # every cycle commits >= 1 token
    assert work.target_nodes <= 1.02 * plain.stats.work.target_nodes, out.stats.adaptive
    assert work.captured_forwards <= 0.2 * work.target_forwards, out.stats.adaptive
    assert decoy.absorbed - before == work.absorbed_positions <= 0.15 * tokens, out.stats.adaptive
    assert work.proposals == out.stats.adaptive["plan_histogram"].get("model", 0) <= 0.05 * work.target_forwards
    print(f"decoy vs plain, {tokens} tokens: {work}", out.stats.adaptive)


def test_a_drafter_of_token_ids_alone_is_never_restarted(tiny_llama, monkeypatch) -> None:
    """Prompt lookup as the drafter reads token ids only: its queue is kept whatever the controller's capture wish,
    so it never loses its context."""
    _scripted(monkeypatch)
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram")
    assert not engine.reads_hidden
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    assert out.token_ids == hf_greedy(tiny_llama, PROMPTS[0], MAX_NEW)
    assert out.stats.work.restarts == 0 and out.stats.work.captured_forwards == out.stats.work.target_forwards
