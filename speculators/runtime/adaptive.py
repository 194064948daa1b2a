"""The plan controller: per cycle, which way to draft (plain, prompt lookup alone, the model drafter at a depth and
tree kind, or the model drafter with prompt lookup grafted on), by measured expected tokens per second.

Plans (`Plan`): plain decoding (the root alone), prompt lookup alone (a chain of the context's recurring
continuation, `lookup` tokens), the model drafter to `depth` in tree `kind`, and the model drafter with up to
`lookup` prompt-lookup nodes grafted onto its tree (deterministic trees only: sampled drafts carry their laws).
The lookup's continuation is found BEFORE the choice (it is cheap), so the lookup plans exist only in the cycles
where the context has a recurring suffix, and their value is judged on the lookup's own record.

Model (per cycle): a plan's expected committed tokens over its seconds. The model drafter to depth d yields
E(d) = 1 + sum_{k<=d} prod_{j<=k} a_j (`metrics.simulated_tau` of the request's per-position acceptance a_k, see
Estimates below) and costs draft(d) + cycle(1 + nodes(d)) seconds;
the lookup alone to length L yields simulated_tau(b[:L]) for cycle(1 + L), with b_k the lookup's per-position
acceptance; the graft yields 1 + sum_k max(A_k, B_k) (A_k, B_k: the model's and the lookup's chances to reach depth
k; the max, not the union, because the two are right on the same easy tokens) for draft(d) + cycle(1 + nodes(d) +
grafted nodes). `CostModel` (cycle_costs.py) holds the MEASURED costs of this machine, seeded by a calibration on the
first request and then following the measured cycles. Every accepted token is credited to the source that proposed
it: a_k learns from the model's own nodes only; b_k is scored on every cycle whatever was drafted (the engine
compares the lookup's continuation with the tokens the target then commits: at T = 0 a lookup token is accepted iff
it is the target's token, at T > 0 a deterministic proposal x is accepted with probability p(x), the chance that the
committed token is x), so the controller sees the lookup's gain even while it drafts nothing. A model drafter that
may propose nothing (prompt lookup in the model's place: only where the context repeats) keeps a_k and its tables
over the cycles it proposed, and a proposal share s per kind: its plan yields s x the drafted cycle's tokens + (1 - s)
x a plain cycle's, for the same mix of seconds (an empty attempt priced as a plain cycle), so it drafts exactly where its
proposals pay (its estimates per match alone had an n-gram drafter that matched in 5% of cycles draft every cycle
at 0.77x plain; counting empty cycles as misses at the mean node count dropped one that paid, 1.14x -> 1.08x).

Estimates: every a_k and b_k is a mean over decayed evidence. The prior (the engine's `AcceptanceMemory`: what the
server's earlier requests measured, or 0.6 before any) counts as `prior_weight` cycles plus the cycles the memory
holds behind it, at most `max_prior_weight`; each cycle that tried position k adds one (a probe three) after the
older evidence decays by 1 - `smoothing`. With no history the first cycles move an estimate by a third to a fifth
each, where a fixed EWMA step of 0.1 moved it by a tenth (a drafter that never pays drafted 11 cycles before it was
dropped): the evidence condemns a bad drafter within a few cycles, while a prior built from the traffic holds
through a few unlucky misses; later cycles move it by `smoothing`, as before (a larger step made depths look poor
after one rejected draft and kept trees shallow). tests/unit/runtime/test_controller_regret.py measures it.

Off, probes and warm-up: the model drafter is left out when no plan using it beats the best plan without it (by 2%
once it is drafting: hysteresis; while it is out below plain decoding, its plans are rated every `RECHECK_OUT`-th
cycle). While it is out, the controller probes one model plan after `probe_every` cycles
without it (the interval doubles, up to 8x, while probes keep losing; the cycles are counted across the engine's
requests, so a stream of requests shorter than the interval still probes), and the engine captures no hidden states and
feeds the drafter nothing except in the `warm_cycles` cycles before a probe (`wants_features`): the drafter then
restarts from those positions alone (runtime/cycle_steps.py), so a probe costs at most its own cycle plus absorbing
`warm_cycles` cycles' tokens. A plan that needs the model while the drafter has no fresh positions
(`model_ready=False`) falls back to the best plan without it for that cycle and asks for features.
While drafting below the maximum depth, every `explore_every`-th speculative cycle drafts one level deeper than
the best depth, or (with several kinds) the kind tried least recently: acceptance at a depth is only observed when
that depth is drafted (on the house target the estimates of depths 3-5 otherwise stayed at their first low values
while fixed depth-5 trees committed 3.5 tokens per cycle against the controller's 2.5).
Speculation is off from the start for short outputs (max_new_tokens < `short_output_tokens`).

Tree kinds (`kinds`: the configured one first; the engine adds "chain", argmax at T = 0 and block-verified at T > 0,
and at T > 0 "sampled", traversal-verified): acceptance estimates and drafting costs are kept per kind, and a kind
fixes its verifier, so choosing the kind chooses the verifier, or a chain's one node a level, where it wins.

Every choice is counted in `report()` (the engine's `stats.adaptive`: cycles per plan source, per depth and kind).
Choosing a plan never changes the output distribution: any tree, including the root alone, is verified losslessly,
and the choice depends only on earlier cycles and on the committed context.

Not here: tree shapes (drafters), the lookup rule (drafters/ngram.py), timing the cycles (the engine measures and
reports them here), the costs (cycle_costs.py), the memory across requests (acceptance_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculators.core.metrics import simulated_tau
from speculators.runtime.cycle_costs import CostModel


@dataclass(frozen=True)
class Plan:
    """One cycle's way to draft: the model drafter to `depth` in tree `kind` (depth 0: not at all) and `lookup`
    prompt-lookup tokens (a chain alone when depth is 0, else grafted onto the model's tree)."""

    kind: str = ""
    depth: int = 0
    lookup: int = 0

    @property
    def source(self) -> str:
        """plain | lookup | model | model+lookup"""
        if self.depth == 0:
            return "lookup" if self.lookup else "plain"
        return "model+lookup" if self.lookup else "model"


PLAIN = Plan()
LOOKUP = "lookup"  # the lookup's key in `AcceptanceMemory` and in the cost model's per-kind tables
RECHECK_OUT = 4  # while the model drafter is out (no probe due), its plans are rated every this many cycles
HYSTERESIS = 1.02  # leave the model drafter only when a plan without it is faster by 2%: 5% let a drafter that never
# paid stay at up to 0.95x plain (and one proposing in 30% of cycles, which can cost at most 4.5%, stay for good)


@dataclass
class AdaptiveDepth:
    """Per-request plan controller (see module docstring)."""

    cost: CostModel
    max_depth: int
    max_new_tokens: int
    enabled: bool = True
    # a_k seeds (the engine's `AcceptanceMemory`): of the first kind, or per kind (LOOKUP: the lookup's b_k)
    prior: list[float] | dict[str, list[float]] = field(default_factory=list)
    short_output_tokens: int = 8
    probe_every: int = 8
    explore_every: int = 8
    # the decay of older evidence per cycle, i.e. the steady-state step of an estimate: 0.3 let one rejected draft
    # at a depth drop its estimate by 30% and keep trees shallow (house target, code cohorts: 1.75x plain vs 1.80x
    # with 0.1, tau 2.95 vs 3.31)
    smoothing: float = 0.1
    # cycles of evidence a prior counts as (see Estimates in the module docstring): `prior_weight`, plus the cycles
    # behind it in the engine's memory (`prior_evidence`: per kind, per depth), up to `max_prior_weight`
    prior_weight: float = 2.0
    prior_evidence: dict[str, list[float]] = field(default_factory=dict)
    max_prior_weight: float = 8.0
    default_acceptance: float = 0.6
    kinds: tuple[str, ...] = ("",)  # tree kinds to choose among (cost model keys); the first is the configured one
    lookup_depth: int = 0  # the longest lookup chain drafted alone (0: no lookup source)
    graft_nodes: int = 0  # the most lookup nodes grafted onto a model tree (0: no grafting)
    graftable: tuple[str, ...] = ()  # the kinds a lookup may be grafted onto (deterministic trees)
    probe_interval: int = 0  # the first probe's interval (0: probe_every); the engine carries it across requests
    off_streak: int = 0  # cycles without the model drafter before this request (the engine's traffic): see `probes`
    prior_share: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (share, cycles behind it)
    warm_cycles: int = 8  # cycles before a probe in which the engine captures features for the drafter

    def __post_init__(self) -> None:
        priors = self.prior if isinstance(self.prior, dict) else {self.kinds[0]: self.prior}
        seed = lambda key, n: [priors.get(key, [])[k] if k < len(priors.get(key, [])) else  # noqa: E731
                               self.default_acceptance for k in range(n)]
        self.estimates: dict[str, list[float]] = {kind: seed(kind, self.max_depth) for kind in self.kinds}
        # per kind and depth: the decayed cycles of evidence behind each estimate (the prior's included)
        self.weights: dict[str, list[float]] = {kind: self._prior_weights(kind, self.max_depth) for kind in self.kinds}
        # per kind and depth: (cycles that reached the depth, cycles that accepted it), for the engine's memory
        self.counts: dict[str, list[tuple[int, int]]] = {kind: [(0, 0)] * self.max_depth for kind in self.kinds}
        # per kind: the share of its cycles in which the drafter proposed anything (prompt lookup in the model's place
        # proposes only where the context repeats; a trained drafter always does), the evidence behind it (the
        # traffic's as the acceptance's), and this request's (drafted cycles, cycles that proposed) for the memory
        self.proposal_share = {kind: share for kind, (share, _) in self.prior_share.items()}
        self.share_weights = {kind: min(self.max_prior_weight, self.prior_weight + seen)
                              for kind, (_, seen) in self.prior_share.items()}
        self.share_counts: dict[str, tuple[int, int]] = {}
        self.lookup_span = max(self.lookup_depth, self.max_depth + self.graft_nodes) if self.has_lookup else 0
        self.lookup_estimates = seed(LOOKUP, self.lookup_span)
        self.lookup_weights = self._prior_weights(LOOKUP, self.lookup_span)
        self.lookup_counts: list[tuple[int, int]] = [(0, 0)] * self.lookup_span
        self.kind = self.kinds[0]  # the model kind of the last choice
        self.depth_histogram: dict[int, int] = {}
        self.kind_histogram: dict[str, int] = {}
        self.source_histogram: dict[str, int] = {}
        self.accepted_by_source = {"model": 0, LOOKUP: 0}
        self.plain_cycles = 0  # cycles the controller chose not to draft
        self.probe_cycles = 0
        self.explore_cycles = 0  # speculative cycles drafted one level deeper, or of another kind, than the best
        self.turned_off = 0  # times it switched from drafting with the model to drafting without it
        # plan source -> [timed cycles, predicted seconds (as rated), measured seconds (start to next start)]
        self.seconds_by_source: dict[str, list[float]] = {}
        self.deferred = 0  # cycles whose best plan needed the model while the drafter had no fresh positions
        self._since_explore = 0
        self._explored = 0
        self._last_tried = {kind: 0 for kind in self.kinds}  # cycle count when each kind was last drafted
        self._cycles = 0
        self._off_streak = self.off_streak  # cycles since the model last drafted, the earlier requests' included
        self._last = PLAIN
        self._wanted = False
        # a request goes on from the interval and the cycles without the model that the engine's last one ended
        # with: the back-off follows the traffic (capping it at each request start probed a drafter that never pays
        # every 16 cycles of a stream of short requests); a probe that wins counts as 3 cycles of evidence, so a
        # drafter that lost on code and pays on the next request's prose is back within one probe
        self._probe_interval = self.probe_interval or self.probe_every
        self._probing = False
        self._below_plain = False  # the last full rating found every model plan below plain decoding
        self.mode = self._mode()

    def _prior_weights(self, key: str, n: int) -> list[float]:
        seen = self.prior_evidence.get(key, [])
        return [min(self.max_prior_weight, self.prior_weight + (seen[k] if k < len(seen) else 0.0)) for k in range(n)]

    def _mode(self) -> str:
        if self.max_depth <= 0 and not self.has_lookup:
            return "off: the drafter proposes nothing (plain decoding)"
        if not self.enabled:
            return f"fixed depth {self.max_depth}"
        if self.max_new_tokens < self.short_output_tokens:
            return f"off: short output (max_new_tokens={self.max_new_tokens} < {self.short_output_tokens})"
        return "adaptive"

    @property
    def has_lookup(self) -> bool:
        return self.lookup_depth > 0 or self.graft_nodes > 0

    @property
    def acceptance(self) -> list[float]:
        """Per-depth acceptance estimates of the configured (first) kind."""
        return self.estimates[self.kinds[0]]

    @acceptance.setter
    def acceptance(self, values: list[float]) -> None:
        self.estimates[self.kinds[0]] = list(values)

    def expected_tokens(self, depth: int, kind: str | None = None) -> float:
        return simulated_tau(self.estimates[kind or self.kinds[0]][:depth])

    def rate(self, depth: int, kind: str | None = None) -> float:
        """Expected committed tokens per second when drafting a `kind` tree (default: the first kind) to `depth`
        (0 = plain) with the model alone: `CostModel.rate` with this kind's acceptance estimates."""
        kind = kind or self.kinds[0]
        return self.cost.rate(self.estimates[kind], depth, kind)

    def _update_share(self, kind: str, proposed: bool) -> None:
        """A cycle drafted with the model: whether its drafter proposed anything (a mean over decayed evidence)."""
        weight = (1.0 - self.smoothing) * self.share_weights.get(kind, self.prior_weight) + 1.0
        share = self.proposal_share.get(kind, 1.0)
        self.share_weights[kind] = weight
        cycles, proposals = self.share_counts.get(kind, (0, 0))
        self.share_counts[kind] = (cycles + 1, proposals + int(proposed))
        self.proposal_share[kind] = share + (float(proposed) - share) / weight

    def plan_tokens(self, plan: Plan) -> float:
        """Expected committed tokens of one cycle of `plan` (see the module docstring): with the model's proposal
        share s, s x those of its drafted tree + (1 - s) x those of the plan without the model."""
        share = self.proposal_share.get(plan.kind, 1.0) if plan.depth else 1.0
        drafted = self._drafted_tokens(plan)
        return drafted if share >= 1.0 else share * drafted + (1.0 - share) * self._drafted_tokens(
            Plan("", 0, plan.lookup))

    def _drafted_tokens(self, plan: Plan) -> float:
        a = self.estimates[plan.kind] if plan.depth else []
        if plan.lookup == 0:
            return simulated_tau(a[:plan.depth])
        b = self.lookup_estimates
        reach_a = reach_b = tokens = 1.0
        for k in range(max(plan.depth, plan.lookup)):
            reach_a *= a[k] if k < plan.depth else 0.0
            reach_b *= b[k] if k < plan.lookup else 0.0
            tokens += max(reach_a, reach_b)
        return tokens

    def plan_seconds(self, plan: Plan) -> float:
        """Seconds of one cycle of `plan` as the cost tables predict them (drafting, then verifying its nodes); with
        the model's proposal share s < 1, the mean of a drafted cycle and one whose drafter proposed nothing."""
        share = self.proposal_share.get(plan.kind, 1.0) if plan.depth else 1.0
        drafted = self.cycle_seconds(plan, proposed=True)
        return drafted if share >= 1.0 else share * drafted + (1.0 - share) * self.cycle_seconds(plan, proposed=False)

    def cycle_seconds(self, plan: Plan, proposed: bool = True) -> float:
        """Predicted seconds of one cycle of `plan` whose model drafter proposed its tree (else nothing: the lookup's
        nodes alone; a drafter that can come back empty searches for a match, which costs next to nothing, and the
        whole-cycle scale of its plan source absorbs what it does cost)."""
        if plan.depth == 0 or not proposed:
            return self.cost.cycle_of(1 + plan.lookup, LOOKUP if plan.lookup else "")
        nodes = 1 + self.cost.draft_nodes(plan.depth, plan.kind) + plan.lookup
        return self.cost.draft_cost(plan.depth, plan.kind) + self.cost.cycle_of(nodes, plan.kind)

    def plan_rate(self, plan: Plan) -> float:
        """Expected committed tokens per second of `plan`: its tokens over its predicted seconds, scaled by how much
        longer this plan's cycles really took, start to start (`CostModel.scale_of`)."""
        seconds = self.plan_seconds(plan) * self.cost.scale_of(plan.source)
        return self.plan_tokens(plan) / max(seconds, 1e-9)

    def _best_depth(self, kind: str, limit: int) -> int:
        return max(range(1, limit + 1), key=lambda d: self.rate(d, kind))

    def choose(self, remaining: int) -> int:
        """Depth of the model drafter this cycle (0 = plain); `remaining` tokens are still to be generated."""
        return self.choose_plan(remaining).depth

    def choose_plan(self, remaining: int, lookup: int = 0, model_ready: bool = True) -> Plan:
        """This cycle's plan; `remaining` tokens are still to be generated, the lookup found a continuation of
        `lookup` tokens (0: none), and the drafter holds the positions up to the root (`model_ready`)."""
        limit = min(self.max_depth, remaining - 1)
        lookup = max(0, min(lookup, remaining - 1))
        self._probing = False
        if remaining <= 1 or self.mode.startswith("off"):
            plan = PLAIN
        elif self.mode != "adaptive" or not self.cost.calibrated:
            plan = self._fixed(limit, lookup)
        else:
            plan = self._adaptive(limit, lookup, model_ready)
        self._count(plan)
        return plan

    def _fixed(self, limit: int, lookup: int) -> Plan:
        """Fixed (or not yet calibrated) drafting: the model to the limit with its graft, else the lookup alone."""
        kind = self.kinds[0]
        if limit > 0:
            graft = min(lookup, self.graft_nodes) if kind in self.graftable else 0
            return Plan(kind, limit, graft)
        return Plan("", 0, min(lookup, self.lookup_depth))

    def _candidates(self, limit: int, lookup: int) -> tuple[list[Plan], list[Plan]]:
        """(plans without the model, plans with it): plain, the lookup alone at its best length, each kind at its best
        depth, alone and with the lookup grafted on at its best length (a long continuation whose tail is rarely
        right is cut where its nodes stop paying)."""
        without = [PLAIN]
        if lookup and self.lookup_depth:
            without.append(max((Plan("", 0, n) for n in range(1, min(lookup, self.lookup_depth) + 1)),
                               key=self.plan_rate))
        with_model: list[Plan] = []
        for kind in self.kinds if limit > 0 else ():
            depth = self._best_depth(kind, limit)
            with_model.append(Plan(kind, depth))
            graft = min(lookup, self.graft_nodes) if kind in self.graftable else 0
            if graft:
                with_model.append(max((Plan(kind, depth, n) for n in range(1, graft + 1)), key=self.plan_rate))
        return without, with_model

    def _adaptive(self, limit: int, lookup: int, model_ready: bool) -> Plan:
        if (self._below_plain and not lookup and self._last.depth == 0 and not self._wanted
                and self._off_streak + 1 < self._probe_interval and self._cycles % RECHECK_OUT):
            # out, below plain decoding, no lookup this cycle and no probe due: the model's estimates have not moved
            # since it left (only the costs drift), so its plans are rated again every RECHECK_OUT cycles, not every
            # cycle (3 kinds x 5 depths at T > 0 cost ~0.1 ms a cycle, 1.5% of a house-target step)
            return PLAIN
        without, with_model = self._candidates(limit, lookup)
        rates = {plan: self.plan_rate(plan) for plan in without + with_model}
        best_without = max(without, key=rates.__getitem__)
        if not with_model:
            return best_without
        best_with = max(with_model, key=rates.__getitem__)
        bonus = HYSTERESIS if self._last.depth > 0 else 1.0
        use_model = rates[best_with] * bonus > rates[best_without]
        self._below_plain = rates[best_with] * bonus <= rates[PLAIN]
        if not use_model and self._off_streak + 1 < self._probe_interval:
            return best_without
        if not model_ready:  # the drafter has no fresh positions: this cycle without it, features for the next
            self.deferred += 1
            self._wanted = True
            return best_without
        if not use_model:  # probe the most promising plan; back off while probes keep losing
            self.probe_cycles += 1
            self._probing = True
            self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
            return self._probe(best_with)
        self._probe_interval = self.probe_every
        self._since_explore += 1
        return self._explore(best_with, limit) if self._since_explore >= self.explore_every else best_with

    def _probe(self, plan: Plan) -> Plan:
        """A probe drafts no deeper than its estimates are likely to reach (1 + the leading depths estimated at
        >= 0.5): where even the first draft is rarely accepted, the best depth is a coin flip between nearly equal
        rates, and a deep probe would verify nodes that cannot pay."""
        likely = 1 + next((k for k, a in enumerate(self.estimates[plan.kind]) if a < 0.5), self.max_depth)
        return Plan(plan.kind, min(plan.depth, likely), plan.lookup) if plan.depth > likely else plan

    def _count(self, plan: Plan) -> None:
        self._cycles += 1
        if plan.depth == 0:
            self.plain_cycles += plan.lookup == 0
            self._off_streak += 1
            self.turned_off += self._last.depth > 0
        else:
            self._off_streak = 0
            self._wanted = False
            self._last_tried[plan.kind] = self._cycles
            self.kind_histogram[plan.kind] = self.kind_histogram.get(plan.kind, 0) + 1
            self.kind = plan.kind
        self._last = plan
        self.depth_histogram[plan.depth] = self.depth_histogram.get(plan.depth, 0) + 1
        self.source_histogram[plan.source] = self.source_histogram.get(plan.source, 0) + 1

    @property
    def cycles_without_model(self) -> int:
        """The cycles since the model drafter last drafted (earlier requests' included): the next request's start."""
        return self._off_streak

    @property
    def next_probe_interval(self) -> int:
        """The interval before the next probe (back at `probe_every` once the model drafter pays again)."""
        return self._probe_interval

    def wants_features(self) -> bool:
        """Whether this cycle's forward should capture hidden states for the model drafter: it drafted now or is
        drafting, a probe is due within `warm_cycles` cycles, or a plan wanted it while it had no fresh positions."""
        if self.max_depth <= 0 or self.mode.startswith("off"):
            return False
        return (self._last.depth > 0 or self._wanted or self.mode != "adaptive" or not self.cost.calibrated
                or self._probe_interval - self._off_streak <= self.warm_cycles)

    def _explore(self, plan: Plan, limit: int) -> Plan:
        """An exploring cycle instead of the best plan: alternately one level deeper and (with several kinds) the
        kind drafted least recently, at its own best depth."""
        others = [k for k in self.kinds if k != plan.kind]
        if others and (self._explored % 2 == 1 or plan.depth >= limit):
            other = min(others, key=lambda k: self._last_tried[k])
            plan = Plan(other, self._best_depth(other, limit), plan.lookup if other in self.graftable else 0)
        elif plan.depth < limit:
            plan = Plan(plan.kind, plan.depth + 1, plan.lookup)
        else:
            return plan
        self._explored += 1
        self.explore_cycles += 1
        self._since_explore = 0
        return plan

    def observe(self, drafted_depth: int, accepted: int, kind: str | None = None) -> None:
        """Update a_k of `kind` (default: the last chosen) for the depths this cycle tried (a depth is tried iff all
        shallower ones were accepted); `accepted` counts the model's own nodes on the accepted path. A drafter that
        proposed nothing (`drafted_depth` 0: prompt lookup without a match) updates only the kind's proposal share
        (see `proposal_share`)."""
        kind = kind or self.kind
        self._update_share(kind, drafted_depth > 0)
        if drafted_depth == 0:
            return
        self.accepted_by_source["model"] += accepted
        # a probe is the only news of a drafter that is out: it counts as 3 cycles of evidence (else a drafter
        # judged on one cohort stays out on the next, where it pays)
        evidence = 3.0 if self._probing else 1.0
        self._update(self.estimates[kind], self.weights[kind], self.counts[kind], drafted_depth, accepted, evidence)

    def observe_seconds(self, source: str, predicted: float, measured: float) -> None:
        """One timed cycle of a plan from `source`: the seconds it was rated at against the seconds it took."""
        row = self.seconds_by_source.setdefault(source, [0, 0.0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + predicted, row[2] + measured

    def observe_lookup(self, proposed: int, matched: int) -> None:
        """Update b_k from one scored continuation: its first `matched` of `proposed` tokens were committed."""
        self._update(self.lookup_estimates, self.lookup_weights, self.lookup_counts, min(proposed, self.lookup_span),
                     matched)

    def _update(self, estimate: list[float], weights: list[float], counts: list[tuple[int, int]], tried: int,
                accepted: int, evidence: float = 1.0) -> None:
        """The positions this cycle tried (all shallower ones accepted): the older evidence decays by 1 - smoothing,
        this cycle adds `evidence` cycles, and each estimate moves to the new mean."""
        for k in range(min(tried, accepted + 1)):
            hit = 1.0 if accepted > k else 0.0
            weights[k] = (1.0 - self.smoothing) * weights[k] + evidence
            estimate[k] += evidence * (hit - estimate[k]) / weights[k]
            counts[k] = (counts[k][0] + 1, counts[k][1] + int(hit))

    def report(self) -> dict:
        cycles = max(1, self._cycles)
        return {
            "mode": self.mode,
            "depth_histogram": {str(k): v for k, v in sorted(self.depth_histogram.items())},
            "plan_histogram": dict(sorted(self.source_histogram.items())),
            "plan_share": {k: round(v / cycles, 3) for k, v in sorted(self.source_histogram.items())},
            "accepted_by_source": dict(self.accepted_by_source),
            "plain_cycles": self.plain_cycles, "probe_cycles": self.probe_cycles,
            "explore_cycles": self.explore_cycles, "turned_off": self.turned_off, "deferred": self.deferred,
            "acceptance_estimate": [round(a, 3) for a in self.acceptance],
            "lookup_acceptance_estimate": [round(b, 3) for b in self.lookup_estimates],
            "kind_histogram": dict(sorted(self.kind_histogram.items())),
            "proposal_share": {k: round(v, 3) for k, v in sorted(self.proposal_share.items())},
            "cycle_seconds_by_plan": {k: {"cycles": int(n), "predicted": round(p, 6), "measured": round(m, 6)}
                                      for k, (n, p, m) in sorted(self.seconds_by_source.items())},
            "acceptance_by_kind": {k: [round(a, 3) for a in v] for k, v in self.estimates.items()},
            "cost": self.cost.to_dict(),
        }
