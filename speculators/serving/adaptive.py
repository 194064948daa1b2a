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
tokens per cycle against the controller's 2.5). A request starts from the engine's previous estimate pulled halfway
back to a neutral default.
Speculation is off from the start for short outputs (max_new_tokens < `short_output_tokens`).

Every choice is counted in `report()` (the engine's `stats.adaptive`). Choosing a depth never changes the
output distribution: any tree, including the root alone, is verified losslessly.

Not here: tree shapes (drafters), timing the cycles (the engine measures and reports them here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculators.metrics import simulated_tau

_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class CostModel:
    """Measured seconds of one target cycle (forward + verify + commit) by verified node count, and of drafting.

    Cycle costs are kept per size bucket (1, 2-3, 4-7, 8-15, ... nodes: an EWMA of the node count and of the
    seconds seen in each bucket) and interpolated piecewise-linearly between buckets: on CPUs a 1-token forward
    (matrix-vector products) is much cheaper than a 2-token one, after which the cost grows slowly, so one straight
    line fits badly."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean nodes, mean seconds)
    draft: dict[int, float] = field(default_factory=dict)  # depth -> proposing seconds per cycle (absorb: below)
    nodes: dict[int, float] = field(default_factory=dict)  # depth -> verified draft nodes per cycle
    absorb: float | None = None  # seconds the drafter takes to absorb one cycle's committed tokens
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
                          nodes: dict[int, float] | None = None, absorb: float | None = None) -> CostModel:
        """A fixed model from measured tables (the speedup oracle's): cycle seconds by verified node count (root
        included; every count is its own interpolation point, not bucketed), proposing seconds and draft nodes by
        depth, absorb seconds per speculative cycle."""
        return cls(points={n: (float(n), float(t)) for n, t in cycle.items()}, draft=dict(draft or {}),
                   nodes={d: float(v) for d, v in (nodes or {}).items()}, absorb=absorb)

    def rate(self, acceptance: list[float], depth: int) -> float:
        """Expected committed tokens per second of one cycle drafting to `depth` with per-position acceptance
        a_k (0 = plain decoding): E(depth) / (draft(depth) + cycle(1 + nodes(depth))), E = `simulated_tau`.
        The ONE formula the adaptive controller and the speedup oracle (`oracle.py`) share."""
        if depth == 0:
            return 1.0 / max(self.cycle(1), 1e-9)
        seconds = self.draft_cost(depth) + self.cycle(1 + self.draft_nodes(depth))
        return simulated_tau(acceptance[:depth]) / max(seconds, 1e-9)

    def set_cycle(self, nodes: int, seconds: float) -> None:
        """Seed one size from a calibration run."""
        self.points[self._bucket(nodes)] = (float(nodes), seconds)

    def observe_cycle(self, nodes: int, seconds: float) -> None:
        b = self._bucket(nodes)
        if b not in self.points:
            self.points[b] = (float(nodes), seconds)
            return
        n_old, t_old = self.points[b]
        self.points[b] = (n_old + self.smoothing * (nodes - n_old), self._ewma(t_old, seconds))

    def set_draft(self, depth: int, drafted_nodes: int, seconds: float) -> None:
        """Seed one depth from a calibration run."""
        self.draft[depth], self.nodes[depth] = seconds, float(drafted_nodes)

    def observe_absorb(self, seconds: float) -> None:
        """The drafter absorbing one speculative cycle's committed tokens (paid once per speculative cycle)."""
        self.absorb = self._ewma(self.absorb, seconds)

    def observe_draft(self, depth: int, drafted_nodes: int, seconds: float) -> None:
        """A speculative cycle at `depth`: its proposing seconds and draft nodes."""
        if depth > 0:
            self.draft[depth] = self._ewma(self.draft.get(depth), seconds)
            old = self.nodes.get(depth)
            self.nodes[depth] = drafted_nodes if old is None else old + self.smoothing * (drafted_nodes - old)

    def _per_depth(self, table: dict[int, float], depth: int, default: float) -> float:
        """table[depth], else the nearest measured depth scaled linearly, else `default`."""
        if depth in table:
            return table[depth]
        if not table:
            return default
        near = min(table, key=lambda d: abs(d - depth))
        return table[near] * depth / near

    def draft_cost(self, depth: int) -> float:
        """Seconds of drafting to `depth` in one cycle: absorbing the last cycle's tokens, then proposing."""
        return (self.absorb or 0.0) + self._per_depth(self.draft, depth, 0.0)

    def draft_nodes(self, depth: int) -> float:
        return self._per_depth(self.nodes, depth, float(depth))

    @property
    def calibrated(self) -> bool:
        return 1 in self.points and len(self.points) >= 2

    def cycle(self, nodes: float) -> float:
        """Interpolated seconds of a cycle verifying `nodes` nodes (root included)."""
        if not self.points:
            return 0.0
        pts = sorted(self.points.values())
        if nodes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if nodes <= n1:
                return t0 + (t1 - t0) * (nodes - n0) / max(n1 - n0, 1e-9)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / max(n1 - n0, 1e-9)) * (nodes - n1)

    def to_dict(self) -> dict:
        ms = lambda x: None if x is None else round(1000 * x, 3)  # noqa: E731
        return {"cycle_ms_by_nodes": {str(round(n, 1)): ms(t) for n, t in sorted(self.points.values())},
                "draft_ms_by_depth": {str(d): ms(t) for d, t in sorted(self.draft.items())},
                "absorb_ms": ms(self.absorb),
                "draft_nodes_by_depth": {str(d): round(n, 2) for d, n in sorted(self.nodes.items())}}


@dataclass
class AdaptiveDepth:
    """Per-request depth controller (see module docstring)."""

    cost: CostModel
    max_depth: int
    max_new_tokens: int
    enabled: bool = True
    prior: list[float] = field(default_factory=list)  # a_k seeds (engine-wide estimate)
    short_output_tokens: int = 8
    probe_every: int = 8
    explore_every: int = 8
    # per-depth acceptance EWMA step: 0.3 let one rejected draft at a depth drop its estimate by 30% and keep
    # trees shallow (house target, code cohorts: 1.75x plain vs 1.80x with 0.1, tau 2.95 vs 3.31)
    smoothing: float = 0.1
    default_acceptance: float = 0.6

    def __post_init__(self) -> None:
        # start from the engine's last estimate pulled halfway back to the default, so one bad request does
        # not keep the next one from drafting
        self.acceptance = [0.5 * (self.prior[k] + self.default_acceptance) if k < len(self.prior)
                           else self.default_acceptance for k in range(self.max_depth)]
        self.depth_histogram: dict[int, int] = {}
        self.plain_cycles = 0  # cycles the controller chose not to draft
        self.probe_cycles = 0
        self.explore_cycles = 0  # speculative cycles drafted one level deeper than the best depth
        self.turned_off = 0  # times it switched from drafting to plain
        self._since_explore = 0
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

    def expected_tokens(self, depth: int) -> float:
        return simulated_tau(self.acceptance[:depth])

    def rate(self, depth: int) -> float:
        """Expected committed tokens per second when drafting to `depth` (0 = plain): `CostModel.rate`."""
        return self.cost.rate(self.acceptance, depth)

    def choose(self, remaining: int) -> int:
        """Depth to draft this cycle (0 = plain); `remaining` tokens are still to be generated."""
        limit = min(self.max_depth, remaining - 1)
        if limit <= 0 or self.mode.startswith("off"):
            depth = 0
        elif self.mode != "adaptive" or not self.cost.calibrated:
            depth = limit
        else:
            best = max(range(1, limit + 1), key=self.rate)
            # hysteresis: leave speculation only when plain decoding is clearly (5%) faster
            depth = best if self.rate(best) * (1.05 if self._last_depth > 0 else 1.0) > self.rate(0) else 0
            if depth > 0:
                self._probe_interval = self.probe_every
                self._since_explore += 1
                if depth < limit and self._since_explore >= self.explore_every:
                    depth += 1
                    self.explore_cycles += 1
                    self._since_explore = 0
            elif self._plain_streak + 1 >= self._probe_interval:
                depth = best  # probe the most promising depth; back off while probes keep losing
                self.probe_cycles += 1
                self._probe_interval = min(8 * self.probe_every, 2 * self._probe_interval)
        if depth == 0:
            self.plain_cycles += 1
            self._plain_streak += 1
            self.turned_off += 1 if self._last_depth > 0 else 0
        else:
            self._plain_streak = 0
        self._last_depth = depth
        self.depth_histogram[depth] = self.depth_histogram.get(depth, 0) + 1
        return depth

    def observe(self, drafted_depth: int, accepted: int) -> None:
        """Update a_k for the depths this cycle tried (a depth is tried iff all shallower ones were accepted)."""
        for k in range(min(drafted_depth, accepted + 1)):
            hit = 1.0 if accepted > k else 0.0
            self.acceptance[k] += self.smoothing * (hit - self.acceptance[k])

    def report(self) -> dict:
        return {
            "mode": self.mode,
            "depth_histogram": {str(k): v for k, v in sorted(self.depth_histogram.items())},
            "plain_cycles": self.plain_cycles, "probe_cycles": self.probe_cycles,
            "explore_cycles": self.explore_cycles, "turned_off": self.turned_off,
            "acceptance_estimate": [round(a, 3) for a in self.acceptance],
            "cost": self.cost.to_dict(),
        }
