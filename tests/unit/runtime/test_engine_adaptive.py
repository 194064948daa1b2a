"""Adaptive speculation: depth from recent acceptance and measured costs, off for short outputs and where it
loses (with periodic probes), every choice reported; the engine stays lossless either way."""

from __future__ import annotations

import math

import pytest

from speculators.core.config import TreeConfig
from speculators.core.metrics import simulated_tau
from speculators.runtime.acceptance_memory import AcceptanceMemory
from speculators.runtime.adaptive import AdaptiveDepth, Plan
from speculators.runtime.cycle_costs import CostModel
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import hf_greedy, loaded_target, single_thread  # noqa: F401


def _cost(base: float = 0.010, per_node: float = 0.001, draft: float = 0.0005) -> CostModel:
    """Cycle costs base + per_node * (nodes - 1) measured at 1..32 nodes; chains (one node per depth) drafted
    at `draft` seconds per depth."""
    c = CostModel()
    for n in (1, 2, 4, 8, 16, 32):
        c.set_cycle(n, base + per_node * (n - 1))
    c.observe_draft(depth=1, drafted_nodes=1, seconds=draft)
    return c


def test_short_output_turns_speculation_off() -> None:
    ctrl = AdaptiveDepth(cost=_cost(), max_depth=5, max_new_tokens=4)
    assert ctrl.mode.startswith("off: short output")
    assert [ctrl.choose(r) for r in (4, 3, 2, 1)] == [0, 0, 0, 0]
    assert ctrl.report()["plain_cycles"] == 4


def test_high_acceptance_drafts_deep_and_never_past_the_end() -> None:
    ctrl = AdaptiveDepth(cost=_cost(), max_depth=6, max_new_tokens=100)
    for _ in range(20):
        ctrl.observe(drafted_depth=6, accepted=6)
    assert ctrl.choose(100) == 6
    assert ctrl.choose(3) == 2  # depth <= remaining - 1
    assert ctrl.choose(1) == 0


def test_low_acceptance_goes_plain_then_probes() -> None:
    ctrl = AdaptiveDepth(cost=_cost(per_node=0.008, draft=0.004), max_depth=4, max_new_tokens=100, probe_every=5)
    for _ in range(30):
        ctrl.observe(drafted_depth=4, accepted=0)
    choices = [ctrl.choose(100) for _ in range(20)]
    # a probe at the most promising depth after 5 plain cycles, then after 10 (back-off while probes lose)
    assert [i for i, d in enumerate(choices) if d > 0] == [4, 14] and choices[4] == max(range(1, 5), key=ctrl.rate)
    report = ctrl.report()
    assert report["probe_cycles"] == 2 and report["turned_off"] >= 1
    assert report["acceptance_estimate"][0] < 0.05 and report["mode"] == "adaptive"


def test_a_depth_that_looked_poor_is_explored_again_and_recovers() -> None:
    # depth 3 once looked poor (acceptance 0.1 there), so the best depth is 2; every 4th speculative cycle drafts
    # depth 3, and when depth 3 is in fact accepted the estimate recovers and the controller moves there
    ctrl = AdaptiveDepth(cost=_cost(per_node=0.002, draft=0.002), max_depth=3, max_new_tokens=1000,
                         prior=[0.9, 0.9, 0.1], explore_every=4, smoothing=0.3)
    ctrl.acceptance = [0.9, 0.9, 0.1]
    first = [ctrl.choose(1000) for _ in range(8)]
    assert first == [2, 2, 2, 3, 2, 2, 2, 3] and ctrl.report()["explore_cycles"] == 2
    for _ in range(30):
        depth = ctrl.choose(1000)
        ctrl.observe(drafted_depth=depth, accepted=depth)  # every drafted depth is accepted
    assert ctrl.choose(1000) == 3 and ctrl.acceptance[2] > 0.5
    never = AdaptiveDepth(cost=_cost(per_node=0.002, draft=0.002), max_depth=3, max_new_tokens=1000,
                          explore_every=10**9)
    never.acceptance = [0.9, 0.9, 0.1]
    assert {never.choose(1000) for _ in range(16)} == {2}  # without exploring, depth 3 is never tried


