"""The learning curve of a training run: held-out simulated tau at a server's cycle starts, at T = 0 and at T = 1,
against training seconds (wall and CPU) and tokens seen (issue 46: the instrument every training lever is judged by).

What it does:
- `open_curve(...)` -> `LearningCurve`: a FIXED slice of the held-out rows (evenly spaced over the split, the same
  rows at every point) and evenly spaced steps (start and end included), sized so that the curve costs at most
  `train.curve_share` of the training time by the estimate of `slice_size`; a resumed run keeps the points of the
  run it continues (`learning-curve.json`).
- `LearningCurve.maybe_measure(session, train_seconds)`: at a curve step, every rank scores its share of the slice
  teacher-forced (one forward per batch, no gradient) and walks the cycles a server runs over each assistant span
  of each row (`speculators.evaluate.replay.replay_chain`, the function evaluate predicts serving with), with
  per-depth acceptance w: T = 0 the greedy indicator (draft argmax == the target's argmax), T = 1 the sampled
  acceptance sum_v min(p(v), q(v)) of the stored teacher (`loss.sampled_acceptance`; a top-k teacher gives the
  law of its top-k, + rest bucket when trained with one). The point goes to the tracker (kind "curve": JSONL,
  TensorBoard, W&B).
- `LearningCurve.finish(train_seconds)`: writes `checkpoints/learning-curve.json` and `learning-curve.png` (rank 0)
  and returns the summary's fields (points, slice, seconds spent on the curve and their share of training).

The rows are the training data's own held-out continuations (regenerated at the recipe's temperature(s): the
json lists them); both temperatures read the same rows, so the T = 1 figure is the teacher-forced approximation on
those contexts, not evaluate's replay on sampled continuations. Training seconds are the wall clock of the steps
of this process (evaluation excluded), and `train_cpu_seconds` their CPU time (all threads of this process: the
figure to compare levers by on a machine shared with other work); on resume both continue the last kept point's.

What it does not do: train, choose the best checkpoint (validation.py), or evaluate on the held-out workloads
(speculators.evaluate).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculators.core.atomic import atomic_path, write_text_atomic
from speculators.core.config import Recipe
from speculators.evaluate.replay import CycleCounts, replay_chain
from speculators.models.base import speculator_depth, step_rows, step_valid_mask
from speculators.train.batches import load_batch
from speculators.train.loss import sampled_acceptance

FORMAT = "speculators.learning-curve/v1"
CURVE_FILE = "learning-curve.json"
CURVE_PNG = "learning-curve.png"
# cost of scoring one held-out row relative to training on one row (a forward without backward, plus the teacher
# and the cycle replay in Python): 0.07 s a row against 0.10 s a trained row on the house target (demo budget,
# AMD EPYC, 1 thread: docs/acceptance-levers.md section 7), rounded up
ROW_COST = 0.75
MIN_ROWS = 8


def curve_steps(total: int, points: int) -> list[int]:
    """`points` evenly spaced optimizer steps in [0, total], 0 and `total` included (fewer when total is small)."""
    if points <= 0:
        return []
    if points == 1:
        return [total]
    return sorted({round(i * total / (points - 1)) for i in range(points)})


def slice_size(n_val: int, total_steps: int, rows_per_step: int, points: int, share: float) -> tuple[int, int]:
    """(held-out rows, points) so that points x rows x ROW_COST <= share x total_steps x rows_per_step: the rows
    first (at least MIN_ROWS or the whole split), then fewer points (never under 2) when a short run needs it."""
    budget = share * total_steps * rows_per_step / ROW_COST  # row-evaluations the curve may spend
    rows = max(min(MIN_ROWS, n_val), min(n_val, int(budget // max(points, 1))))
    return rows, max(min(points, 2), min(points, int(budget // max(rows, 1))))


def evenly_spaced_rows(val: list[int], n: int) -> list[int]:
    """n held-out rows evenly spaced over the split (the same rows at every point of the curve)."""
    if n >= len(val):
        return list(val)
    return [val[(i * len(val)) // n] for i in range(n)]


@dataclass
class LearningCurve:
    rows: list[int]  # the fixed held-out slice (sequence indices)
    steps: set[int]  # optimizer steps with a point
    depth: int  # chain depth of the replay: min(K, evaluate.depth)
    temperatures: tuple[float, float]  # (0, the teacher's temperature)
    json_path: Path
    tracker: Any  # core.tracking.Tracker
    meta: dict  # what the json records about the slice and the run
    points: list[dict] = field(default_factory=list)
    eval_seconds: float = 0.0  # this run's
    seconds_before: float = 0.0  # training seconds before a resumed step
    cpu_seconds_before: float = 0.0  # the same in CPU seconds of this process

    def maybe_measure(self, s: Any, train_seconds: float, train_cpu_seconds: float = 0.0) -> None:
        """A point at `s.step` when it is a curve step (every rank calls it: the forwards and sums are
        collective). `s`: the loop's session (acc, model, setup, features, vocab, spec, pad_id, recipe, tokens)."""
        if s.step not in self.steps or any(p["step"] == s.step for p in self.points):
            return
        t0 = time.perf_counter()
        counts = _score(s, self.rows, self.depth)
        tokens = int(s.acc.reduce(torch.tensor([float(s.tokens)], dtype=torch.float64, device=s.acc.device),
                                  reduction="sum").item())
        point = {"step": s.step, "train_seconds": round(self.seconds_before + train_seconds, 2),
                 "train_cpu_seconds": round(self.cpu_seconds_before + train_cpu_seconds, 2), "tokens": tokens}
        for name, c in zip(("t0", "t1"), counts, strict=True):
            point[f"tau_cycle_starts_{name}"] = round(c.tau, 4)
            point[f"per_position_{name}"] = [round(a, 4) for a in c.per_position()]
        point["cycles"] = round(counts[0].calls, 1)
        spent = time.perf_counter() - t0
        self.eval_seconds += spent
        point["eval_seconds"] = round(spent, 2)
        self.points.append(point)
        self.tracker.log({k: v for k, v in point.items() if k != "step"}, s.step, kind="curve")

    def finish(self, train_seconds: float, main: bool) -> dict:
        """Write the json and the plot (main process) and return the summary's fields."""
        total = self.seconds_before + train_seconds
        share = self.eval_seconds / train_seconds if train_seconds > 0 else None
        out = {"format": FORMAT, **self.meta, "depth": self.depth, "temperatures": list(self.temperatures),
               "points": sorted(self.points, key=lambda p: p["step"]), "train_seconds": round(total, 2),
               "eval_seconds_this_run": round(self.eval_seconds, 2),
               "share_of_training_this_run": None if share is None else round(share, 4)}
        if main and self.points:
            write_text_atomic(self.json_path, json.dumps(out, indent=2) + "\n")
            _write_png(out, self.json_path.with_name(CURVE_PNG), self.tracker)
        last = out["points"][-1] if self.points else {}
        return {"learning_curve": str(self.json_path) if self.points else None,
                "curve_points": len(self.points), "curve_rows": len(self.rows),
                "curve_eval_seconds": out["eval_seconds_this_run"], "curve_share_of_training": out[
                    "share_of_training_this_run"], "curve_tau_cycle_starts_t0": last.get("tau_cycle_starts_t0"),
                "curve_tau_cycle_starts_t1": last.get("tau_cycle_starts_t1")}


