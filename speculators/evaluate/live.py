"""Live acceptance: the bundled runtime (`speculators.serving.Engine`) generating the held-out workloads.

`live_acceptance` runs `live_rows_per_cohort` rows of every cohort at every evaluation temperature through the
runtime twice — with the speculator and with the n-gram drafter — on the already loaded target, with the
runtime's default drafting tree for each drafter (what `speculators serve` uses), and merges the runtime's own
`metrics.AcceptanceStats` per cohort. These are the numbers a user of `speculators serve` sees, next to the
teacher-forced (analytic) numbers of `alpha.py`.

This module does not compute acceptance itself (the runtime counts it) and does not write files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from speculators import metrics
from speculators.data.workloads import WorkloadRow
from speculators.errors import SpeculatorsError


def _engine_class() -> Any:
    try:
        from speculators.serving import Engine
    except ImportError as exc:
        raise SpeculatorsError(f"live evaluation needs the bundled runtime (speculators.serving.Engine), which "
                               f"cannot be imported ({exc}); set evaluate.live=false to skip it") from None
    return Engine


def pick_rows(rows: Sequence[WorkloadRow], per_cohort: int) -> list[WorkloadRow]:
    """The first `per_cohort` rows of every cohort, in file order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r.cohort, 0) < per_cohort:
            seen[r.cohort] = seen.get(r.cohort, 0) + 1
            out.append(r)
    return out


def run_engine(engine: Any, rows: Sequence[WorkloadRow], temperature: float, seed: int, desc: str,
               progress: bool = True) -> dict[str, dict]:
    """Generate every row with one engine; the runtime's AcceptanceStats merged per cohort (plus "overall")."""
    from tqdm.auto import tqdm

    from speculators.serving.sampling import SamplingParams

    per_cohort: dict[str, metrics.AcceptanceStats] = {}
    overall = metrics.AcceptanceStats()
    for r in tqdm(rows, desc=desc, unit="row", disable=not progress):
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=float(temperature), seed=seed)
        out = engine.generate(r.messages if r.messages is not None else r.prompt, params)
        per_cohort.setdefault(r.cohort, metrics.AcceptanceStats()).merge(out.stats.acceptance)
        overall.merge(out.stats.acceptance)
    result = {c: s.to_dict() for c, s in sorted(per_cohort.items())}
    result["overall"] = overall.to_dict()
    return result


def live_acceptance(target: Any, speculator_dir: str, rows: Sequence[WorkloadRow], temperatures: Sequence[float],
                    per_cohort: int, seed: int, allow_revision_mismatch: bool = False,
                    progress: bool = True) -> dict:
    """{str(T): {"speculator": {cohort: stats}, "ngram": {cohort: stats}, "tree": {...}}} from the runtime.
    `target` is a loaded `speculators.target.LoadedTarget` (shared, not reloaded)."""
    engine_cls = _engine_class()
    chosen = pick_rows(rows, per_cohort)
    out: dict[str, dict] = {str(float(t)): {"trees": {}} for t in temperatures}
    for label, drafter in (("speculator", speculator_dir), ("ngram", "ngram")):
        engine = engine_cls.from_pretrained(target=target, speculator=drafter,  # the speculator alone: no graft
                                            allow_revision_mismatch=allow_revision_mismatch, ngram_graft=0)
        for t in temperatures:
            out[str(float(t))][label] = run_engine(engine, chosen, float(t), seed,
                                                   desc=f"live {label} T={float(t)}", progress=progress)
            out[str(float(t))]["trees"][label] = dataclasses.asdict(engine.tree)
        del engine
    return out
