"""`speculators train-bench`: training throughput and peak memory of every family on one target, side by side.

For each family the REAL pipeline runs in its own process (so peak RSS is that family's alone): capture of the
benchmark rows (offline mode, the demo's setting; skipped in online mode) and `speculators.train.loop.train` for a
fixed number of optimizer steps, starting from the family's house recipe (`recipes/house-<family>.yaml`) when it
exists. Reported per family: tokens/s per process (speculator training steps only: data loading, the online target
forward if any, forward, loss, backward, optimizer; evaluation and checkpoint writes excluded), tokens per CPU-second
(the same work divided by the process's CPU time: comparable on a shared, loaded machine), peak memory (max RSS on
CPU, max CUDA allocated on GPU), steps, final loss, and the capture time.

`python -m speculators.cli worker-train-bench RECIPE` is the per-family child (`child_main`); it prints
one JSON line. This module does not parse options (cli.py does) and writes only under its work dir.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from speculators.data import capture, prepare
from speculators.errors import SpeculatorsError
from speculators.models import FAMILIES
from speculators.recipes import dump_recipe, load_recipe
from speculators.target import check_target_location
from speculators.train.loop import train

log = logging.getLogger(__name__)

RESULT_PREFIX = "TRAIN_BENCH_RESULT "


def _family_recipe(family: str, target: str, rows: str, steps: int, mode: str, batch_size: int | None,
                   run_dir: Path, recipes_dir: Path) -> Path:
    base = recipes_dir / f"house-{family}.yaml"
    overrides = [f"run_dir={run_dir}", f"target.name_or_path={target}", f"speculator.family={family}",
                 f"data.sources=[{{path: {rows}}}]", "data.regenerate.enabled=false", f"capture.mode={mode}",
                 f"train.max_steps={steps}", "train.epochs=1", "train.eval_every=0", f"train.save_every={steps}",
                 "train.resume=never", "train.trackers=[jsonl]", "train.num_processes=1",
                 "train.accelerate_config=null", "data.val_fraction=0.05"]
    if batch_size:
        overrides.append(f"train.batch_size={batch_size}")
    recipe = load_recipe(base if base.is_file() else None, overrides)
    path = run_dir.parent / f"{family}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_recipe(recipe))
    return path


def _rows_file(source: Path, n: int, out: Path) -> Path:
    lines = [line for line in source.read_text().splitlines() if line.strip()][:n]
    if not lines:
        raise SpeculatorsError(f"{source} has no rows to benchmark on")
    out.write_text("\n".join(lines) + "\n")
    return out


def bench_command(*, target: str = "data/targets/stdlib-lm", families: list[str] | None = None, steps: int = 20,
                  batch_size: int | None = None, mode: str = "offline",
                  data: str = "data/datasets/stdlib-chat/train.jsonl", rows: int | None = None,
                  recipes_dir: str = "recipes", out: Path | None = None, threads: int | None = None) -> list[dict]:
    """Run the benchmark and print the table; returns one result dict per family."""
    fams = list(families or FAMILIES)
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        raise SpeculatorsError(f"train-bench: unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    if mode not in ("offline", "online"):
        raise SpeculatorsError(f"train-bench: --mode must be offline or online, got {mode!r}")
    if steps < 1:
        raise SpeculatorsError("train-bench: --steps must be >= 1")
    check_target_location(target)
    if not Path(data).is_file():
        raise SpeculatorsError(f"train-bench: data file {data} not found")
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="speculators-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    n_rows = rows or max(64, int(steps * (batch_size or 8) * 1.15) + 16)
    rows_file = _rows_file(Path(data), n_rows, work / "rows.jsonl")
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    results = []
    for family in fams:
        run_dir = work / family / "run"
        recipe_file = _family_recipe(family, target, str(rows_file), steps, mode, batch_size, run_dir,
                                     Path(recipes_dir))
        log.info("[train-bench] %s: %s, %d steps ...", family, mode, steps)
        proc = subprocess.run([sys.executable, "-m", "speculators.cli", "worker-train-bench", str(recipe_file)], env=env,
                              capture_output=True, text=True, check=False)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)), None)
        if proc.returncode != 0 or line is None:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SpeculatorsError(f"train-bench: {family} failed: {tail}")
        results.append(json.loads(line[len(RESULT_PREFIX):]))
    table = Table(title=f"training benchmark: {target} ({mode}, {steps} steps, 1 process)", title_justify="left")
    for col in ("family", "batch", "tokens/s per process", "tokens per CPU-s", "peak memory MiB", "final loss",
                "capture s", "train s"):
        table.add_column(col, justify="right" if col != "family" else "left")
    for r in results:
        cpu = r.get("tokens_per_cpu_second")
        table.add_row(r["family"], str(r["batch_size"]), f"{r['tokens_per_s_per_process']:.0f}",
                      f"{cpu:.0f}" if cpu else "-",
                      f"{r['peak_memory_mb']:.0f}", f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                      f"{r['capture_seconds']:.1f}", f"{r['train_seconds']:.1f}")
    Console().print(table)
    (work / "train-bench.json").write_text(json.dumps(results, indent=2) + "\n")
    log.info("[train-bench] results: %s", work / "train-bench.json")
    return results


def child_main(recipe_file: str, overrides: list[str]) -> int:
    """One family: capture (offline mode) + train, then print the result line."""
    recipe = load_recipe(recipe_file, overrides)
    prepare.run(recipe)
    capture_s = 0.0
    if recipe.capture.mode == "offline":
        t0 = time.perf_counter()
        capture.run(recipe)
        capture_s = time.perf_counter() - t0
    summary = train(recipe, force=True)
    result = {"family": recipe.speculator.family, "mode": recipe.capture.mode, "batch_size": recipe.train.batch_size,
              "steps": summary["steps"], "tokens_per_s_per_process": summary["tokens_per_s_per_process"],
              "tokens_per_cpu_second": summary["tokens_per_cpu_second"],
              "peak_memory_mb": summary["peak_memory_mb"], "final_loss": summary["final_loss"],
              "train_seconds": summary["train_seconds"], "capture_seconds": round(capture_s, 1),
              "val_simulated_tau": summary["val_simulated_tau"], "threads": _threads()}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def _threads() -> int:
    return int(torch.get_num_threads())
