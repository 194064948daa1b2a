"""Experiment tracking for training: JSONL always, TensorBoard and Weights & Biases when installed.

What it does:
- `Tracker.log(metrics, step)`: scalars to every enabled backend (loss, per-step accuracy, LR, tokens/s ...).
- `Tracker.log_acceptance(step, rows, png)`: the per-position acceptance table and its plot at each evaluation.
- JSONL (`logs/metrics.jsonl`, one object per line with "step" and "kind"): always on; on resume, records past the
  resumed step are dropped (atomic rewrite) so the file reads as one uninterrupted run.
- The backends are accelerate trackers (`accelerate.tracking`): JSONL is one of our own (`JsonlTracker`), TensorBoard
  and W&B are accelerate's.
- TensorBoard (`logs/tensorboard/`), W&B (`logs/wandb/`): W&B runs online when the user has W&B credentials —
  WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or `wandb login`'s netrc entry for the W&B host — and offline otherwise
  (WANDB_MODE, when set, decides; `wandb_mode`). Entity, project, tags and group come from the recipe
  (`train.wandb_*`). The run resumes the same id after a restart, and one line says where it lives: its URL, or the
  `wandb sync` command that uploads an offline run. A missing package is skipped with one warning line; nothing
  here is ever required.
- `log_evaluation`: the evaluate stage's report (per-cohort tau per temperature, live tau, its plots, the checkpoint
  it chose) goes to the same W&B run, resumed by its id.
- `Tracker.log_figure(key, fig, png, step)`: a figure drawn elsewhere (the training's learning curve).
- `acceptance_figure`: a matplotlib (Agg) figure of per-position acceptance a_k and chain reach E_k.
Only the main process creates a live `Tracker`; other ranks get a disabled one.

What it does not do: compute metrics, print progress bars, or talk to the network on its own (W&B goes online only
with the user's own credentials).
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from accelerate import PartialState
from accelerate.tracking import GeneralTracker, TensorBoardTracker, WandBTracker

from speculators.core.atomic import write_text_atomic
from speculators.core.errors import SpeculatorsError

JSONL_NAME = "metrics.jsonl"
RUN_ID_FILE = "wandb-run-id"
DEFAULT_WANDB_HOST = "https://api.wandb.ai"

log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    log.warning(message)


def wandb_mode(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(mode, why): WANDB_MODE when set; "online" with credentials (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or the
    netrc entry `wandb login` writes for the W&B host); "offline" otherwise."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"], "WANDB_MODE"
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if env.get(name):
            return "online", name
    path = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc")
    host = urlparse(env.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST).hostname or ""
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        entry = None
    if entry and entry[2]:
        return "online", f"`wandb login` ({path})"
    return "offline", "no W&B credentials (WANDB_API_KEY or `wandb login`)"


def wandb_options(train: Any) -> dict:
    """The recipe's W&B run settings (`train.wandb_project / _entity / _group / _tags`)."""
    return {"project": train.wandb_project, "entity": train.wandb_entity, "group": train.wandb_group,
            "tags": list(train.wandb_tags or [])}


def _where(run: Any, mode: str) -> str:
    """One line saying where a W&B run lives."""
    if mode == "offline":
        # a run resumed in the same second as it started gets a "-1" suffix: the glob covers every file of it
        sync = Path(str(getattr(run.settings, "sync_dir", "") or "")).parent / f"offline-run-*-{run.id}*"
        return f"W&B run {run.id} is saved offline in {sync.parent}; upload it with: wandb sync {sync}"
    return f"W&B run: {run.url}" if getattr(run, "url", None) else f"W&B run {run.id} ({mode})"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def truncate_jsonl(path: Path, after_step: int) -> None:
    """Drop records with step > after_step (a crashed run's tail before a resume), atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if int(rec.get("step", 0)) <= after_step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def acceptance_figure(rows: list[dict], title: str) -> Any:
    """rows: [{"k", "acceptance", "chain_reach", "top1_accuracy"}] -> matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ks = [r["k"] for r in rows]
    ax.bar([k - 0.2 for k in ks], [r["acceptance"] for r in rows], width=0.4, label="a_k (conditional)")
    ax.bar([k + 0.2 for k in ks], [r["chain_reach"] for r in rows], width=0.4, label="E_k (chain reach)")
    ax.plot(ks, [r["top1_accuracy"] for r in rows], "k.--", label="top-1 accuracy")
    ax.set_xlabel("draft position k")
    ax.set_ylim(0, 1)
    ax.set_xticks(ks)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


