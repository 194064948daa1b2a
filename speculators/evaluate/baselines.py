"""Baseline speculators of the evaluate stage: trained speculators of OTHER runs (a checkpoint, an export, or a
checkpoints/best pointer; any family, paired with the same target) scored on the very rows and target continuations
the run's own checkpoints are scored on, so eval/report.md shows them side by side (the house DFlash recipe names
the house EAGLE-3 run: equal budget, same rows).

- `resolve(recipe)` -> one `Baseline` per entry of `evaluate.baselines`. An entry whose path does not exist is
  kept as missing and reported so (a recipe may name the run it is compared with before that run exists; evaluate
  is incomplete again once it does); one that exists must be a speculator directory or pointer, else one error line.
- `stale(baselines, cache, key)`: the present ones whose cached summaries (eval/baselines.json) are not for their
  draft revision and this eval_key.
- `record(...)` / `write_cache(...)`: the compact record selection.json carries (and report.md renders) and the cache.
- `matches(recorded, baselines)`: whether a recorded set is the one the recipe asks for now (`is_complete`).

Baselines never become `checkpoints/best` and get no live runtime measurement; scoring them is
`acceptance.evaluate_sequences`, the same code as every checkpoint (no family branches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from speculators.core.atomic import write_json_atomic
from speculators.core.checkpoints import read_pointer
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import draft_revision
from speculators.evaluate.select import checkpoint_family

BASELINES_FORMAT = "speculators.eval-baselines/v1"
SPEC_PREFIX = "baseline:"  # their names among the speculators scored in one pass (checkpoints are step-*)


@dataclass(frozen=True)
class Baseline:
    label: str  # the entry as the recipe writes it
    path: Path | None  # the speculator directory; None when the entry does not exist (yet)
    family: str | None = None
    revision: str | None = None

    @property
    def spec_name(self) -> str:
        return SPEC_PREFIX + self.label


def resolve(recipe: Recipe) -> list[Baseline]:
    out, seen = [], set()
    for label in recipe.evaluate.baselines:
        if label in seen:
            raise SpeculatorsError(f"evaluate.baselines names {label!r} twice")
        seen.add(label)
        p = Path(label)
        if not p.exists():
            out.append(Baseline(label, None))
            continue
        if p.is_file():  # a checkpoints/best (or latest) pointer
            p = read_pointer(p.parent, p.name)
        if p is None or not (p / "config.json").is_file():
            raise SpeculatorsError(f"evaluate.baselines entry {label!r} is not a speculator directory (no config.json) "
                                   f"nor a checkpoints pointer file (best / latest)")
        out.append(Baseline(label, p, checkpoint_family(p), draft_revision(p)))
    return out


def read_cache(eval_dir: Path) -> dict:
    try:
        cache = json.loads((eval_dir / "baselines.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return cache.get("baselines", {}) if cache.get("format") == BASELINES_FORMAT else {}


def stale(baselines: list[Baseline], cache: dict, key: str) -> list[Baseline]:
    return [b for b in baselines if b.path is not None and (
        (cache.get(b.label) or {}).get("draft_revision") != b.revision or cache[b.label].get("eval_key") != key)]


def cache_entry(b: Baseline, key: str, depth: int, summaries: dict) -> dict:
    """summaries: {"<T>": teacher-forced summary} from `evaluate_sequences`."""
    return {"path": str(b.path), "family": b.family, "draft_revision": b.revision, "eval_key": key,
            "speculator_depth": depth, "temperatures": summaries}


def write_cache(eval_dir: Path, cache: dict, baselines: list[Baseline]) -> None:
    keep = {b.label: cache[b.label] for b in baselines if b.label in cache and b.path is not None}
    write_json_atomic(eval_dir / "baselines.json", {"format": BASELINES_FORMAT, "baselines": keep})


def record(baselines: list[Baseline], cache: dict) -> list[dict]:
    """Per baseline in recipe order: label, path, family, draft_revision, speculator_depth and per temperature the
    per-cohort simulated tau and its mean, at every position and at cycle starts; `missing` for absent entries."""
    out = []
    for b in baselines:
        if b.path is None:
            out.append({"label": b.label, "missing": True})
            continue
        entry = cache[b.label]
        temps = {}
        for t, s in entry["temperatures"].items():
            cyc = s.get("cycle_starts") or {}
            temps[t] = {"tau": {c: v["simulated_tau"] for c, v in s["cohorts"].items()}, "mean_tau": s["mean_tau"],
                        "cycle_tau": {c: v["tau"] for c, v in (cyc.get("cohorts") or {}).items()},
                        "cycle_mean_tau": cyc.get("mean_tau")}
        out.append({"label": b.label, "missing": False, "path": entry["path"], "family": b.family,
                    "draft_revision": b.revision, "speculator_depth": entry["speculator_depth"],
                    "temperatures": temps})
    return out


def matches(recorded: list[dict] | None, baselines: list[Baseline]) -> bool:
    got = [(r.get("label"), None if r.get("missing") else r.get("draft_revision")) for r in recorded or []]
    return got == [(b.label, b.revision) for b in baselines]
