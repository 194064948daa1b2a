"""Adaptive speculation: how deep to draft this cycle, or whether to draft at all.

Model (per cycle): drafting to depth d yields E(d) = 1 + sum_{k<=d} prod_{j<=k} a_j committed tokens in
expectation (`metrics.simulated_tau` of the request's recent per-position acceptance a_k, an EWMA over its
own verification cycles, seeded from the engine's previous requests) and costs draft(d) + cycle(1 + nodes(d))
seconds, where `CostModel` holds the MEASURED costs of this machine: seconds per target cycle by verified node
count (piecewise linear), per chosen depth the proposing seconds and the number of draft nodes it produced, and
the seconds the drafter takes to absorb a cycle's committed tokens. All are seeded by a calibration on the first
request (best of 3 warm runs) and then follow the measured cycles (an EWMA whose steps are clamped to [0.5x, 2x]
of the estimate, so a preempted or cache-cold cycle cannot swing it). The controller picks the depth with the
highest expected tokens/s, and plain decoding (a root-only cycle, 1 token per cycle(1)) when no depth beats it;
while off it still probes one speculative cycle at the most promising depth after `probe_every` plain cycles
(the interval doubles, up to 8x, while probes keep losing) to refresh the estimates, and it
leaves speculation only when plain decoding is clearly (5%) faster. While drafting below the maximum depth, every
`explore_every`-th speculative cycle drafts one level deeper than the best depth: acceptance at a depth is only
observed when that depth is drafted, so without it a depth that once looked poor would never be tried again (on the
house target the estimates of depths 3-5 stayed at their first low values while fixed depth-5 trees committed 3.5
tokens per cycle against the controller's 2.5). A request starts from the engine's `AcceptanceMemory`: the
acceptance of every earlier request's cycles at the same temperature (counts that decay over a few hundred cycles),
regularised towards the next shallower depth's estimate where a depth was rarely drafted. It used to start from the
previous request's estimate pulled halfway back to a neutral 0.6, whatever that request's temperature: the house
EAGLE-3 export's depths 3-5 then stayed near 0.6 against a measured 0.75-0.85, and at T = 1 the controller drafted
depth 2 in most cycles (tau 2.3-2.8 adaptive vs 3.0 for fixed depth-5 chains, and slower than those chains). On
one engine serving each request at T = 0 and then at T = 1, the memory took T = 1 from 1.12x to 1.19-1.29x plain
decoding (docs/benchmarks.md).
Speculation is off from the start for short outputs (max_new_tokens < `short_output_tokens`).

Tree kinds: the same model chooses WHAT to draft. Given `kinds` (the configured tree kind first; at T > 0 with a
drafter that samples its own law the engine adds "chain" — a sampled chain, verified by block verification — and
"sampled" — a sampled spine with siblings, verified by traversal verification), the controller keeps acceptance
estimates and drafting costs per kind and picks the (kind, depth) with the highest expected tokens/s; its
exploration alternates between one level deeper and the kind tried least recently. The verification mode of each
kind is fixed by the kind (block / traversal never accept fewer tokens than token-wise verification of the same
draft, at the same cost), so choosing the kind is choosing the verifier where it wins.

Every choice is counted in `report()` (the engine's `stats.adaptive`). Choosing a depth or a kind never changes
the output distribution: any tree, including the root alone, is verified losslessly, and the choice depends only
on earlier cycles.

Not here: tree shapes (drafters), timing the cycles (the engine measures and reports them here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from speculators.core.metrics import simulated_tau

_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class CostModel:
    """Measured seconds of one target cycle (forward + verify + commit) by verified node count, and of drafting.

    Cycle costs are kept per size bucket (1, 2-3, 4-7, 8-15, ... nodes: an EWMA of the node count and of the
    seconds seen in each bucket) and interpolated piecewise-linearly between buckets: on CPUs a 1-token forward
    (matrix-vector products) is much cheaper than a 2-token one, after which the cost grows slowly, so one straight
    line fits badly.

    The buckets hold every kind's cycles (the calibration's are greedy chains), but a cycle also costs what its tree's
    shape and verifier cost: a sampled tree's forward runs an ancestor mask and traversal verification makes target
    laws for more nodes (house target, T = 1, depth 5: 9.1 ms per cycle for a sampled tree of 11 nodes, 7.5 ms for a
    chain of 6). `excess` keeps, per kind, an EWMA of how much longer (or shorter) its cycles took than the buckets
    predicted, and `rate` adds it."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean nodes, mean seconds)
    # per tree kind ("" when the caller drafts one kind only): depth -> proposing seconds per cycle (absorb: below)
    draft: dict[str, dict[int, float]] = field(default_factory=dict)
    nodes: dict[str, dict[int, float]] = field(default_factory=dict)  # kind -> depth -> verified draft nodes
    absorb: float | None = None  # seconds the drafter takes to absorb one cycle's committed tokens
    excess: dict[str, float] = field(default_factory=dict)  # kind -> its cycles' seconds beyond `cycle(nodes)`
    smoothing: float = 0.2

    @staticmethod
    def _bucket(nodes: int) -> int:
        return max(b for b in _BUCKETS if b <= max(1, nodes)) if nodes < _BUCKETS[-1] else _BUCKETS[-1]

    def _ewma(self, old: float | None, new: float) -> float:
        if old is None:
            return new
        if old > 0:  # a preempted (or unusually lucky) cycle must not swing the estimate
            new = min(max(new, 0.5 * old), 2 * old)
        return old + self.smoothing * (new - old)

    @classmethod
    def from_measurements(cls, cycle: dict[int, float], draft: dict[int, float] | None = None,
                          nodes: dict[int, float] | None = None, absorb: float | None = None,
                          kind: str = "") -> CostModel:
        """A fixed model from measured tables (the speedup oracle's): cycle seconds by verified node count (root
        included; every count is its own interpolation point, not bucketed), proposing seconds and draft nodes by
        depth (of tree `kind`), absorb seconds per speculative cycle."""
        return cls(points={n: (float(n), float(t)) for n, t in cycle.items()}, draft={kind: dict(draft or {})},
                   nodes={kind: {d: float(v) for d, v in (nodes or {}).items()}}, absorb=absorb)

    def rate(self, acceptance: list[float], depth: int, kind: str = "") -> float:
        """Expected committed tokens per second of one cycle drafting a `kind` tree to `depth` with per-position
        acceptance a_k (0 = plain decoding): E(depth) / (draft(depth) + cycle(1 + nodes(depth))), E =
        `simulated_tau`. The ONE formula the adaptive controller and the speedup oracle (`oracle.py`) share."""
        if depth == 0:
            return 1.0 / max(self.cycle(1), 1e-9)
        seconds = self.draft_cost(depth, kind) + self.cycle_of(1 + self.draft_nodes(depth, kind), kind)
        return simulated_tau(acceptance[:depth]) / max(seconds, 1e-9)

    def set_cycle(self, nodes: int, seconds: float) -> None:
        """Seed one size from a calibration run."""
        self.points[self._bucket(nodes)] = (float(nodes), seconds)

    def observe_cycle(self, nodes: int, seconds: float, kind: str = "") -> None:
        """A measured cycle of `nodes` nodes (root included) of a `kind` tree ("" = the root alone, or not known)."""
        if kind and self.points:  # the kind's difference from the shared buckets (a spike moves it by <= 1 cycle)
            predicted = self.cycle(nodes)
            gap = min(max(seconds - predicted, -0.5 * predicted), predicted)
            old = self.excess.get(kind)
            self.excess[kind] = gap if old is None else old + self.smoothing * (gap - old)
        b = self._bucket(nodes)
        if b not in self.points:
            self.points[b] = (float(nodes), seconds)
            return
        n_old, t_old = self.points[b]
        self.points[b] = (n_old + self.smoothing * (nodes - n_old), self._ewma(t_old, seconds))

    def set_draft(self, depth: int, drafted_nodes: int, seconds: float, kind: str = "") -> None:
        """Seed one depth of one tree kind from a calibration run."""
        self.draft.setdefault(kind, {})[depth] = seconds
        self.nodes.setdefault(kind, {})[depth] = float(drafted_nodes)

    def observe_absorb(self, seconds: float) -> None:
        """The drafter absorbing one speculative cycle's committed tokens (paid once per speculative cycle)."""
        self.absorb = self._ewma(self.absorb, seconds)

    def observe_draft(self, depth: int, drafted_nodes: int, seconds: float, kind: str = "") -> None:
        """A speculative cycle at `depth` of a tree `kind`: its proposing seconds and draft nodes."""
        if depth > 0:
            draft, nodes = self.draft.setdefault(kind, {}), self.nodes.setdefault(kind, {})
            draft[depth] = self._ewma(draft.get(depth), seconds)
            old = nodes.get(depth)
            nodes[depth] = drafted_nodes if old is None else old + self.smoothing * (drafted_nodes - old)

    def _per_depth(self, table: dict[int, float], depth: int, default: float) -> float:
        """table[depth], else the nearest measured depth scaled linearly, else `default`."""
        if depth in table:
            return table[depth]
        if not table:
            return default
        near = min(table, key=lambda d: abs(d - depth))
        return table[near] * depth / near

    def draft_cost(self, depth: int, kind: str = "") -> float:
        """Seconds of drafting a `kind` tree to `depth` in one cycle: absorbing the last cycle's tokens, then
        proposing."""
        return (self.absorb or 0.0) + self._per_depth(self.draft.get(kind, {}), depth, 0.0)

    def draft_nodes(self, depth: int, kind: str = "") -> float:
        return self._per_depth(self.nodes.get(kind, {}), depth, float(depth))

    @property
    def calibrated(self) -> bool:
        return 1 in self.points and len(self.points) >= 2

    def cycle(self, nodes: float) -> float:
        """Interpolated seconds of a cycle verifying `nodes` nodes (root included). A bigger cycle is taken to cost
        at least what any smaller one measured: noisy buckets had rated a 4-node cycle at 4.9 ms under a 1-node one's
        5.8, and the controller then drafted depth 2-3 chains where depth 5 decodes faster."""
        if not self.points:
            return 0.0
        pts, most = [], 0.0
        for n, t in sorted(self.points.values()):
            most = max(most, t)
            pts.append((n, most))
        if nodes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if nodes <= n1:
                return t0 + (t1 - t0) * (nodes - n0) / max(n1 - n0, 1e-9)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / max(n1 - n0, 1e-9)) * (nodes - n1)

    def cycle_of(self, nodes: float, kind: str = "") -> float:
        """Seconds of a cycle verifying `nodes` nodes of a `kind` tree: `cycle` + the kind's measured excess."""
        return self.cycle(nodes) + self.excess.get(kind, 0.0)

    def to_dict(self) -> dict:
        ms = lambda x: None if x is None else round(1000 * x, 3)  # noqa: E731
        return {"cycle_ms_by_nodes": {str(round(n, 1)): ms(t) for n, t in sorted(self.points.values())},
                "cycle_excess_ms_by_kind": {k: ms(v) for k, v in sorted(self.excess.items())},
                "draft_ms_by_depth": {k: {str(d): ms(t) for d, t in sorted(v.items())} for k, v in self.draft.items()},
                "absorb_ms": ms(self.absorb),
                "draft_nodes_by_depth": {k: {str(d): round(n, 2) for d, n in sorted(v.items())}
                                         for k, v in self.nodes.items()}}