def _kinds_cost() -> CostModel:
    """Cycles cost 10 ms + 1 ms per node; chains and sampled trees draft one row per level (0.5 ms), top-2 trees
    two (1 ms); sampled trees verify 2 nodes per level, chains 1."""
    c = _cost()
    for depth in range(1, 5):
        c.set_draft(depth, depth, 0.0005 * depth, "chain")
        c.set_draft(depth, 2 * depth, 0.0005 * depth, "sampled")
        c.set_draft(depth, 2 * depth, 0.001 * depth, "dynamic")
    return c


def test_the_kind_with_the_best_expected_rate_is_drafted_and_others_are_explored() -> None:
    kinds = ("dynamic", "chain", "sampled")
    ctrl = AdaptiveDepth(cost=_kinds_cost(), max_depth=4, max_new_tokens=1000, kinds=kinds, explore_every=4)
    ctrl.estimates = {"dynamic": [0.5] * 4, "chain": [0.6] * 4, "sampled": [0.9] * 4}
    plans = [(p.kind, p.depth) for p in (ctrl.choose_plan(1000) for _ in range(16))]
    assert plans[0] == ("sampled", max(range(1, 5), key=lambda d: ctrl.rate(d, "sampled")))
    assert ctrl.rate(plans[0][1], "sampled") > max(ctrl.rate(d, k) for k in ("dynamic", "chain") for d in range(1, 5))
    assert {k for k, _ in plans} == set(kinds)  # exploring cycles try the other kinds too
    assert sum(k == "sampled" for k, _ in plans) >= 12
    ctrl.observe(drafted_depth=4, accepted=0, kind="chain")  # observations move only their own kind's estimate
    assert ctrl.estimates["chain"][0] < 0.6 and ctrl.estimates["sampled"] == [0.9] * 4
    report = ctrl.report()
    assert sum(report["kind_histogram"].values()) == 16 and set(report["acceptance_by_kind"]) == set(kinds)
    assert set(report["cost"]["draft_ms_by_depth"]) >= set(kinds)
    # a request starts from the engine's per-kind estimates (the default where it has none)
    seeded = AdaptiveDepth(cost=_kinds_cost(), max_depth=2, max_new_tokens=100, kinds=kinds,
                           prior={"chain": [1.0, 0.9]})
    assert seeded.estimates["chain"] == [1.0, 0.9] and seeded.estimates["sampled"] == [0.6, 0.6]
    seeded.observe(drafted_depth=2, accepted=1, kind="chain")
    seeded.observe(drafted_depth=2, accepted=0, kind="chain")
    assert seeded.counts["chain"] == [(2, 1), (1, 0)] and seeded.counts["sampled"] == [(0, 0), (0, 0)]


def test_acceptance_memory_pools_requests_by_temperature_and_kind() -> None:
    memory = AcceptanceMemory(half_life=100.0, prior_weight=4.0, default=0.6)
    assert memory.estimates(1.0, "chain", 3) == [0.6, 0.6, 0.6]  # nothing seen yet
    memory.add(1.0, "chain", [(16, 12), (12, 12), (0, 0)], cycles=16)
    a = memory.estimates(1.0, "chain", 3)
    assert a[0] == (12 + 4 * 0.6) / (16 + 4)
    assert a[1] == (12 + 4 * a[0]) / (12 + 4)  # a rarely drafted depth leans on the one above it, not on 0.6
    assert a[2] == a[1]  # never drafted: as good as the depth above
    assert memory.estimates(0.96, "chain", 1) == a[:1] and memory.estimates(0.7, "chain", 1) == a[:1]  # nearest T
    assert memory.estimates(0.0, "chain", 1) == [0.6]  # greedy never borrows from sampled requests
    assert memory.estimates(1.0, "sampled", 1) == [0.6]  # nor one kind from another
    memory.add(1.0, "chain", [(0, 0)], cycles=5)  # a request that never drafted the kind changes nothing
    assert memory.estimates(1.0, "chain", 3) == a
    memory.add(1.0, "chain", [(10, 0)], cycles=100)  # older counts weigh half after `half_life` cycles
    tries, hits = memory.counts[(1.0, "chain")][0]
    assert (tries, hits) == (16 * 0.5 + 10, 12 * 0.5) and memory.counts[(1.0, "chain")][1] == (6.0, 6.0)
    memory.add(0.7, "chain", [(4, 4)], cycles=4)
    assert memory.estimates(0.75, "chain", 1) == [(4 + 4 * 0.6) / 8]  # 0.75 rounds to 0.8: nearest is 0.7
    for t in range(3, 1000):  # clients' temperatures cannot grow the memory without bound
        memory.add(t + 0.5, "chain", [(1, 1)], cycles=1)
    assert {b for b, _ in memory.counts} == {0.7, 1.0, 2.0}


