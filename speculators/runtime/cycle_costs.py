"""What a cycle costs on this machine: `CostModel`, the measured seconds of target cycles by verified node count, of
proposing by depth and tree kind, and of the drafter absorbing a cycle's tokens; `rate` turns them and per-position
acceptance into expected committed tokens per second, the ONE formula the plan controller (adaptive.py) and the
speedup oracle (oracle/) share.

Not here: choosing a plan (adaptive.py), measuring the first request's costs (calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # plan source (plain, lookup, model, model+lookup) -> EWMA of (measured / predicted) seconds of whole cycles
    scale: dict[str, float] = field(default_factory=dict)
    smoothing: float = 0.2
    origin: str = "measured"  # or where the tables were loaded from (runtime/cost_cache.py)
    _cached: tuple = field(default=(None, []), repr=False, compare=False)  # (`_version` it was built at, `_table`)
    _version: int = field(default=0, repr=False, compare=False)  # bumped whenever `points` changes

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
        `simulated_tau`. The ONE formula the adaptive controller and the speedup oracle (`oracle/cost_model.py`)
        share."""
        if depth == 0:
            return 1.0 / max(self.cycle(1), 1e-9)
        seconds = self.draft_cost(depth, kind) + self.cycle_of(1 + self.draft_nodes(depth, kind), kind)
        return simulated_tau(acceptance[:depth]) / max(seconds, 1e-9)

    def set_cycle(self, nodes: int, seconds: float) -> None:
        """Seed one size from a calibration run."""
        self.points[self._bucket(nodes)] = (float(nodes), seconds)
        self._version += 1

    def observe_cycle(self, nodes: int, seconds: float, kind: str = "") -> None:
        """A measured cycle of `nodes` nodes (root included) of a `kind` tree ("" = the root alone, or not known)."""
        if kind and self.points:  # the kind's difference from the shared buckets (a spike moves it by <= 1 cycle)
            predicted = self.cycle(nodes)
            gap = min(max(seconds - predicted, -0.5 * predicted), predicted)
            old = self.excess.get(kind)
            self.excess[kind] = gap if old is None else old + self.smoothing * (gap - old)
        b = self._bucket(nodes)
        self._version += 1
        if b not in self.points:
            self.points[b] = (float(nodes), seconds)
            return
        n_old, t_old = self.points[b]
        self.points[b] = (n_old + self.smoothing * (nodes - n_old), self._ewma(t_old, seconds))

    def observe_total(self, source: str, predicted: float, measured: float) -> None:
        """One whole cycle of a plan from `source`, start to next start (choosing, drafting, the drafter catching up,
        verifying, committing, handing the tokens out) against the seconds its parts predicted. The parts miss what
        the tables cannot see: on the house target a verify forward right after drafting took 11-13 ms against 8-9
        ms back to back (the drafter's weights push the target's out of the CPU's caches), and plain cycles, rare
        while drafting, kept a stale cost. The ratio (each step clamped to [0.5, 3]) scales the plan's rate."""
        if predicted <= 0 or measured <= 0:
            return
        self.scale[source] = self._ewma(self.scale.get(source), min(max(measured / predicted, 0.5), 3.0))

    def scale_of(self, source: str) -> float:
        return self.scale.get(source, 1.0)

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
        pts = self._table()
        if nodes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if nodes <= n1:
                return t0 + (t1 - t0) * (nodes - n0) / max(n1 - n0, 1e-9)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / max(n1 - n0, 1e-9)) * (nodes - n1)

    def _table(self) -> list[tuple[float, float]]:
        """(nodes, seconds) points sorted by nodes, seconds made non-decreasing; rebuilt only when a point changed
        (the controller reads it a dozen times a cycle; `points` change only through `set_cycle` / `observe_cycle`)."""
        if self._cached[0] != self._version:
            pts, most = [], 0.0
            for n, t in sorted(self.points.values()):
                most = max(most, t)
                pts.append((n, most))
            self._cached = (self._version, pts)
        return self._cached[1]

    def cycle_of(self, nodes: float, kind: str = "") -> float:
        """Seconds of a cycle verifying `nodes` nodes of a `kind` tree: `cycle` + the kind's measured excess."""
        return self.cycle(nodes) + self.excess.get(kind, 0.0)

    def state(self) -> dict:
        """Every measured table, exactly (JSON-ready): what `from_state` rebuilds (runtime/cost_cache.py)."""
        by_depth = lambda tables: {k: {str(d): v for d, v in t.items()} for k, t in tables.items()}  # noqa: E731
        return {"points": {str(b): list(p) for b, p in self.points.items()}, "draft": by_depth(self.draft),
                "nodes": by_depth(self.nodes), "absorb": self.absorb, "excess": dict(self.excess),
                "scale": dict(self.scale)}

    @classmethod
    def from_state(cls, state: dict) -> CostModel:
        by_depth = lambda tables: {k: {int(d): float(v) for d, v in t.items()} for k, t in tables.items()}  # noqa: E731
        absorb = state.get("absorb")
        return cls(points={int(b): (float(n), float(t)) for b, (n, t) in state["points"].items()},
                   draft=by_depth(state["draft"]), nodes=by_depth(state["nodes"]),
                   absorb=None if absorb is None else float(absorb),
                   excess={k: float(v) for k, v in state["excess"].items()},
                   scale={k: float(v) for k, v in state["scale"].items()})

    def to_dict(self) -> dict:
        ms = lambda x: None if x is None else round(1000 * x, 3)  # noqa: E731
        return {"origin": self.origin, "cycle_ms_by_nodes": {str(round(n, 1)): ms(t) for n, t in sorted(self.points.values())},
                "cycle_excess_ms_by_kind": {k: ms(v) for k, v in sorted(self.excess.items())},
                "draft_ms_by_depth": {k: {str(d): ms(t) for d, t in sorted(v.items())} for k, v in self.draft.items()},
                "absorb_ms": ms(self.absorb),
                "measured_over_predicted_by_plan": {k: round(v, 3) for k, v in sorted(self.scale.items())},
                "draft_nodes_by_depth": {k: {str(d): round(n, 2) for d, n in sorted(v.items())}
                                         for k, v in self.nodes.items()}}
