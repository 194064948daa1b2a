"""`AcceptanceMemory`: the per-position acceptance of an engine's earlier cycles, by temperature and draft source
(a model drafter's tree kind, or "lookup"), from which a new request's estimates start, and the probe interval the
last request at each temperature ended with.

Not here: the per-request estimates and the plan choice (adaptive.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


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
    prior_weight: float = 1.0  # 4 held a drafter that never paid at 0.16 after 11 missed cycles: above break-even
    default: float = 0.6
    counts: dict[tuple[float, str], list[tuple[float, float]]] = field(default_factory=dict)  # -> [(tries, hits)]
    probes: dict[float, int] = field(default_factory=dict)  # temperature bucket -> the last request's probe interval
    # temperature bucket -> the cycles without the model drafter the last request ended with: the next request goes on
    # counting toward its probe (requests shorter than the interval would otherwise never probe a drafter again)
    off_streaks: dict[float, int] = field(default_factory=dict)
    # (temperature bucket, kind) -> decayed (cycles drafted with the model, cycles in which it proposed anything): a
    # drafter that may propose nothing (prompt lookup in the model's place) starts each request at the traffic's share
    shares: dict[tuple[float, str], tuple[float, float]] = field(default_factory=dict)

    def add_share(self, temperature: float, kind: str, cycles: int, proposals: int) -> None:
        """Fold one request's drafted `cycles` of `kind`, `proposals` of which proposed anything, into the memory
        (the older counts decay as in `add`)."""
        if cycles <= 0:
            return
        key, decay = (self.bucket(temperature), kind), 0.5 ** (cycles / self.half_life)
        seen, proposed = self.shares.get(key, (0.0, 0.0))
        self.shares[key] = (decay * seen + cycles, decay * proposed + proposals)

    def share(self, temperature: float, kind: str) -> tuple[float, float] | None:
        """(the share of `kind`'s drafted cycles that proposed anything, the decayed cycles behind it) at this
        temperature; None before any."""
        seen, proposed = self.shares.get((self.bucket(temperature), kind), (0.0, 0.0))
        return (proposed / seen, seen) if seen > 0 else None

    def off_streak(self, temperature: float) -> int:
        return self.off_streaks.get(self.bucket(temperature), 0)

    def probe_interval(self, temperature: float) -> int:
        """The probe interval the last request at this temperature ended with (0: none yet)."""
        return self.probes.get(self.bucket(temperature), 0)

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

    def _nearest(self, temperature: float, kind: str) -> list[tuple[float, float]]:
        """The (tries, hits) per depth of `kind` at the nearest temperature seen (greedy and sampled apart)."""
        seen = [b for b, k in self.counts if k == kind and (b == 0) == (self.bucket(temperature) == 0)]
        near = min(seen, key=lambda b: abs(b - self.bucket(temperature)), default=None)
        return self.counts.get((near, kind), []) if near is not None else []

    def evidence(self, temperature: float, kind: str, depth: int) -> list[float]:
        """[depth] decayed cycles behind each of `estimates`' values (0 where nothing was seen)."""
        counts = self._nearest(temperature, kind)
        return [counts[k][0] if k < len(counts) else 0.0 for k in range(depth)]

    def estimates(self, temperature: float, kind: str, depth: int) -> list[float]:
        """[depth] per-position acceptance estimates of `kind` at `temperature` (see the class docstring)."""
        counts = self._nearest(temperature, kind)
        out, centre = [], self.default
        for k in range(depth):
            tries, hits = counts[k] if k < len(counts) else (0.0, 0.0)
            centre = (hits + self.prior_weight * centre) / (tries + self.prior_weight)
            out.append(centre)
        return out