def test_the_proposal_share_is_kept_across_requests_and_seeds_the_next() -> None:
    """A drafter that may propose nothing: the memory keeps its decayed share per temperature and kind, and a new
    request starts from it, weighted by the cycles behind it (at most `max_prior_weight`)."""
    memory = AcceptanceMemory(half_life=100.0)
    assert memory.share(0.0, "chain") is None
    memory.add_share(0.0, "chain", cycles=0, proposals=0)  # a request that never drafted says nothing
    assert memory.share(0.0, "chain") is None
    memory.add_share(0.0, "chain", cycles=100, proposals=20)
    memory.add_share(0.0, "chain", cycles=100, proposals=80)  # the older request weighs half
    assert memory.share(0.0, "chain") == pytest.approx(((20 * 0.5 + 80) / 150, 150.0))
    assert memory.share(1.0, "chain") is None and memory.share(0.0, "dynamic") is None
    ctrl = AdaptiveDepth(cost=_cost(), max_depth=3, max_new_tokens=100, kinds=("chain",),
                         prior_share={"chain": (0.2, 3.0)})
    assert ctrl.proposal_share == {"chain": 0.2} and ctrl.share_weights == {"chain": 5.0}
    full = AdaptiveDepth(cost=_cost(), max_depth=3, max_new_tokens=100, kinds=("chain",))
    assert ctrl.plan_tokens(Plan("chain", 3)) < full.plan_tokens(Plan("chain", 3))  # rated as a mix with plain
    ctrl.observe(0, 0, "chain")  # proposed nothing: the share falls by 0.2 / (0.9 * 5 + 1)
    assert ctrl.proposal_share["chain"] == pytest.approx(0.2 - 0.2 / 5.5) and ctrl.share_counts == {"chain": (1, 0)}


def test_cheap_verification_prefers_depth_over_plain() -> None:
    ctrl = AdaptiveDepth(cost=_cost(per_node=0.0001, draft=0.0001), max_depth=4, max_new_tokens=100,
                         prior=[0.5, 0.5, 0.5, 0.5])
    assert ctrl.choose(100) >= 3
    assert ctrl.rate(ctrl.choose(100)) > ctrl.rate(0)


def test_fixed_and_uncalibrated_modes() -> None:
    assert AdaptiveDepth(cost=_cost(), max_depth=3, max_new_tokens=50, enabled=False).choose(50) == 3
    assert AdaptiveDepth(cost=CostModel(), max_depth=3, max_new_tokens=50).choose(50) == 3  # no costs yet
    assert AdaptiveDepth(cost=_cost(), max_depth=0, max_new_tokens=50).mode.startswith("off")