class JsonlTracker(GeneralTracker):
    """accelerate tracker of the always-on record: `logs/metrics.jsonl`, one object per line with "step", "kind"
    and "time". A resumed run drops the records past its step (atomic rewrite); a fresh run starts an empty file."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = False  # `Tracker` only ever runs on the main process

    def __init__(self, logs_dir: Path, resume_step: int | None) -> None:
        super().__init__()
        self.path = Path(logs_dir) / JSONL_NAME
        if resume_step is not None:
            truncate_jsonl(self.path, resume_step)
        else:
            self.path.unlink(missing_ok=True)

    @property
    def tracker(self) -> Path:
        return self.path

    def log(self, values: dict, step: int | None = None, kind: str = "train", **kwargs: Any) -> None:
        rec = {"step": int(step or 0), "kind": kind, "time": round(time.time(), 3)}
        rec.update({k: _clean(v) for k, v in values.items()})
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")


class Tracker:
    """Fan-out of metrics over accelerate trackers: `JsonlTracker` always, accelerate's `TensorBoardTracker` and
    `WandBTracker` when asked for and installed (see the module docstring)."""

    def __init__(self, logs_dir: Path, trackers: list[str], *, run_name: str, config: dict, enabled: bool = True,
                 resume_step: int | None = None, wandb: dict | None = None) -> None:
        self.enabled = enabled
        self.logs_dir = Path(logs_dir)
        self.jsonl: JsonlTracker | None = None
        self.tensorboard: TensorBoardTracker | None = None
        self.wandb: WandBTracker | None = None
        if not enabled:
            return
        unknown = sorted(set(trackers) - {"jsonl", "tensorboard", "wandb"})
        if unknown:
            raise SpeculatorsError(f"train.trackers: unknown tracker(s) {unknown}; use jsonl, tensorboard, wandb")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlTracker(self.logs_dir, resume_step)
        if resume_step is None:  # a fresh run: no event files of an earlier one
            shutil.rmtree(self.logs_dir / "tensorboard", ignore_errors=True)
        if "tensorboard" in trackers:
            self.tensorboard = _open_tensorboard(self.logs_dir)
        if "wandb" in trackers:
            self.wandb = _open_wandb(self.logs_dir, run_name, config, wandb or {"project": "speculators"},
                                     resume_step is not None)

    @property
    def backends(self) -> list[GeneralTracker]:
        return [b for b in (self.jsonl, self.tensorboard, self.wandb) if b is not None]

    def log(self, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        """Every metric to JSONL as given; the numbers (list items as `key/i`) to the others as `kind/key`."""
        if not self.enabled:
            return
        self.jsonl.log(metrics, step, kind=kind)
        flat = {}
        for key, value in metrics.items():
            if isinstance(value, (list, tuple)):
                flat.update({f"{kind}/{key}/{i}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{kind}/{key}"] = value
        for backend in (self.tensorboard, self.wandb):
            if backend is not None:
                backend.log(flat, step=int(step))

    def log_acceptance(self, step: int, rows: list[dict], summary: dict, png: Path | None) -> None:
        """The per-position acceptance table (+ its plot) of one evaluation."""
        if not self.enabled:
            return
        self.log({"acceptance_table": rows, **summary}, step, kind="eval")
        fig = None
        if png is not None:
            fig = acceptance_figure(rows, f"step {step}: simulated tau {summary.get('simulated_tau', 0):.3f}")
            png.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(png)
        if self.tensorboard is not None:
            writer = self.tensorboard.tracker
            header = "| k | a_k | E_k | top-1 |\n|---|---|---|---|\n"
            body = "".join(f"| {r['k']} | {r['acceptance']:.4f} | {r['chain_reach']:.4f} | {r['top1_accuracy']:.4f} |\n"
                           for r in rows)
            writer.add_text("eval/acceptance_table", header + body, step)
            if fig is not None:
                writer.add_figure("eval/acceptance_plot", fig, step, close=False)
        if self.wandb is not None:
            cols = ["k", "acceptance", "chain_reach", "top1_accuracy"]
            _log_tables_and_images(self.wandb, {"eval/acceptance_table": (cols, [[r[c] for c in cols] for r in rows])},
                                   {"eval/acceptance_plot": png} if png is not None else {}, int(step))

    def log_figure(self, key: str, fig: Any, png: Path, step: int) -> None:
        """A drawn figure (already saved as `png`) to TensorBoard and W&B (JSONL keeps the numbers only)."""
        if not self.enabled:
            return
        if self.tensorboard is not None:
            self.tensorboard.tracker.add_figure(key, fig, step, close=False)
        if self.wandb is not None:
            _log_tables_and_images(self.wandb, {}, {key: png}, int(step))

    def close(self) -> None:
        for backend in (self.tensorboard, self.wandb):
            if backend is not None:
                backend.finish()
        self.tensorboard = self.wandb = None


def _open_tensorboard(logs_dir: Path) -> TensorBoardTracker | None:
    """accelerate's TensorBoard tracker writing `logs_dir/tensorboard/`, or None with one warning line."""
    try:
        import torch.utils.tensorboard  # noqa: F401 - is tensorboard installed?
    except ImportError:
        _warn("tensorboard is not installed; skipping TensorBoard logging (pip install tensorboard)")
        return None
    backend = TensorBoardTracker("tensorboard", logs_dir)
    PartialState()
    backend.start()
    return backend


