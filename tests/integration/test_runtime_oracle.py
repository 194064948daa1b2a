"""Deep acceptance on the house target (fp32) with an adversarial drafter: `oracle_drafter.OracleDrafter` drafts with
the target itself, each right token placed SECOND behind a decoy that has a child of its own — so accepted paths skip
first children, the KV cache gathers paths with gaps, and under sampling the next token is drawn from residuals at
depth >= 2. Through it, alone and with several requests sharing each target forward:

- greedy parity with Hugging Face `generate` token for token (tau near depth + 1);
- the joint law of the first three generated tokens equals the target's exact law (direct forwards, the same
  sampling operator) by Pearson chi-square with family-wise alpha 1e-6 (Bonferroni), for seeded requests at a fixed
  depth alone and batched, and for UNSEEDED requests on the adaptive path the server runs (`BatchRunner`, depth
  chosen per cycle from measured costs);
- a deliberately broken verifier that forgets the rejected decoy at depth >= 2 is rejected by the same test.
"""

from __future__ import annotations

from functools import partial

import pytest

from speculators.core.config import TreeConfig
from speculators.core.sampling import sample
from speculators.runtime.batching import BatchRunner, generate_batch
from speculators.runtime.cycle_costs import CostModel
from speculators.runtime.drafters.load import DrafterInfo
from speculators.runtime.requests import StreamChunk
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.oracle_drafter import CycleLog, OracleDrafter, chi_square_p, exact_prefix_law
from tests.unit.runtime.runtime_helpers import hf_greedy, hf_model, loaded_target, single_thread, top2_margin  # noqa: F401

pytestmark = pytest.mark.integration

DEPTH = 4
FIXED = TreeConfig(kind="dynamic", depth=DEPTH, topk=2, budget=3 * DEPTH, adaptive=False)
ADAPTIVE = TreeConfig(kind="dynamic", depth=DEPTH, topk=2, budget=3 * DEPTH, adaptive=True)
SAMPLES = 1000
FAMILY_ALPHA = 1e-6
NUM_TESTS = 4  # chi-square tests in this module (the broken control included)
SAMPLING = dict(temperature=0.8, top_k=12, top_p=0.95)
CONTROL = dict(temperature=1.5, top_k=4)  # flat enough that deep rejections happen often
PROMPT = "    def read(self, n):\n        return self.read(n)\n\n    def write(self, data):\n        return self."
GREEDY_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(top):\n", "class Stack:\n    def __init__(self):\n",
                  "    for i in range(10):\n", "def read_config(path):\n    with open(path) as f:\n"]


class _FixedCosts(CostModel):
    """The adaptive controller's costs priced by a fixed rule instead of this machine's clock: every target cycle costs
    0.1 s whatever its size (flat, as on an accelerator), drafting and absorbing nothing. The oracle drafts with the
    whole target, so its measured drafting costs as much as verifying, and the controller chose by the clock: once
    plain decoding on a loaded CI machine (1 deep residual in 3,017 cycles), once depth-1 trees only on an idle AMD
    EPYC even with drafts priced at 1/20 of their measured time (no path deeper than 1 in 2,020 cycles; with 2 ms
    per verified node and 10 ms per drafted level, none deeper than 2). Priced by this rule a deeper tree never costs
    more, so the choice depends only on the acceptance the controller observes and it keeps drafting deep on any
    machine: the test exercises what it is about, the unseeded adaptive path's output law. (Choosing a depth never
    changes the output law; the clock is not what is tested.)"""

    CYCLE_SECONDS = 0.1  # [s], every target cycle whatever its node count

    def set_cycle(self, nodes: int, seconds: float) -> None:
        super().set_cycle(nodes, self.CYCLE_SECONDS)

    def observe_cycle(self, nodes: int, seconds: float, kind: str = "") -> None:
        super().observe_cycle(nodes, self.CYCLE_SECONDS, kind)

    def set_draft(self, depth: int, drafted_nodes: int, seconds: float, kind: str = "") -> None:
        super().set_draft(depth, drafted_nodes, 0.0, kind)

    def observe_draft(self, depth: int, drafted_nodes: int, seconds: float, kind: str = "") -> None:
        super().observe_draft(depth, drafted_nodes, 0.0, kind)

    def observe_absorb(self, seconds: float) -> None:
        super().observe_absorb(0.0)


def _engine(house_target, tree: TreeConfig, cls: type[Engine] = CycleLog) -> Engine:
    target = loaded_target(str(house_target))
    return cls(target, OracleDrafter(hf_model(str(house_target))), info=DrafterInfo("oracle", "oracle"), tree=tree)


def _check_parity(house_target, engine: Engine, prompts: list[list[int]], outs: list, max_new: int) -> None:
    for ids, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(house_target, ids, max_new)
        if out.token_ids != ref:
            j = next(i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b)
            margin = top2_margin(house_target, ids + ref[:j])
            assert margin < 1e-4, f"token {j}: {out.token_ids[j]} != HF greedy {ref[j]} (top-2 margin {margin:.3g})"


