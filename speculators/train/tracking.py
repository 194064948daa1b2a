"""Experiment tracking for training: JSONL always, TensorBoard and Weights & Biases when installed.

What it does:
- `Tracker.log(metrics, step)`: scalars to every enabled backend (loss, per-step accuracy, LR, tokens/s ...).
- `Tracker.log_acceptance(step, rows, png)`: the per-position acceptance table and its plot at each evaluation.
- JSONL (`logs/metrics.jsonl`, one object per line with "step" and "kind"): always on; on resume, records past the
  resumed step are dropped (atomic rewrite) so the file reads as one uninterrupted run.
- TensorBoard (`logs/tensorboard/`), W&B (`logs/wandb/`): W&B runs online when the user has W&B credentials —
  WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or `wandb login`'s netrc entry for the W&B host — and offline otherwise
  (WANDB_MODE, when set, decides; `wandb_mode`). Entity, project, tags and group come from the recipe
  (`train.wandb_*`). The run resumes the same id after a restart, and one line says where it lives: its URL, or the
  `wandb sync` command that uploads an offline run. A missing package is skipped with one warning line; nothing
  here is ever required.
- `log_evaluation`: the evaluate stage's report (per-cohort tau per temperature, live tau, its plots, the checkpoint
  it chose) goes to the same W&B run, resumed by its id.
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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


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


class Tracker:
    """Fan-out of metrics to JSONL / TensorBoard / W&B (see the module docstring)."""

    def __init__(self, logs_dir: Path, trackers: list[str], *, run_name: str, config: dict, enabled: bool = True,
                 resume_step: int | None = None, wandb: dict | None = None) -> None:
        self.enabled = enabled
        self.logs_dir = Path(logs_dir)
        self.jsonl: Path | None = None
        self.tb: Any = None
        self.wandb_run: Any = None
        self.wandb_dir: Path | None = None
        if not enabled:
            return
        unknown = sorted(set(trackers) - {"jsonl", "tensorboard", "wandb"})
        if unknown:
            from speculators.errors import SpeculatorsError

            raise SpeculatorsError(f"train.trackers: unknown tracker(s) {unknown}; use jsonl, tensorboard, wandb")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.logs_dir / JSONL_NAME
        if resume_step is not None:
            truncate_jsonl(self.jsonl, resume_step)
        else:  # a fresh run: no records or event files of an earlier one
            self.jsonl.unlink(missing_ok=True)
            shutil.rmtree(self.logs_dir / "tensorboard", ignore_errors=True)
        if "tensorboard" in trackers:
            self._open_tensorboard()
        if "wandb" in trackers:
            self._open_wandb(run_name, config, wandb or {"project": "speculators"}, resume_step is not None)

    # ---- backends ---------------------------------------------------------------------------------------------
    def _open_tensorboard(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _warn("tensorboard is not installed; skipping TensorBoard logging (pip install tensorboard)")
            return
        self.tb = SummaryWriter(log_dir=str(self.logs_dir / "tensorboard"))

    def _open_wandb(self, run_name: str, config: dict, options: dict, resuming: bool) -> None:
        try:
            import wandb  # noqa: F401 - is it installed?
        except ImportError:
            _warn("wandb is not installed; skipping Weights & Biases logging (pip install wandb)")
            return
        mode, why = wandb_mode()
        if mode == "disabled":
            return
        id_file = self.logs_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        self.wandb_dir = self.logs_dir
        self.wandb_run = open_wandb_run(self.logs_dir, run_id, mode, options, name=run_name, config=config)
        if self.wandb_run is not None:
            log.info("%s (mode %s: %s)", _where(self.wandb_run, mode), mode, why)

    # ---- logging ----------------------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), "kind": kind, "time": round(time.time(), 3)}
        rec.update({k: _clean(v) for k, v in metrics.items()})
        with self.jsonl.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
        flat = {}
        for key, value in metrics.items():
            if isinstance(value, (list, tuple)):
                flat.update({f"{key}/{i}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[key] = value
        if self.tb is not None:
            for key, value in flat.items():
                self.tb.add_scalar(f"{kind}/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({f"{kind}/{k}": v for k, v in flat.items()}, step=int(step))

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
        if self.tb is not None:
            header = "| k | a_k | E_k | top-1 |\n|---|---|---|---|\n"
            body = "".join(f"| {r['k']} | {r['acceptance']:.4f} | {r['chain_reach']:.4f} | {r['top1_accuracy']:.4f} |\n"
                           for r in rows)
            self.tb.add_text("eval/acceptance_table", header + body, step)
            if fig is not None:
                self.tb.add_figure("eval/acceptance_plot", fig, step, close=False)
        if self.wandb_run is not None:
            import wandb

            cols = ["k", "acceptance", "chain_reach", "top1_accuracy"]
            payload: dict[str, Any] = {"eval/acceptance_table": wandb.Table(columns=cols,
                                                                            data=[[r[c] for c in cols] for r in rows])}
            if png is not None:
                payload["eval/acceptance_plot"] = wandb.Image(str(png))
            self.wandb_run.log(payload, step=int(step))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(quiet=True)
            except TypeError:
                self.wandb_run.finish()
            self.wandb_run = None


def open_wandb_run(logs_dir: Path, run_id: str, mode: str, options: dict, **init: Any) -> Any:
    """`wandb.init` of run `run_id` under `logs_dir` (resumed when it exists), or None with one warning."""
    import wandb

    try:
        return wandb.init(id=run_id, resume="allow", mode=mode, dir=str(logs_dir),
                          project=options.get("project") or "speculators", entity=options.get("entity"),
                          group=options.get("group"), tags=options.get("tags") or None,
                          settings=wandb.Settings(console="off", silent=True), **init)
    except Exception as exc:  # noqa: BLE001 - never let tracking stop a stage
        _warn(f"wandb could not start ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
              "continuing without it")
        return None


def log_evaluation(logs_dir: Path, options: dict, selection: dict, images: dict[str, Path]) -> bool:
    """The evaluate stage's report in the training run's W&B run (resumed by the id training recorded): a table of
    simulated tau per temperature and cohort (speculator, n-gram, live), the plots, and the checkpoint choice in the
    run summary. Returns whether it was logged (False: training used no W&B run, or wandb is off / missing)."""
    id_file = Path(logs_dir) / RUN_ID_FILE
    mode, _ = wandb_mode()
    if not id_file.is_file() or mode == "disabled":
        return False
    try:
        import wandb
    except ImportError:
        return False
    run = open_wandb_run(Path(logs_dir), id_file.read_text().strip(), mode, options)
    if run is None:
        return False
    rows = []
    for t, entry in selection.get("summary", {}).items():
        live = ((selection.get("live") or {}).get(t) or {}).get("speculator", {}).get("cohorts", {})
        for cohort, tau in entry["tau"].items():
            rows.append([float(t), cohort, tau, entry["ngram_tau"].get(cohort), (live.get(cohort) or {}).get("tau")])
    payload: dict[str, Any] = {"eval/cohort_tau": wandb.Table(
        columns=["temperature", "cohort", "simulated_tau", "ngram_simulated_tau", "live_tau"], data=rows)}
    payload.update({f"eval/{name}": wandb.Image(str(path)) for name, path in images.items() if Path(path).is_file()})
    run.log(payload)
    summary: dict[str, Any] = {"eval/best_checkpoint": selection.get("best"), "eval/best_step": selection.get("best_step"),
                               "eval/metric": selection.get("metric")}
    for t, entry in selection.get("summary", {}).items():
        summary[f"eval/mean_tau@T={t}"] = entry["mean_tau"]
        summary[f"eval/ngram_mean_tau@T={t}"] = entry["ngram_mean_tau"]
    run.summary.update(summary)
    log.info("evaluation logged to %s", _where(run, mode))
    run.finish()
    return True