@dataclass
class AcceptanceMemory:
    """Per-position acceptance of an engine's earlier cycles, by temperature and tree kind: what a new request's
    estimates start from.

    For each (temperature, kind) it keeps per depth k the decayed counts of cycles that reached depth k (all
    shallower drafts accepted) and of those that accepted it; a request adds its own counts when it ends, after the
    older ones decay by 0.5 per `half_life` cycles of the new request, so the memory follows a workload that
    changes. The estimate at depth k is (hits + w * c) / (tries + w), with `prior_weight` pseudo-cycles w at
    c = the estimate at depth k - 1 (`default` at depth 0): a depth that is rarely drafted is believed to be about
    as good as the one above it rather than a fixed 0.6, which kept deep drafts from ever being chosen.
    Temperatures are kept to one decimal (0 = greedy; all above 2 as 2); a temperature not yet seen starts from the
    nearest one seen of the same kind."""

    MAX_BUCKET: ClassVar[float] = 2.0
    half_life: float = 512.0
    prior_weight: float = 4.0
    default: float = 0.6
    counts: dict[tuple[float, str], list[tuple[float, float]]] = field(default_factory=dict)  # -> [(tries, hits)]

    @staticmethod
    def bucket(temperature: float) -> float:
        """Temperatures to one decimal, those above `MAX_BUCKET` together: at most 21 keys per kind, whatever
        temperatures clients send."""
        return min(round(float(temperature), 1), AcceptanceMemory.MAX_BUCKET)

    def add(self, temperature: float, kind: str, counts: list[tuple[int, int]], cycles: int) -> None:
        """Fold one request's per-depth (tries, hits) of `kind` into the memory; `cycles`: how many speculative
        cycles that request drafted (they set how much the older counts decay)."""
        if not any(tries for tries, _ in counts):
            return
        key = (self.bucket(temperature), kind)
        decay = 0.5 ** (cycles / self.half_life)
        old = self.counts.get(key, [])
        size = max(len(old), len(counts))
        pad = lambda xs: list(xs) + [(0, 0)] * (size - len(xs))  # noqa: E731
        self.counts[key] = [(decay * t0 + t1, decay * h0 + h1) for (t0, h0), (t1, h1) in zip(pad(old), pad(counts),
                                                                                            strict=True)]

    def estimates(self, temperature: float, kind: str, depth: int) -> list[float]:
        """[depth] per-position acceptance estimates of `kind` at `temperature` (see the class docstring)."""
        seen = [b for b, k in self.counts if k == kind and (b == 0) == (self.bucket(temperature) == 0)]
        near = min(seen, key=lambda b: abs(b - self.bucket(temperature)), default=None)
        counts = self.counts.get((near, kind), []) if near is not None else []
        out, centre = [], self.default
        for k in range(depth):
            tries, hits = counts[k] if k < len(counts) else (0.0, 0.0)
            centre = (hits + self.prior_weight * centre) / (tries + self.prior_weight)
            out.append(centre)
        return out