def open_curve(recipe: Recipe, setup: Any, num_steps: int, total_steps: int, start: int, tracker: Any,
               world: int) -> LearningCurve:
    """The run's curve: the slice and the steps (see the module docstring); a resumed run (start > 0) keeps the
    points at or before `start` of the existing json."""
    t = recipe.train
    rows_per_step = t.batch_size * t.grad_accum * world
    n_rows, n_points = slice_size(len(setup.val_idx), total_steps, rows_per_step, t.curve_points, t.curve_share)
    if t.curve_rows is not None:
        n_rows, n_points = min(int(t.curve_rows), len(setup.val_idx)), t.curve_points
    rows = evenly_spaced_rows(list(setup.val_idx), n_rows) if t.curve_points > 0 else []
    meta = {"family": recipe.speculator.family, "num_steps": num_steps, "total_steps": total_steps,
            "slice": {"rows": len(rows), "held_out_rows": len(setup.val_idx),
                      "regenerated_at": _regenerated_at(recipe, setup, rows)},
            "teacher": setup.store.teacher if setup.store is not None else "online (the target in the step)",
            "rows_per_step": rows_per_step}
    path = recipe.paths.checkpoints / CURVE_FILE
    curve = LearningCurve(rows=rows, steps=set(curve_steps(total_steps, n_points)) if rows else set(),
                          depth=speculator_depth(recipe.evaluate.depth, num_steps),
                          temperatures=(0.0, float(t.teacher_temperature)), json_path=path, tracker=tracker,
                          meta=meta)
    if start > 0 and path.is_file():
        kept = [p for p in json.loads(path.read_text()).get("points", []) if p["step"] <= start]
        curve.points = kept
        if kept:
            curve.seconds_before = float(kept[-1]["train_seconds"])
            curve.cpu_seconds_before = float(kept[-1].get("train_cpu_seconds", 0.0))
    return curve


def _regenerated_at(recipe: Recipe, setup: Any, rows: list[int]) -> list[str]:
    """Who wrote the slice's answers: the temperatures of its rows' ids ("<id>@T=<t>"), the recipe's single
    regeneration temperature, or the dataset itself."""
    ids = setup.source.row_ids()
    temps = sorted({str(ids[i]).rpartition("@T=")[2] for i in rows if "@T=" in str(ids[i])})
    if temps:
        return [f"T={t}" for t in temps]
    regen = recipe.data.regenerate
    return [f"T={t:g}" for t in regen.temperatures] if regen.enabled else ["the dataset's own answers"]


# ----------------------------------------------------------------------------------------------------------------
# scoring


