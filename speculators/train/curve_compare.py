"""Training levers side by side at equal cost: reads the learning curves of several runs
(`checkpoints/learning-curve.json`, written by learning_curve.py) and prints one Markdown row per run with held-out
tau at a server's cycle starts (T = 0 and T = 1) and first-position acceptance, read off each curve at the SAME
budget on one axis (CPU seconds of the steps by default: the figure that survives a machine shared with other
work; or wall seconds, or tokens seen), beside each run's speed and its last point.

    speculators curves runs/lv-base runs/lv-ttt3 ... [--axis train_cpu_seconds] [--at 300]

The budget is `--at`, else the smallest last point over the runs (every run has reached it); a value between two
points is interpolated linearly, as the curve is drawn. What it does not do: train, evaluate on workloads, or judge
significance (the slice is small: read differences of a few hundredths as noise).
"""

from __future__ import annotations

import json
from pathlib import Path

from speculators.core.errors import SpeculatorsError
from speculators.core.options import CurvesOptions
from speculators.train.learning_curve import CURVE_FILE

AXIS_UNITS = {"train_cpu_seconds": "CPU s", "train_seconds": "s", "tokens": "tokens"}  # the axes runs compare at


def read_curve(run_dir: Path) -> dict:
    """The learning curve of a run directory (or of a json file given directly)."""
    path = run_dir if run_dir.suffix == ".json" else run_dir / "checkpoints" / CURVE_FILE
    if not path.is_file():
        raise SpeculatorsError(f"{path}: no learning curve (train with train.curve_points > 0)")
    curve = json.loads(path.read_text())
    if not curve.get("points"):
        raise SpeculatorsError(f"{path}: the learning curve has no points")
    return curve


def value_at(points: list[dict], axis: str, x: float, key: str) -> float | None:
    """`key` of the curve at `axis` = x, linear between the two points around x; None past the last point or when
    a point lacks the axis (a curve written before `train_cpu_seconds` was recorded)."""
    pts = sorted(points, key=lambda p: p["step"])
    if any(axis not in p for p in pts) or x > float(pts[-1][axis]) + 1e-9:
        return None
    prev = pts[0]
    for p in pts:
        if float(p[axis]) >= x:
            lo, hi = float(prev[axis]), float(p[axis])
            if hi <= lo:
                return float(p[key])
            f = (x - lo) / (hi - lo)
            return float(prev[key]) + f * (float(p[key]) - float(prev[key]))
        prev = p
    return float(pts[-1][key])


def _first_position(p: dict) -> float:
    return float((p.get("per_position_t0") or [0.0])[0])


def compare_table(curves: dict[str, dict], axis: str = "train_cpu_seconds", at: float | None = None) -> str:
    """A Markdown table of the runs at equal `axis` (see the module docstring)."""
    if axis not in AXIS_UNITS:
        raise SpeculatorsError(f"axis must be one of {', '.join(AXIS_UNITS)}, got {axis!r}")
    lasts = {name: max(c["points"], key=lambda p: p["step"]) for name, c in curves.items()}
    missing = [name for name, last in lasts.items() if axis not in last]
    if missing:
        raise SpeculatorsError(f"{', '.join(missing)}: the curve has no {axis!r} (written by an older version)")
    budget = float(at) if at is not None else min(float(last[axis]) for last in lasts.values())
    unit = AXIS_UNITS[axis]
    lines = [f"At {budget:,.0f} {unit} of training steps (`{axis}`); tau at a server's cycle starts on the held-out "
             "slice, a_1 = first-position acceptance at T = 0.", "",
             "| run | steps at budget | CPU s / step | tau T=0 | tau T=1 | a_1 | last step | last tau T=0 | last tau T=1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, curve in curves.items():
        pts, last = [{**p, "_a1": _first_position(p)} for p in curve["points"]], lasts[name]
        cpu = float(last.get("train_cpu_seconds") or 0.0)
        per_step = cpu / last["step"] if last["step"] and cpu else None

        def fmt(v: float | None, digits: int = 3) -> str:
            return "–" if v is None else f"{v:.{digits}f}"

        lines.append(f"| {name} | {fmt(value_at(pts, axis, budget, 'step'), 0)} | {fmt(per_step, 2)} | "
                     f"{fmt(value_at(pts, axis, budget, 'tau_cycle_starts_t0'))} | "
                     f"{fmt(value_at(pts, axis, budget, 'tau_cycle_starts_t1'))} | "
                     f"{fmt(value_at(pts, axis, budget, '_a1'))} | {last['step']} | "
                     f"{fmt(float(last['tau_cycle_starts_t0']))} | {fmt(float(last['tau_cycle_starts_t1']))} |")
    return "\n".join(lines)


def curves_command(opts: CurvesOptions) -> str:
    """`speculators curves`: the table of the runs in `opts.runs`."""
    paths = [Path(r) for r in opts.runs]
    labels = [p.parent.parent.name if p.suffix == ".json" else p.name for p in paths]  # the run directory's name
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    return compare_table({label: read_curve(p) for label, p in zip(labels, paths, strict=True)}, opts.axis, opts.at)