@dataclass
class AdaptiveDepth:
    """Per-request depth controller (see module docstring)."""

    cost: CostModel
    max_depth: int
    max_new_tokens: int
    enabled: bool = True
    # a_k seeds (the engine's `AcceptanceMemory`): of the first kind, or per kind; `default_acceptance` elsewhere
    prior: list[float] | dict[str, list[float]] = field(default_factory=list)
    short_output_tokens: int = 8
    probe_every: int = 8
    explore_every: int = 8
    # per-depth acceptance EWMA step: 0.3 let one rejected draft at a depth drop its estimate by 30% and keep
    # trees shallow (house target, code cohorts: 1.75x plain vs 1.80x with 0.1, tau 2.95 vs 3.31)
    smoothing: float = 0.1
    default_acceptance: float = 0.6
    kinds: tuple[str, ...] = ("",)  # tree kinds to choose among (cost model keys); the first is the configured one

    def __post_init__(self) -> None:
        priors = self.prior if isinstance(self.prior, dict) else {self.kinds[0]: self.prior}
        self.estimates: dict[str, list[float]] = {
            kind: [priors.get(kind, [])[k] if k < len(priors.get(kind, [])) else self.default_acceptance
                   for k in range(self.max_depth)] for kind in self.kinds}
        # per kind and depth: (cycles that reached the depth, cycles that accepted it), for the engine's memory
        self.counts: dict[str, list[tuple[int, int]]] = {kind: [(0, 0)] * self.max_depth for kind in self.kinds}
        self.kind = self.kinds[0]  # the kind of the last choice
        self.depth_histogram: dict[int, int] = {}
        self.kind_histogram: dict[str, int] = {}
        self.plain_cycles = 0  # cycles the controller chose not to draft
        self.probe_cycles = 0
        self.explore_cycles = 0  # speculative cycles drafted one level deeper, or of another kind, than the best
        self.turned_off = 0  # times it switched from drafting to plain
        self._since_explore = 0
        self._explored = 0
        self._last_tried = {kind: 0 for kind in self.kinds}  # cycle count when each kind was last drafted
        self._cycles = 0
        self._plain_streak = 0
        self._last_depth = 0
        self._probe_interval = self.probe_every
        if self.max_depth <= 0:
            self.mode = "off: the drafter proposes nothing (plain decoding)"
        elif not self.enabled:
            self.mode = f"fixed depth {self.max_depth}"
        elif self.max_new_tokens < self.short_output_tokens:
            self.mode = (f"off: short output (max_new_tokens={self.max_new_tokens} < "
                         f"{self.short_output_tokens})")
        else:
            self.mode = "adaptive"

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
        (0 = plain): `CostModel.rate` with this kind's acceptance estimates."""
        kind = kind or self.kinds[0]
        return self.cost.rate(self.estimates[kind], depth, kind)

    def _best_depth(self, kind: str, limit: int) -> int:
        return max(range(1, limit + 1), key=lambda d: self.rate(d, kind))

    def choose(self, remaining: int) -> int:
        """Depth to draft this cycle (0 = plain); `remaining` tokens are still to be generated."""
        return self.choose_plan(remaining)[1]

    def choose_plan(self, remaining: int) -> tuple[str, int]:
        """(tree kind, depth) to draft this cycle (depth 0 = plain); `remaining` tokens are still to be generated."""
        limit = min(self.max_depth, remaining - 1)
        kind = self.kinds[0]
        if limit <= 0 or self.mode.startswith("off"):
            depth = 0
        elif self.mode != "adaptive" or not self.cost.calibrated:
            depth = limit
        else:
            kind, best = max(((k, self._best_depth(k, limit)) for k in self.kinds), key=lambda kd: self.rate(kd[1], kd[0]))
            # hysteresis: leave speculation only when plain decoding is clearly (5%) faster
            depth = best if self.rate(best, kind) * (1.05 if self._last_depth > 0 else 1.0) > self.rate(0) else 0
            if depth > 0:
                self._probe_interval = self.probe_every
                self._since_explore += 1
                if self._since_explore >= self.explore_every:
                    kind, depth = self._explore(kind, depth, limit)
            elif self._plain_streak + 1 >= self._probe_interval:
                depth = best  # probe the most promising plan; back off while probes keep losing
                self.probe_cycles += 1
                self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
        self._cycles += 1
        if depth == 0:
            self.plain_cycles += 1
            self._plain_streak += 1
            self.turned_off += 1 if self._last_depth > 0 else 0
        else:
            self._plain_streak = 0
            self._last_tried[kind] = self._cycles
            self.kind_histogram[kind] = self.kind_histogram.get(kind, 0) + 1
        self.kind = kind
        self._last_depth = depth
        self.depth_histogram[depth] = self.depth_histogram.get(depth, 0) + 1
        return kind, depth

    def _explore(self, kind: str, depth: int, limit: int) -> tuple[str, int]:
        """An exploring cycle instead of the best plan: alternately one level deeper and (with several kinds) the
        kind drafted least recently, at its own best depth."""
        others = [k for k in self.kinds if k != kind]
        if others and (self._explored % 2 == 1 or depth >= limit):
            other = min(others, key=lambda k: self._last_tried[k])
            kind, depth = other, self._best_depth(other, limit)
        elif depth < limit:
            depth += 1
        else:
            return kind, depth
        self._explored += 1
        self.explore_cycles += 1
        self._since_explore = 0
        return kind, depth

    def observe(self, drafted_depth: int, accepted: int, kind: str | None = None) -> None:
        """Update a_k of `kind` (default: the last chosen) for the depths this cycle tried (a depth is tried iff all
        shallower ones were accepted)."""
        estimate, counts = self.estimates[kind or self.kind], self.counts[kind or self.kind]
        for k in range(min(drafted_depth, accepted + 1)):
            hit = 1.0 if accepted > k else 0.0
            estimate[k] += self.smoothing * (hit - estimate[k])
            counts[k] = (counts[k][0] + 1, counts[k][1] + int(hit))

    def report(self) -> dict:
        return {
            "mode": self.mode,
            "depth_histogram": {str(k): v for k, v in sorted(self.depth_histogram.items())},
            "plain_cycles": self.plain_cycles, "probe_cycles": self.probe_cycles,
            "explore_cycles": self.explore_cycles, "turned_off": self.turned_off,
            "acceptance_estimate": [round(a, 3) for a in self.acceptance],
            "kind_histogram": dict(sorted(self.kind_histogram.items())),
            "acceptance_by_kind": {k: [round(a, 3) for a in v] for k, v in self.estimates.items()},
            "cost": self.cost.to_dict(),
        }