def test_cost_model_interpolates_and_ignores_preempted_spikes() -> None:
    c = CostModel()
    c.set_cycle(1, 0.010)
    c.set_cycle(2, 0.014)  # the step from a matrix-vector to a matrix-matrix product
    c.set_cycle(8, 0.016)
    assert abs(c.cycle(5) - 0.015) < 1e-9 and abs(c.cycle(16) - 0.016 - 8 * 0.002 / 6) < 1e-9
    c.observe_cycle(1, 5.0)  # a cycle that lost the CPU
    assert c.cycle(1) < 0.02
    noisy = CostModel()  # buckets that say 4 nodes cost less than 1: read as costing what 1 node costs
    for nodes, seconds in ((1, 0.006), (4, 0.005), (10, 0.011)):
        noisy.set_cycle(nodes, seconds)
    assert noisy.cycle(1) == noisy.cycle(4) == 0.006 and abs(noisy.cycle(7) - 0.0085) < 1e-12
    c.observe_draft(depth=2, drafted_nodes=6, seconds=0.004)
    assert c.draft_nodes(2) == 6 and abs(c.draft_nodes(4) - 12) < 1e-9 and abs(c.draft_cost(1) - 0.002) < 1e-9
    c.observe_absorb(0.001)
    assert abs(c.draft_cost(2) - 0.005) < 1e-9  # absorbing the last cycle's tokens + proposing
    c.observe_absorb(0.0)  # an impossibly fast sample moves the estimate by at most half of it
    assert abs(c.absorb - (0.001 - 0.2 * 0.0005)) < 1e-12
    c.set_draft(3, 6, 0.003)
    assert c.draft_nodes(3) == 6 and abs(c.draft_cost(3) - c.absorb - 0.003) < 1e-12
    assert set(c.to_dict()) == {"cycle_ms_by_nodes", "cycle_excess_ms_by_kind", "draft_ms_by_depth", "absorb_ms",
                                "draft_nodes_by_depth", "measured_over_predicted_by_plan", "origin"}


def test_a_kind_whose_cycles_cost_more_than_their_size_says_is_rated_by_its_own_cost() -> None:
    c = _kinds_cost()
    predicted = c.cycle(9)
    c.observe_cycle(9, predicted + 0.004, kind="sampled")  # a sampled tree's cycle: 4 ms over the shared buckets
    assert abs(c.excess["sampled"] - 0.004) < 1e-12 and "chain" not in c.excess
    assert abs(c.cycle_of(9, "sampled") - c.cycle(9) - 0.004) < 1e-12 and c.cycle_of(9, "chain") == c.cycle(9)
    a = [0.8] * 4  # the controller's rate prices the excess in
    seconds = c.draft_cost(4, "sampled") + c.cycle(1 + c.draft_nodes(4, "sampled")) + 0.004
    assert abs(simulated_tau(a) / c.rate(a, 4, "sampled") - seconds) < 1e-12
    c.observe_cycle(9, 5.0, kind="sampled")  # a preempted cycle (5 s) moves the excess by at most one cycle's worth
    assert c.excess["sampled"] < 0.004 + c.smoothing * 0.03
    c.observe_cycle(1, 0.001)  # root-only (plain) cycles carry no kind
    assert set(c.excess) == {"sampled"}


def test_engine_reports_choices_and_stays_lossless(tiny_llama) -> None:
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram",
                                    tree=TreeConfig(kind="chain", depth=4, adaptive=True))
    out = engine.generate(prompt, SamplingParams(max_new_tokens=20))
    assert out.token_ids == hf_greedy(tiny_llama, prompt, 20)
    adaptive = out.stats.adaptive
    assert adaptive["mode"] == "adaptive" and sum(adaptive["depth_histogram"].values()) == out.stats.target_calls
    assert adaptive["cost"]["cycle_ms_by_nodes"]["1.0"] > 0 and len(adaptive["cost"]["cycle_ms_by_nodes"]) >= 2
    # the first request calibrated proposing at every depth on its own drafter state
    assert set(adaptive["cost"]["draft_ms_by_depth"]["chain"]) == {"1", "2", "3", "4"}
    assert adaptive["kind_histogram"] == {"chain": out.stats.target_calls - adaptive["plain_cycles"]}
    short = engine.generate(prompt, SamplingParams(max_new_tokens=3))
    assert short.stats.adaptive["mode"].startswith("off: short output") and short.stats.acceptance.drafted_tokens == 0
    assert short.token_ids == out.token_ids[:3]