def _open_wandb(logs_dir: Path, run_name: str, config: dict, options: dict, resuming: bool) -> WandBTracker | None:
    """The W&B run of this training (its id kept in `logs_dir/wandb-run-id`, so a resume continues it)."""
    try:
        import wandb  # noqa: F401 - is it installed?
    except ImportError:
        _warn("wandb is not installed; skipping Weights & Biases logging (pip install wandb)")
        return None
    mode, why = wandb_mode()
    if mode == "disabled":
        return None
    id_file = logs_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
    backend = open_wandb_run(logs_dir, run_id, mode, options, name=run_name, config=config)
    if backend is not None:
        log.info("%s (mode %s: %s)", _where(backend.tracker, mode), mode, why)
    return backend


def _log_tables_and_images(backend: WandBTracker, tables: dict[str, tuple[list[str], list[list[Any]]]],
                           images: dict[str, Path], step: int | None = None) -> None:
    """Tables (columns, rows) and PNG files in one W&B history row."""
    import wandb

    payload: dict[str, Any] = {key: wandb.Table(columns=cols, data=data) for key, (cols, data) in tables.items()}
    payload.update({key: wandb.Image(str(png)) for key, png in images.items() if Path(png).is_file()})
    backend.log(payload, step=step)


def open_wandb_run(logs_dir: Path, run_id: str, mode: str, options: dict, **init: Any) -> WandBTracker | None:
    """accelerate's W&B tracker on run `run_id` under `logs_dir` (resumed when it exists), or None with one
    warning (tracking never stops a stage)."""
    import wandb

    backend = WandBTracker(options.get("project") or "speculators", id=run_id, resume="allow", mode=mode,
                           dir=str(logs_dir), entity=options.get("entity"), group=options.get("group"),
                           tags=options.get("tags") or None, settings=wandb.Settings(console="off", silent=True),
                           **init)
    try:
        PartialState()  # accelerate's trackers log through its state (a no-op where training made it already)
        backend.start()
    except Exception as exc:  # noqa: BLE001 - never let tracking stop a stage
        _warn(f"wandb could not start ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
              "continuing without it")
        return None
    return backend


def log_evaluation(logs_dir: Path, options: dict, selection: dict, images: dict[str, Path]) -> bool:
    """The evaluate stage's report in the training run's W&B run (resumed by the id training recorded): a table of
    simulated tau per temperature and cohort (speculator, n-gram, live), the plots, and the checkpoint choice in the
    run summary. Returns whether it was logged (False: training used no W&B run, or wandb is off / missing)."""
    id_file = Path(logs_dir) / RUN_ID_FILE
    mode, _ = wandb_mode()
    if not id_file.is_file() or mode == "disabled":
        return False
    try:
        import wandb  # noqa: F401 - is it installed?
    except ImportError:
        return False
    backend = open_wandb_run(Path(logs_dir), id_file.read_text().strip(), mode, options)
    if backend is None:
        return False
    rows = []
    for t, entry in selection.get("summary", {}).items():
        live = ((selection.get("live") or {}).get(t) or {}).get("speculator", {}).get("cohorts", {})
        for cohort, tau in entry["tau"].items():
            rows.append([float(t), cohort, tau, entry["ngram_tau"].get(cohort), (live.get(cohort) or {}).get("tau")])
    columns = ["temperature", "cohort", "simulated_tau", "ngram_simulated_tau", "live_tau"]
    _log_tables_and_images(backend, {"eval/cohort_tau": (columns, rows)},
                           {f"eval/{name}": Path(path) for name, path in images.items()})
    summary: dict[str, Any] = {"eval/best_checkpoint": selection.get("best"), "eval/best_step": selection.get("best_step"),
                               "eval/metric": selection.get("metric")}
    for t, entry in selection.get("summary", {}).items():
        summary[f"eval/mean_tau@T={t}"] = entry["mean_tau"]
        summary[f"eval/ngram_mean_tau@T={t}"] = entry["ngram_mean_tau"]
    backend.tracker.summary.update(summary)
    log.info("evaluation logged to %s", _where(backend.tracker, mode))
    backend.finish()
    return True