def _score(s: Any, rows: list[int], depth: int) -> tuple[CycleCounts, CycleCounts]:
    """Cycle counts (T = 0, T = 1) of this rank's share of the slice, summed over every rank."""
    acc, bs = s.acc, s.recipe.train.batch_size
    mine = rows[acc.process_index::acc.num_processes]
    per_rank = -(-len(rows) // acc.num_processes)  # ceil: every rank runs the same number of forwards
    n_batches = -(-per_rank // bs)
    c0, c1 = CycleCounts(depth), CycleCounts(depth)
    s.model.eval()
    with torch.no_grad():
        for b in range(n_batches):
            idx = mine[b * bs:(b + 1) * bs]
            batch = load_batch(s.setup.source, idx or [rows[0]], s.pad_id)
            w0, w1, valid0 = _weights(s, batch, depth)
            if idx:  # an empty share still runs the forward (ZeRO-3 gathers parameters in it)
                for w, c in ((w0, c0), (w1, c1)):
                    c.merge(_replay_rows(w, valid0, depth))
    s.model.train()
    return _reduce(acc, c0), _reduce(acc, c1)


def _weights(s: Any, batch: dict, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position, per-depth acceptance of one batch: w0 (greedy), w1 (sampled) [B, T, D] float64 and the
    step-0 valid mask [B, T] bool (the roots of the cycles)."""
    dev, vocab = s.acc.device, s.vocab
    inputs, teacher = s.features(batch, dev)
    loss_mask, attention_mask = batch["loss_mask"].to(dev), batch["attention_mask"].to(dev)
    rows = step_rows(loss_mask, attention_mask, s.spec.num_steps)
    inputs["head_rows"] = rows
    logits = s.model(inputs)  # K tensors [N_k, Vd]
    b, t = loss_mask.shape
    w0 = torch.zeros(b * t, depth, dtype=torch.float64)  # [B*T, D]
    w1 = torch.zeros(b * t, depth, dtype=torch.float64)
    for k in range(depth):
        here = rows[k]  # [N_k] flat positions where step k counts
        aligned = teacher.at_rows(here + 1 + k)
        lg = logits[k].float()  # [N_k, Vd]
        w0[here.cpu(), k] = (vocab.draft_to_target[lg.argmax(-1)] == aligned.argmax).double().cpu()
        w1[here.cpu(), k] = sampled_acceptance(lg, aligned).double().cpu()
    valid0 = step_valid_mask(loss_mask, attention_mask, 0).cpu()  # [B, T]
    return w0.view(b, t, depth), w1.view(b, t, depth), valid0


def _replay_rows(w: torch.Tensor, valid0: torch.Tensor, depth: int) -> CycleCounts:
    """The cycles of every assistant span of every row: a span of assistant tokens a..e-1 has its roots at
    t = a-2..e-3 (step 0 at t drafts token t+2), replayed as a generation with prompt length a and length e."""
    out = CycleCounts(depth)
    for b in range(w.shape[0]):
        roots = valid0[b].nonzero().squeeze(-1).tolist()
        for first, last in _runs(roots):
            a, e = first + 2, last + 3
            out.merge(replay_chain(w[b, first:last + 1], a, e, e - a + 1, depth))
    return out


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers in a sorted list, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    return runs


def _reduce(acc: Any, c: CycleCounts) -> CycleCounts:
    """Counts summed over every rank."""
    flat = torch.tensor([*c.attempts, *c.accepts, c.calls, c.committed], dtype=torch.float64, device=acc.device)
    flat = acc.reduce(flat, reduction="sum").cpu().tolist()
    d = c.depth
    return CycleCounts(d, attempts=flat[:d], accepts=flat[d:2 * d], calls=flat[2 * d], committed=flat[2 * d + 1])


# ----------------------------------------------------------------------------------------------------------------
# the plot


def curve_figure(curve: dict) -> Any:
    """matplotlib (Agg) Figure: tau at cycle starts (T = 0 and T = 1) against training seconds and tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    pts = curve["points"]
    fig = Figure(figsize=(9, 3.4), dpi=100)
    temps = curve["temperatures"]
    for i, (xkey, label) in enumerate((("train_seconds", "training seconds (steps only)"),
                                       ("tokens", "tokens seen"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, t, style in (("t0", temps[0], "o-"), ("t1", temps[1], "s--")):
            ax.plot([p[xkey] for p in pts], [p[f"tau_cycle_starts_{name}"] for p in pts], style, markersize=3,
                    label=f"T = {t:g}")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out tau at cycle starts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{curve['family']}: {curve['slice']['rows']} held-out rows, depth {curve['depth']}", fontsize=9)
    fig.tight_layout()
    return fig


def _write_png(curve: dict, png: Path, tracker: Any) -> None:
    fig = curve_figure(curve)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    with atomic_path(png) as tmp:
        Path(tmp).write_bytes(buf.getvalue())
    tracker.log_figure("curve/learning_curve", fig, png, int(curve["points"][-1]["step"]))