def test_cycles_whose_drafter_proposed_nothing_set_its_share_not_its_acceptance(tiny_llama) -> None:
    """Prompt lookup in the model drafter's place proposes only where the context repeats: its acceptance is counted
    over the cycles it proposed, and the cycles it found nothing lower its proposal share (the controller's plan is
    then a mix of a drafted cycle and a plain one)."""
    prompt = list(range(10, 40))  # no n-gram repeats: the first cycles find nothing
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram",
                                    tree=TreeConfig(kind="chain", depth=4, adaptive=False))
    out = engine.generate(prompt, SamplingParams(max_new_tokens=24))
    assert out.token_ids == hf_greedy(tiny_llama, prompt, 24)
    model_cycles = out.stats.adaptive["kind_histogram"]["chain"]
    tries, _ = engine.acceptance_memory.counts[(0.0, "chain")][0]
    assert model_cycles == out.stats.target_calls and 0 < tries < model_cycles  # some proposed nothing
    assert 0 < out.stats.adaptive["proposal_share"]["chain"] < 1
    # the engine keeps the share: the next request starts from the traffic's, not from "always proposes"
    share, seen = engine.acceptance_memory.share(0.0, "chain")
    assert share == pytest.approx((tries + 0.0) / model_cycles) and seen == model_cycles
    again = engine.generate(prompt, SamplingParams(max_new_tokens=24))
    assert again.token_ids == out.token_ids
    second, seen = engine.acceptance_memory.share(0.0, "chain")
    assert seen > model_cycles and 0 < second < 1


# ---- the plan controller: plain, the lookup alone, the model, the model with the lookup grafted on ----------------


def _lookup_ctrl(**kwargs) -> AdaptiveDepth:
    """A model drafter (depth 4) and a lookup source (chains of up to 6, grafts of up to 3) on 10 ms + 1 ms per node
    cycles; the model drafts at 0.5 ms per depth."""
    args = dict(cost=_cost(), max_depth=4, max_new_tokens=1000, kinds=("dynamic",), lookup_depth=6, graft_nodes=3,
                graftable=("dynamic",))
    args.update(kwargs)
    ctrl = AdaptiveDepth(**args)
    ctrl.cost.set_draft(1, 1, 0.0005, "dynamic")
    return ctrl


def test_the_lookup_alone_wins_where_it_is_right_and_the_model_is_not() -> None:
    ctrl = _lookup_ctrl(prior={"dynamic": [0.05] * 4, "lookup": [0.9] * 9})
    plan = ctrl.choose_plan(1000, lookup=6)
    assert (plan.source, plan.lookup) == ("lookup", 6)
    assert ctrl.plan_rate(plan) > max(ctrl.plan_rate(p) for p in (Plan(), Plan("dynamic", 1), Plan("dynamic", 1, 3)))
    # no recurring suffix this cycle: the lookup plans do not exist, and plain beats the poor model
    assert ctrl.choose_plan(1000, lookup=0) == Plan()
    assert ctrl.report()["plan_histogram"] == {"lookup": 1, "plain": 1}


def test_the_graft_is_chosen_when_both_sources_add_tokens() -> None:
    # the model is sure of the next token only, the lookup of the ones after it
    ctrl = _lookup_ctrl(prior={"dynamic": [0.95, 0.1, 0.1, 0.1], "lookup": [0.4, 0.95, 0.95, 0.95]})
    plan = ctrl.choose_plan(1000, lookup=3)
    assert plan.source == "model+lookup" and plan.lookup == 3
    assert ctrl.plan_rate(plan) > max(ctrl.plan_rate(p) for p in (Plan("dynamic", plan.depth), Plan("", 0, 3), Plan()))
    # the graft's tokens are the max of the two sources' reach per depth, never their sum
    a, b = ctrl.estimates["dynamic"], ctrl.lookup_estimates
    reach = lambda xs, n, k: math.prod(xs[:k + 1]) if k < n else 0.0  # noqa: E731
    tokens = 1 + sum(max(reach(a, plan.depth, k), reach(b, 3, k)) for k in range(max(plan.depth, 3)))
    seconds = ctrl.cost.draft_cost(plan.depth, "dynamic") + ctrl.cost.cycle_of(
        1 + ctrl.cost.draft_nodes(plan.depth, "dynamic") + 3, "dynamic")
    assert ctrl.plan_rate(plan) == pytest.approx(tokens / seconds)


