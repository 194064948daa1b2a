"""`speculators train-bench`: training throughput and peak memory of every family on one target, side by side.

For each family the REAL pipeline runs in its own process (so peak RSS is that family's alone): capture of the
benchmark rows (offline mode, the demo's setting; skipped in online mode) and `speculators.train.loop.train` for a
fixed number of optimizer steps, starting from the family's house recipe (`recipes/house-<family>.yaml`) when it
exists. Reported per family: tokens/s per process (speculator training steps only: data loading, the online target
forward if any, forward, loss, backward, optimizer; evaluation and checkpoint writes excluded), tokens per CPU-second
(the same work divided by the process's CPU time: comparable on a shared, loaded machine), peak memory (max RSS on
CPU, max CUDA allocated on GPU), steps, final loss, and the capture time.

`python -m speculators.cli worker-train-bench RECIPE FILE` is the per-family child (`child_main`); it
writes its result JSON to FILE (`<work dir>/<family>/result.json`), which the parent reads. `train_bench_command`
returns the results and their table; it does not parse options or print (cli.py does) and writes only under its work
dir.
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
from rich.table import Table

from speculators.core.atomic import write_json_atomic
from speculators.core.errors import SpeculatorsError
from speculators.core.options import TrainBenchOptions, choices
from speculators.core.recipes import dump_recipe, load_recipe
from speculators.core.target import check_target_location
from speculators.data import capture, prepare
from speculators.models import FAMILIES
from speculators.train.loop import train

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"  # each family's child writes its result here (under the work dir)


def _family_recipe(family: str, target: str, rows: str, steps: int, mode: str, batch_size: int | None,
                   run_dir: Path, recipes_dir: Path) -> Path:
    base = recipes_dir / f"house-{family}.yaml"
    overrides = [f"run_dir={run_dir}", f"target.name_or_path={target}", f"speculator.family={family}",
                 f"data.sources=[{{path: {rows}}}]", "data.regenerate.enabled=false", f"capture.mode={mode}",
                 f"train.max_steps={steps}", "train.epochs=1", "train.eval_every=0", f"train.save_every={steps}",
                 "train.resume=never", "train.trackers=[jsonl]", "train.num_processes=1",
                 "train.accelerate_config=null", "data.val_fraction=0.05", "train.curve_points=0"]  # throughput only
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


def train_bench_command(opts: TrainBenchOptions) -> tuple[list[dict], Table]:
    """Run the benchmark `opts` describes; (one result dict per family, the table cli.py prints). The results are
    also written to `<work dir>/train-bench.json`."""
    fams = choices(opts.families, "--families", FAMILIES)
    if opts.mode not in ("offline", "online"):
        raise SpeculatorsError(f"train-bench: --mode must be offline or online, got {opts.mode!r}")
    if opts.steps < 1:
        raise SpeculatorsError("train-bench: --steps must be >= 1")
    check_target_location(opts.target)
    if not Path(opts.data).is_file():
        raise SpeculatorsError(f"train-bench: data file {opts.data} not found")
    work = Path(opts.out) if opts.out else Path(tempfile.mkdtemp(prefix="speculators-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    n_rows = opts.rows or max(64, int(opts.steps * (opts.batch_size or 8) * 1.15) + 16)
    rows_file = _rows_file(Path(opts.data), n_rows, work / "rows.jsonl")
    env = dict(os.environ)
    if opts.threads:
        env["OMP_NUM_THREADS"] = str(opts.threads)
    results = []
    for family in fams:
        run_dir = work / family / "run"
        recipe_file = _family_recipe(family, opts.target, str(rows_file), opts.steps, opts.mode, opts.batch_size,
                                     run_dir, Path(opts.recipes_dir))
        log.info("[train-bench] %s: %s, %d steps ...", family, opts.mode, opts.steps)
        results.append(_run_child(family, recipe_file, work / family / RESULT_FILE, env))
    write_json_atomic(work / "train-bench.json", results)
    log.info("[train-bench] results: %s", work / "train-bench.json")
    return results, _table(results, f"training benchmark: {opts.target} ({opts.mode}, {opts.steps} steps, 1 process)")


def _run_child(family: str, recipe_file: Path, result_file: Path, env: dict[str, str]) -> dict:
    """One family in its own process (`worker-train-bench`), which writes its result JSON to `result_file`."""
    result_file.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "speculators.cli", "worker-train-bench", str(recipe_file),
                           str(result_file)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not result_file.is_file():
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SpeculatorsError(f"train-bench: {family} failed: {tail}")
    return json.loads(result_file.read_text())


def _table(results: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("family", "batch", "tokens/s per process", "tokens per CPU-s", "peak memory MiB", "final loss",
                "capture s", "train s"):
        table.add_column(col, justify="right" if col != "family" else "left")
    for r in results:
        cpu = r.get("tokens_per_cpu_second")
        table.add_row(r["family"], str(r["batch_size"]), f"{r['tokens_per_s_per_process']:.0f}",
                      f"{cpu:.0f}" if cpu else "-",
                      f"{r['peak_memory_mb']:.0f}", f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                      f"{r['capture_seconds']:.1f}", f"{r['train_seconds']:.1f}")
    return table


def child_main(recipe_file: str, overrides: list[str], result_file: str | Path) -> int:
    """One family: capture (offline mode) + train, then write the result JSON to `result_file`."""
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
    write_json_atomic(result_file, result)
    return 0


def _threads() -> int:
    return int(torch.get_num_threads())
