"""A counted-work simulation of the plan controller (runtime/adaptive.py): requests of cycles in which the model
drafter's and the prompt lookup's tokens are accepted with known per-position probabilities, on a fixed table of
cycle costs, so a test can compare what the controller commits per second with what each of its parts alone
commits, and count the cycles it spends on a drafter that never pays. No target, no wall clock: a cycle costs what
the table says (the same table the controller rates plans with; issue 55's costs-per-machine item is elsewhere).

What it models: the lookup finds a continuation in a share of cycles (`lookup_share`) and is scored on it whatever
was drafted; a model plan's accepted depth and the lookup's matched length are drawn from their per-position
probabilities; a grafted tree commits 1 + the longer of the two; features are captured when the controller asks, and
a model plan after cycles without them waits (`model_ready`) as the engine's does. Requests run one after another
through one `AcceptanceMemory`, as the engine's sequential requests do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from speculators.runtime.acceptance_memory import AcceptanceMemory
from speculators.runtime.adaptive import LOOKUP, AdaptiveDepth
from speculators.runtime.cycle_costs import CostModel

KIND = "dynamic"
STEP = 0.045  # seconds of a plain step (SmolLM2 on one EPYC thread)
# verify cycles by node count, in plain steps (SmolLM2, 1 thread, after the row-product tuning of stop 59)
CYCLE_STEPS = {1: 1.0, 2: 1.12, 4: 1.3, 8: 1.6, 16: 2.3}
DRAFT_STEPS = 0.02  # proposing, per depth
ABSORB_STEPS = 0.01  # the drafter absorbing one cycle's tokens


def machine_costs() -> CostModel:
    cost = CostModel()
    for nodes, steps in CYCLE_STEPS.items():
        cost.set_cycle(nodes, steps * STEP)
    for depth in range(1, 9):
        cost.set_draft(depth, depth, DRAFT_STEPS * STEP * depth, KIND)
    cost.absorb = ABSORB_STEPS * STEP
    return cost


@dataclass
class Workload:
    """Per-position acceptance of the model drafter (`model`) and of the lookup (`lookup`), the share of cycles
    in which the lookup finds a continuation, and the share in which the model drafter proposes anything (an n-gram
    drafter in the model's place proposes only where it finds a match)."""

    model: list[float]
    lookup: list[float] = field(default_factory=list)
    lookup_share: float = 0.0
    model_share: float = 1.0


@dataclass
class Outcome:
    tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    model_cycles: int = 0
    model_cycles_by_request: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    trace: list[tuple[str, bool]] = field(default_factory=list)  # per cycle: the plan's source, a lookup found

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


def _leading(probs: list[float], n: int, rng: random.Random) -> int:
    """How many of the first n positions are accepted in a row."""
    k = 0
    while k < min(n, len(probs)) and rng.random() < probs[k]:
        k += 1
    return k


def simulate(workloads: list[Workload], parts: str = "both", cycles_per_request: int = 100, seed: int = 0,
             max_depth: int = 4, lookup_depth: int = 6, graft_nodes: int = 3) -> Outcome:
    """Run one request per workload (in order) through the controller with the model drafter ("model"), the lookup
    ("lookup") or both; -> what they committed and the seconds the cost table charged."""
    rng, memory, out = random.Random(seed), AcceptanceMemory(), Outcome()
    depth = max_depth if parts in ("model", "both") else 0
    looks, graft = (lookup_depth, graft_nodes if depth else 0) if parts in ("lookup", "both") else (0, 0)
    for work in workloads:
        prior = {KIND: memory.estimates(0.0, KIND, depth), LOOKUP: memory.estimates(0.0, LOOKUP, max(looks, depth + graft))}
        evidence = {key: memory.evidence(0.0, key, len(values)) for key, values in prior.items()}
        ctrl = AdaptiveDepth(cost=machine_costs(), max_depth=depth, max_new_tokens=10_000, prior=prior,
                             prior_evidence=evidence, kinds=(KIND,),
                             lookup_depth=looks, graft_nodes=graft, graftable=(KIND,),
                             probe_interval=memory.probe_interval(0.0), off_streak=memory.off_streak(0.0))
        captured, model_cycles = True, 0
        for _ in range(cycles_per_request):
            found = lookup_depth if (looks or graft) and rng.random() < work.lookup_share else 0
            plan = ctrl.choose_plan(10_000, found, model_ready=captured)
            captured = ctrl.wants_features()
            matched = _leading(work.lookup, found, rng) if found else 0
            proposes = bool(plan.depth) and rng.random() < work.model_share
            accepted = _leading(work.model, plan.depth, rng) if proposes else 0
            if plan.depth:
                ctrl.observe(plan.depth if proposes else 0, accepted, plan.kind)
                model_cycles += 1
            if found:
                ctrl.observe_lookup(found, matched)
            out.tokens += 1 + max(accepted, min(matched, plan.lookup))
            out.seconds += ctrl.cycle_seconds(plan, proposed=proposes or not plan.depth)
            out.sources[plan.source] = out.sources.get(plan.source, 0) + 1
            out.trace.append((plan.source, bool(found)))
        out.cycles += cycles_per_request
        out.model_cycles += model_cycles
        out.model_cycles_by_request.append(model_cycles)
        memory.add(0.0, KIND, ctrl.counts[KIND], sum(ctrl.kind_histogram.values()))
        memory.add(0.0, LOOKUP, ctrl.lookup_counts, cycles_per_request)
        memory.probes[0.0] = ctrl.next_probe_interval
        memory.off_streaks[0.0] = ctrl.cycles_without_model
    return out
