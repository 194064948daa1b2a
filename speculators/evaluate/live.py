"""Live acceptance: the bundled runtime (`speculators.runtime.Engine`) generating held-out workload rows.

`run_live` runs rows through one engine — a speculator or the n-gram drafter with a FIXED drafting tree or chain
(adaptive depth off, so every cycle drafts what the prediction assumes) — on the already loaded target, and
returns the runtime's own `metrics.AcceptanceStats` per cohort plus every row's generated ids. These are the
numbers a user of `speculators serve` sees with that tree, next to the predicted numbers of `replay.py`.

This module does not compute acceptance itself (the runtime counts it) and does not write files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from speculators.core import metrics
from speculators.core.sampling import SamplingParams
from speculators.core.workloads import WorkloadRow
from speculators.runtime.engine import Engine


def pick_rows(rows: Sequence[WorkloadRow], per_cohort: int) -> list[WorkloadRow]:
    """The first `per_cohort` rows of every cohort, in file order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r.cohort, 0) < per_cohort:
            seen[r.cohort] = seen.get(r.cohort, 0) + 1
            out.append(r)
    return out


@dataclass
class LiveRun:
    """One engine over some rows at one temperature."""

    stats: dict[str, metrics.AcceptanceStats]  # per cohort, plus "overall"
    outputs: dict[str, list[int]]  # row id -> generated ids
    rows: dict[str, metrics.AcceptanceStats]  # row id -> that row's counters
    tree: dict  # the drafting settings used (TreeConfig as a dict)
    precision: str  # how the drafter computed (float16 weights, ...)

    def to_dict(self) -> dict[str, dict]:
        return {c: s.to_dict() for c, s in self.stats.items()}


def load_engine(target: Any, drafter: str, tree: Any | None, allow_revision_mismatch: bool = False) -> Any:
    """An engine on the loaded target with `drafter` (a speculator dir or "ngram"), alone (no n-gram graft), with
    `tree` (None = the drafter's default tree) and adaptive depth off."""
    return Engine.from_pretrained(target=target, speculator=drafter, tree=tree, adaptive=False,
                                           allow_revision_mismatch=allow_revision_mismatch, ngram_graft=0)


def run_live(engine: Any, rows: Sequence[WorkloadRow], temperature: float, seed: int, desc: str,
             progress: bool = True) -> LiveRun:
    """Generate every row with one engine (seeded: a sampled run is reproducible)."""
    per_cohort: dict[str, metrics.AcceptanceStats] = {}
    overall = metrics.AcceptanceStats()
    outputs: dict[str, list[int]] = {}
    per_row: dict[str, metrics.AcceptanceStats] = {}
    for r in tqdm(rows, desc=desc, unit="row", disable=not progress):
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=float(temperature), seed=seed)
        out = engine.generate(r.messages if r.messages is not None else r.prompt, params)
        per_cohort.setdefault(r.cohort, metrics.AcceptanceStats()).merge(out.stats.acceptance)
        overall.merge(out.stats.acceptance)
        outputs[r.id] = list(out.token_ids)
        per_row[r.id] = out.stats.acceptance
    stats = dict(sorted(per_cohort.items()))
    stats["overall"] = overall
    return LiveRun(stats=stats, outputs=outputs, rows=per_row, tree={**dataclasses.asdict(engine.tree), "adaptive": engine.adaptive},
                   precision=getattr(engine.info, "precision", "") or "")