def test_sampled_kinds_are_never_grafted() -> None:
    ctrl = _lookup_ctrl(kinds=("chain",), graftable=(), prior={"chain": [0.9] * 4, "lookup": [0.9] * 9})
    for _ in range(20):
        plan = ctrl.choose_plan(1000, lookup=6)
        assert not (plan.depth and plan.lookup)


def test_every_accepted_token_is_credited_to_its_source() -> None:
    ctrl = _lookup_ctrl()
    ctrl.observe(drafted_depth=4, accepted=2, kind="dynamic")
    ctrl.accepted_by_source["lookup"] += 3
    ctrl.observe_lookup(proposed=6, matched=2)  # positions 0, 1 hit, position 2 missed, 3-5 not reached
    assert ctrl.lookup_counts[:4] == [(1, 1), (1, 1), (1, 0), (0, 0)]
    assert ctrl.report()["accepted_by_source"] == {"model": 2, "lookup": 3}


def test_a_drafter_that_never_pays_is_probed_rarely_and_fed_only_before_probes() -> None:
    ctrl = _lookup_ctrl(prior={"dynamic": [0.0] * 4, "lookup": [0.0] * 9}, probe_every=8, warm_cycles=8)
    plans, captures = [], []
    for _ in range(400):
        plan = ctrl.choose_plan(1000, lookup=0)
        captures.append(ctrl.wants_features())
        if plan.depth:
            ctrl.observe(plan.depth, 0, plan.kind)
        plans.append(plan)
    probes = [i for i, p in enumerate(plans) if p.depth]
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)][:4] == [16, 32, 64, 64]  # backing off to 8x
    assert all(plans[i].depth == 1 for i in probes)  # the most promising model plan of a drafter that never pays
    assert sum(captures) <= len(probes) * 9 + 16  # features only in the 8 cycles before each probe (and the first)
    for i in probes[2:]:
        assert all(captures[i - 8:i + 1]) and not any(captures[i - 20:i - 9])


def test_a_model_plan_waits_for_fresh_positions() -> None:
    ctrl = _lookup_ctrl(prior={"dynamic": [0.9] * 4, "lookup": [0.0] * 9})
    assert ctrl.choose_plan(1000, lookup=0, model_ready=False) == Plan()
    assert ctrl.report()["deferred"] == 1 and ctrl.wants_features()
    assert ctrl.choose_plan(1000, lookup=0, model_ready=True).depth > 0


def test_whole_cycles_that_take_longer_than_their_parts_slow_their_plan_down() -> None:
    """Verify forwards right after drafting run slower than back to back (the target's weights leave the caches):
    the tables do not see it, the measured start-to-start seconds do, and the model plan loses to plain."""
    ctrl = _lookup_ctrl(prior={"dynamic": [0.5] * 4})
    model = max((Plan("dynamic", d) for d in range(1, 5)), key=ctrl.plan_rate)
    assert ctrl.plan_rate(model) > ctrl.plan_rate(Plan())
    for _ in range(40):  # model cycles take 1.8x their prediction, plain cycles what the tables say
        ctrl.cost.observe_total("model", ctrl.plan_seconds(model), 1.8 * ctrl.plan_seconds(model))
        ctrl.cost.observe_total("plain", ctrl.plan_seconds(Plan()), ctrl.plan_seconds(Plan()))
    assert ctrl.cost.scale_of("model") == pytest.approx(1.8, rel=0.01) and ctrl.cost.scale_of("plain") == 1.0
    assert ctrl.plan_rate(model) < ctrl.plan_rate(Plan()) and ctrl.choose_plan(1000).depth == 0
    ctrl.cost.observe_total("model", 1.0, 100.0)  # one preempted cycle moves the scale by at most a step of 3x
    assert ctrl.cost.scale_of("model") < 2.1


def test_a_continuation_is_cut_where_its_nodes_stop_paying() -> None:
    ctrl = _lookup_ctrl(prior={"dynamic": [0.05] * 4, "lookup": [0.9, 0.9, 0.02, 0.9, 0.9, 0.9]})
    plan = ctrl.choose_plan(1000, lookup=6)
    assert (plan.source, plan.lookup) == ("lookup", 2)  # the third token is rarely right: nothing past it pays