@pytest.mark.parametrize("batch", [0, 4])
def test_greedy_parity_through_deep_paths(house_target, batch: int) -> None:
    engine = _engine(house_target, FIXED)
    prompts = [engine.encode(p) for p in GREEDY_PROMPTS]
    params = SamplingParams(max_new_tokens=32)
    outs = generate_batch(engine, prompts, params, max_batch=batch) if batch else \
        [engine.generate(p, params) for p in prompts]
    _check_parity(house_target, engine, prompts, outs, 32)
    seen = engine.seen
    assert engine.totals.tau > 0.8 * (DEPTH + 1), engine.totals.tau  # the oracle is right nearly every time
    assert seen["skipped_first_child"] >= 0.8 * seen["cycles"] and seen["gathered_with_gaps"] >= 0.8 * seen["cycles"]
    assert seen["deepest_accept"] == DEPTH


def _first_three(engine: Engine, house_target, params: list[SamplingParams], batch: int,
                 sampling: dict = SAMPLING) -> tuple[float, list[int]]:
    """(chi-square p-value, first tokens outside the filtered target's support) of the first three tokens of each
    request; an exception the engine raises propagates (never a detection)."""
    prompt = engine.encode(PROMPT)
    outs = generate_batch(engine, [prompt] * len(params), params, max_batch=batch) if batch else \
        [engine.generate(prompt, p) for p in params]
    return _law_test(house_target, engine, prompt, [tuple(o.token_ids[:3]) for o in outs], sampling)


def _law_test(house_target, engine: Engine, prompt: list[int], keys: list[tuple], sampling: dict
              ) -> tuple[float, list[int]]:
    law, support = exact_prefix_law(hf_model(str(house_target)), prompt, SamplingParams(**sampling), 3,
                                    min_mass=5.0 / SAMPLES, eos=engine.eos_ids)
    return chi_square_p(law, keys, len(keys)), [k[0] for k in keys if k[0] not in support]


def _score(house_target, engine: Engine, prompt: list[int], keys: list[tuple], sampling: dict) -> float:
    p_value, outside = _law_test(house_target, engine, prompt, keys, sampling)
    assert not outside, f"first tokens {sorted(set(outside))} the filtered target never produces"
    return p_value


@pytest.mark.parametrize("batch", [0, 8])
def test_first_three_tokens_follow_the_target(house_target, batch: int) -> None:
    engine = _engine(house_target, FIXED)
    params = [SamplingParams(max_new_tokens=3, seed=50_000 * batch + i, **SAMPLING) for i in range(SAMPLES)]
    p_value, outside = _first_three(engine, house_target, params, batch)
    assert not outside, f"first tokens {sorted(set(outside))} the filtered target never produces"
    seen = engine.seen
    assert seen["residual_deep"] > 50 and seen["skipped_first_child"] > 50 and seen["deepest_accept"] == 2, seen
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"batch {batch}: p = {p_value:.3g} ({seen})"


def test_unseeded_adaptive_serving_path(house_target) -> None:
    """What the server runs: no seeds, adaptive depth, requests sharing forwards in a `BatchRunner`, each client
    leaving once it has its first three tokens (as a disconnecting client does; the rest is never generated)."""
    engine = _engine(house_target, ADAPTIVE)
    engine.cost = _FixedCosts()
    prompt = engine.encode(PROMPT)
    runner = BatchRunner(engine, max_batch=4)
    firsts: list[list[int]] = [[] for _ in range(SAMPLES)]
    tickets = []

    def emit(i: int, item: object) -> None:
        if isinstance(item, StreamChunk):
            firsts[i].extend(item.token_ids)
            if len(firsts[i]) >= 3:
                runner.cancel(tickets[i])

    for i in range(SAMPLES):  # >= 8 tokens: adaptive speculation is off for shorter outputs
        tickets.append(runner.add(prompt, SamplingParams(max_new_tokens=16, **SAMPLING), partial(emit, i), False))
    runner.run()
    p_value = _score(house_target, engine, prompt, [tuple(f[:3]) for f in firsts], SAMPLING)
    seen = engine.seen
    assert seen["residual_deep"] > 20 and seen["skipped_first_child"] > 20 and seen["deepest_accept"] >= 3, seen
    assert runner.cancelled >= 0.9 * SAMPLES and max(len(f) for f in firsts) < 16
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"unseeded adaptive: p = {p_value:.3g} ({seen})"


class _ForgetsDeepDecoys(CycleLog):
    """BROKEN on purpose: below the root, a rejected child is not removed from the law the next token is drawn
    from (the residual of a rejected decoy keeps its mass)."""

    def _verify(self, tree, target_row, params, generator):
        accepted, next_token = super()._verify(tree, target_row, params, generator)
        last = accepted[-1] if accepted else 0
        if accepted and bool((tree.parents == last).any()):  # rejections below the root
            next_token = sample(target_row(last), generator)  # drawn from the full row, not the residual
        return accepted, next_token


def test_a_verifier_that_forgets_deep_rejections_is_caught(house_target) -> None:
    engine = _engine(house_target, FIXED, _ForgetsDeepDecoys)
    params = [SamplingParams(max_new_tokens=3, seed=777 + i, **CONTROL) for i in range(SAMPLES)]
    # measured: p ~ 1e-8 broken; the same settings, unbroken: p ~ 0.5
    p_value, outside = _first_three(engine, house_target, params, batch=8, sampling=CONTROL)
    assert engine.seen["residual_deep"] > 0, engine.seen  # the broken branch ran
    assert outside or p_value < FAMILY_ALPHA / NUM_TESTS, \
        f"the broken verifier was not detected (p = {p_value:.3g}, no token outside the support)"
