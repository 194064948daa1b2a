"""Checkpoint choice by held-out acceptance: the best checkpoint is the one with the highest simulated tau.

- The checkpoint folder itself (step dirs, `best` / `latest` pointers) is `core/checkpoints.py`.
- `choose_best(reports, temperature)`: the checkpoint whose teacher-forced simulated tau at `temperature`, averaged
  over cohorts, is highest (ties -> the later step). Training loss is recorded next to it for reference only:
  loss keeps falling after acceptance peaks, so it never decides.
- `selection_record` builds `eval/selection.json`.

This module does not evaluate anything; it reads reports produced by `evaluate.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from speculators.core.checkpoints import step_number
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import temperature_key
from speculators.models import family_of

SELECTION_FORMAT = "speculators.selection/v1"
def checkpoint_loss(step_dir: str | Path) -> float | None:
    """The validation (else training) loss the trainer recorded in `speculators_native`, if any (reference only)."""
    try:
        native = json.loads((Path(step_dir) / "config.json").read_text()).get("speculators_native") or {}
    except (OSError, json.JSONDecodeError):
        return None
    training = native.get("training") if isinstance(native.get("training"), dict) else {}
    for holder in (training.get("validation"), native, native.get("metrics"), training):
        if not isinstance(holder, dict):
            continue
        for key in ("val_loss", "eval_loss", "loss", "train_loss"):
            v = holder.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return None


def checkpoint_family(step_dir: str | Path) -> str:
    """The speculator family a checkpoint (or export) directory holds, from its config.json."""
    path = Path(step_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"cannot read {path} ({exc}); the checkpoint is incomplete or corrupt") from None
    return family_of(cfg)


def tau_of(report: dict, temperature: float) -> float:
    """The selection metric of one checkpoint report: mean over cohorts of the simulated tau at `temperature`."""
    entry = report.get("temperatures", {}).get(temperature_key(temperature))
    if entry is None:
        raise SpeculatorsError(f"evaluation report of {report.get('checkpoint')} has no temperature {temperature}; "
                               f"add it to evaluate.temperatures or change evaluate.select_temperature")
    return float(entry["speculator"]["mean_tau"])


def choose_best(reports: dict[str, dict], temperature: float) -> str:
    """Name of the checkpoint with the highest held-out simulated tau (ties: the later step)."""
    if not reports:
        raise SpeculatorsError("no evaluated checkpoints to choose from")
    return max(reports, key=lambda name: (tau_of(reports[name], temperature), step_number(name)))


def selection_record(reports: dict[str, dict], best: str, temperature: float, checkpoints_dir: Path) -> dict:
    rows = []
    for name in sorted(reports, key=step_number):
        rep = reports[name]
        rows.append({"checkpoint": name, "step": step_number(name), "draft_revision": rep.get("draft_revision"),
                     "mean_tau": tau_of(rep, temperature),
                     "loss": checkpoint_loss(checkpoints_dir / name)})
    best_rep = reports[best]
    summary = {t: {"tau": {c: s["simulated_tau"] for c, s in e["speculator"]["cohorts"].items()},
                   "mean_tau": e["speculator"]["mean_tau"],
                   "ngram_tau": {c: s["simulated_tau"] for c, s in e["ngram"]["cohorts"].items()},
                   "ngram_mean_tau": e["ngram"]["mean_tau"],
                   "cycle_tau": {c: s["tau"] for c, s in
                                 ((e["speculator"].get("cycle_starts") or {}).get("cohorts") or {}).items()},
                   "cycle_mean_tau": (e["speculator"].get("cycle_starts") or {}).get("mean_tau"),
                   "ngram_cycle_tau": {c: s["tau"] for c, s in
                                       ((e["ngram"].get("cycle_starts") or {}).get("cohorts") or {}).items()},
                   "ngram_cycle_mean_tau": (e["ngram"].get("cycle_starts") or {}).get("mean_tau")}
               for t, e in best_rep["temperatures"].items()}
    return {
        "format": SELECTION_FORMAT,
        "metric": f"mean over cohorts of the teacher-forced simulated tau at temperature {float(temperature)}",
        "temperature": float(temperature),
        "best": best,
        "best_step": step_number(best),
        "best_draft_revision": best_rep.get("draft_revision"),
        "checkpoints": rows,
        "target": best_rep.get("target"),
        "summary": summary,
        "live": best_rep.get("live"),
        "complete": True,
    }
