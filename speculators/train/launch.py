"""Multi-process training: re-launch `speculators train` under `accelerate launch`, and the worker entry point.

- `needs_launch(recipe)`: true when the recipe asks for `train.num_processes > 1` or names an accelerate config
  (`train.accelerate_config`, e.g. recipes/accelerate/deepspeed-zero2.yaml) and this process is not already a
  launched worker.
- `launch(recipe, force)`: validates the accelerate config (it exists, parses, names a DeepSpeed JSON that exists,
  DeepSpeed is installed; FSDP needs CUDA) and runs `loop.preflight` (data, features' target, draft vocab, resume
  checkpoint) in THIS process, so bad input fails with one line before any worker starts; then runs
  `python -m accelerate.commands.launch [--config_file X] [--num_processes N] ... -m speculators.cli worker-train
  RECIPE.yaml` with the resolved recipe in a temp file. Workers report a `SpeculatorsError` through an error file
  (one line for the user, not one per rank); rank 0's summary comes back through a result file (on every node).
  Without a config file, N > 1 processes use accelerate's multi-GPU launcher (torchrun), which on a machine
  without CUDA gives CPU DDP over gloo (`Accelerator(cpu=True)` in the worker).
- `python -m speculators.cli worker-train RECIPE [section.key=value ...]` is the worker (`worker_main`): what `accelerate launch`
  (or torchrun, or a multi-node scheduler) runs on every rank. On M nodes, every node runs its own launcher with its
  accelerate config (`num_machines`, `machine_rank`, `main_process_ip` / `_port`); every rank ends with rank 0's
  summary and each node's first process hands it to that node's launcher, so every node reports the same result.

What it does not do: parse command-line options (cli.py does; the worker only forwards its arguments to
`load_recipe`), or train (loop.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import dump_recipe, load_recipe
from speculators.core.workers import accelerate_command, run_workers
from speculators.train.loop import train
from speculators.train.optimizer import check_optimizer_options
from speculators.train.setup import SHARDS_VERIFIED_ENV, preflight

log = logging.getLogger(__name__)

WORKER_ENV = "SPECULATORS_TRAIN_WORKER"
RESULT_ENV = "SPECULATORS_TRAIN_RESULT"
ERROR_ENV = "SPECULATORS_TRAIN_ERROR"
FORCE_ENV = "SPECULATORS_TRAIN_FORCE"


def in_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1" or os.environ.get("LOCAL_RANK") is not None or \
        int(os.environ.get("WORLD_SIZE", "1")) > 1


def needs_launch(recipe: Recipe) -> bool:
    if in_worker():
        return False
    return recipe.train.num_processes > 1 or bool(recipe.train.accelerate_config)


def _resolve_near(path: str, config_file: Path) -> Path | None:
    """A path from an accelerate config: as given (cwd), next to the config, or from the repo root above it."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [p, config_file.parent / p, *(a / p for a in config_file.parents)]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    return None


def check_accelerate_config(path: str) -> dict:
    """Parse and validate an accelerate config file; returns it with `deepspeed_config_file` made absolute."""
    cfg_path = Path(path)
    if not cfg_path.is_file():
        raise SpeculatorsError(f"accelerate config not found: {path} (train.accelerate_config; see "
                               "recipes/accelerate/*.yaml)")
    try:
        cfg = yaml.safe_load(cfg_path.read_text())
    except yaml.YAMLError as exc:
        raise SpeculatorsError(f"accelerate config {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or "distributed_type" not in cfg:
        raise SpeculatorsError(f"accelerate config {path} has no distributed_type; is it an accelerate config?")
    kind = str(cfg["distributed_type"]).upper()
    if kind == "DEEPSPEED":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise SpeculatorsError(f"{path} uses DeepSpeed, which is not installed (pip install "
                                   "'speculators[deepspeed]')") from None
        ds = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if ds:
            found = _resolve_near(str(ds), cfg_path)
            if found is None:
                raise SpeculatorsError(f"DeepSpeed config {ds} named by {path} not found")
            try:
                json.loads(found.read_text())
            except json.JSONDecodeError as exc:
                raise SpeculatorsError(f"DeepSpeed config {found} is not valid JSON ({exc})") from None
            cfg["deepspeed_config"]["deepspeed_config_file"] = str(found)
    if kind == "FSDP":
        if not torch.cuda.is_available():
            raise SpeculatorsError(f"{path} is an FSDP config, which needs CUDA GPUs; on CPU use "
                                   "recipes/accelerate/cpu-ddp-2.yaml or deepspeed-zero2.yaml")
    return cfg


def launch_command(recipe: Recipe, recipe_file: Path) -> list[str]:
    t = recipe.train
    cfg = check_accelerate_config(t.accelerate_config) if t.accelerate_config else None
    deepspeed = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file") if cfg else None
    return accelerate_command(["worker-train", str(recipe_file)], t.num_processes,
                              config_file=str(t.accelerate_config) if cfg is not None else None,
                              deepspeed_config_file=deepspeed,
                              num_machines=int(cfg.get("num_machines", 1) or 1) if cfg is not None else 1)


def launch(recipe: Recipe, *, force: bool = False) -> dict:
    """Run training under `accelerate launch` and return rank 0's summary."""
    if recipe.train.accelerate_config:
        cfg = check_accelerate_config(recipe.train.accelerate_config)
        check_optimizer_options(recipe.train, deepspeed=str(cfg["distributed_type"]).upper() == "DEEPSPEED")
    preflight(recipe, force=force)
    tmp = Path(tempfile.mkdtemp(prefix="speculators-train-"))
    try:
        recipe_file = tmp / "recipe.yaml"
        recipe_file.write_text(dump_recipe(recipe))
        cmd = launch_command(recipe, recipe_file)
        returncode = run_workers(cmd, recipe.train.num_processes, {
            WORKER_ENV: "1", RESULT_ENV: str(tmp / "result.json"), ERROR_ENV: str(tmp / "error"),
            FORCE_ENV: "1" if force else "0", SHARDS_VERIFIED_ENV: "1"})
        errors = sorted(tmp.glob("error.*"))
        if errors:
            raise SpeculatorsError(errors[0].read_text().strip())
        if returncode != 0:
            raise SpeculatorsError(f"distributed training failed (exit status {returncode}); see the worker "
                                   f"output above (command: {' '.join(cmd[2:])})")
        result = tmp / "result.json"
        if not result.is_file():
            raise SpeculatorsError("distributed training ended without a summary from rank 0; see the output above")
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def worker_main(recipe_file: str, overrides: list[str]) -> int:
    """Entry point of every launched rank (`speculators worker-train RECIPE [overrides ...]`); returns the exit code."""
    os.environ[WORKER_ENV] = "1"
    rank = os.environ.get("RANK", "0")
    try:
        recipe = load_recipe(recipe_file, overrides)
        summary = train(recipe, force=os.environ.get(FORCE_ENV) == "1")
    except SpeculatorsError as exc:
        err = os.environ.get(ERROR_ENV)
        if err:
            Path(f"{err}.{rank}").write_text(str(exc) + "\n")
        else:
            log.error("%s", exc)
        return exc.exit_code
    out = os.environ.get(RESULT_ENV)
    if out and os.environ.get("LOCAL_RANK", rank) == "0":  # the first process of every node: each node's launcher
        Path(out).write_text(json.dumps(summary, default=str))  # gets rank 0's summary (train() shares it)
    return 0
