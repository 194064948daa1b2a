"""Draft revisions of a running engine: a new one is swapped in between cycles, the previous one kept for rollback,
and each one's acceptance counted apart (the server's /metrics shows them per revision).

`stage_revision(engine, dir)` loads a revision off the serving thread (paired with the engine's target, reading the
same features as the running drafter; else one line and nothing staged) and stages it in the engine's
`DraftRevisions`; the serving thread swaps it in at its next cycle boundary (`apply_staged_revision`). `DraftRevisions`
also keeps the previous revision (`stage_revision(engine, None)` rolls back to it) and `AcceptanceStats` per revision,
recorded per cycle by whichever revision drafted it. Staging and taking are guarded by a lock (an admin request
stages from another thread than the one that serves).

A running request meets the new revision at its next cycle: its drafter state is rebuilt from the positions not yet
absorbed (`cycle_steps.rebind_request`), as after any skipped positions; verification keeps every output lossless
whatever drafts. Not here: which revision to adopt (evaluate/adoption.py), loading weights (drafters/load.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import AcceptanceStats
from speculators.runtime.acceptance_memory import AcceptanceMemory
from speculators.runtime.drafters.graft import NgramGraft
from speculators.runtime.drafters.load import DrafterInfo, load_drafter


def revision_name(info: DrafterInfo) -> str:
    """How /metrics and the admin endpoint name a revision: its draft revision hash, else the drafter's name."""
    return info.revision or info.name


@dataclass
class DraftRevisions:
    running: str
    previous: tuple[Any, DrafterInfo] | None = None  # (drafter, info) swapped out last: rollback target
    staged: tuple[Any, DrafterInfo] | None = None  # a swap waiting for the next cycle boundary
    swaps: int = 0
    stats: dict[str, AcceptanceStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stage(self, drafter: Any, info: DrafterInfo) -> None:
        with self.lock:
            self.staged = (drafter, info)

    def take(self) -> tuple[Any, DrafterInfo] | None:
        """The staged swap (once), or None."""
        if self.staged is None:
            return None
        with self.lock:
            staged, self.staged = self.staged, None
        return staged

    def record(self, revision: str, accepted: int, drafted_depth: int, verified_nodes: int, committed: int) -> None:
        """One cycle drafted by `revision` (then `AcceptanceStats.record`'s arguments)."""
        self.stats.setdefault(revision, AcceptanceStats()).record(accepted, drafted_depth, verified_nodes, committed)

    def report(self) -> dict:
        return {"running": self.running, "previous": revision_name(self.previous[1]) if self.previous else None,
                "staged": revision_name(self.staged[1]) if self.staged else None, "swaps": self.swaps,
                "acceptance": {rev: {"tau": round(s.tau, 4), "target_calls": s.target_calls,
                                     "per_position": [round(a, 4) for a in s.per_position_acceptance]}
                               for rev, s in self.stats.items()}}


def stage_revision(engine: Any, speculator: str | None) -> str:
    """Load the revision in `speculator` (None: the previous one) and stage it; returns its name."""
    if speculator is None:
        if engine.revisions.previous is None:
            raise SpeculatorsError("no previous draft revision to roll back to")
        drafter, info = engine.revisions.previous
    else:
        if not engine.speculative or engine.info.family in ("ngram", "none"):
            raise SpeculatorsError(f"this engine drafts with {engine.info.name}, not a draft model: start it with one to "
                                   "swap revisions")
        drafter, info = load_drafter(speculator, engine.target, ngram_graft=engine.graft_nodes)
        drafter = drafter.drafter if isinstance(drafter, NgramGraft) else drafter
        if info.family != engine.info.family or drafter.required_features() != engine.drafter.required_features():
            raise SpeculatorsError(f"{speculator} is a {info.family} drafter reading {drafter.required_features()}, "
                                   f"but the running one is a {engine.info.family} reading "
                                   f"{engine.drafter.required_features()}; only a revision of the same kind swaps in")
    engine.revisions.stage(drafter, info)
    return revision_name(info)


def apply_staged_revision(engine: Any) -> bool:
    """Swap in a staged revision (on the serving thread, between cycles); whether one was."""
    staged = engine.revisions.take()
    if staged is None:
        return False
    revs = engine.revisions
    revs.previous = (engine.drafter, engine.info)
    engine.drafter, engine.info = staged
    revs.running = revision_name(engine.info)
    revs.swaps += 1
    engine.acceptance_memory = AcceptanceMemory()  # what the last revision accepted says little of the new one
    return True
