"""The recipe pipeline: the ordered stages (docs/architecture.md) and the resumable `speculators run`.

The stage contract: stage NAME lives in the module `speculators.<room>.<NAME>` (`-` -> `_`) and exposes

    enabled(recipe: Recipe) -> bool                       # whether `run` runs it for this recipe
    is_complete(recipe: Recipe) -> bool                   # outputs exist, are complete and valid
    run(recipe: Recipe, *, force: bool = False) -> dict   # does the work, returns a short summary

`run_pipeline` runs every enabled stage of a recipe in order and skips stages whose outputs are already complete;
it never branches on a stage's name. Stages are imported when they run (importlib), so `speculators --help` and
`import speculators.pipeline` load no torch. This module does not parse arguments.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.models import check_family


@dataclass(frozen=True)
class Stage:
    name: str
    room: str  # the package the stage lives in: speculators.<room>.<name>
    summary: str

    @property
    def module(self) -> str:
        return f"speculators.{self.room}.{self.name.replace('-', '_')}"

    def load(self) -> tuple[Callable[..., dict], Callable[[Recipe], bool]]:
        mod = self._module()
        return mod.run, mod.is_complete

    def _module(self) -> Any:
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == self.module or self.module.startswith(exc.name + ".")):
                raise SpeculatorsError(f"stage '{self.name}' is not built yet ({self.module} is missing)") from None
            raise

    def enabled(self, recipe: Recipe) -> bool:
        return bool(self._module().enabled(recipe))


STAGES: tuple[Stage, ...] = (
    Stage("prepare", "data", "chat template -> input_ids + assistant loss mask"),
    Stage("regenerate", "data", "the target rewrites the assistant turns"),
    Stage("capture", "data", "target hidden-state taps -> feature shards + draft vocab"),
    Stage("traffic", "data", "recorded served traffic + a replay share -> weighted feature shards"),
    Stage("train", "train", "train the speculator (accelerate)"),
    Stage("evaluate", "evaluate", "per-position acceptance on held-out workloads"),
    Stage("export", "export", "vLLM-loadable checkpoint + pairing.json"),
    Stage("vllm-check", "export", "serve the export with real vLLM: lossless + acceptance vs prediction"),
)


def stage(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise SpeculatorsError(f"unknown stage {name!r}; stages: {', '.join(s.name for s in STAGES)}")


def _timed(run: Callable[..., dict | None], recipe: Recipe, force: bool) -> dict:
    """A stage's summary, with its wall seconds unless the stage reported its own."""
    t0 = time.time()
    summary = run(recipe, force=force) or {}
    summary.setdefault("seconds", round(time.time() - t0, 1))
    return summary


def cpu_use(window_s: float = 0.3) -> tuple[float, float] | None:
    """(cores busy on the whole machine, cores busy in this process) over the next `window_s` seconds, from
    /proc/stat and this process's CPU time; None where the kernel keeps no /proc/stat."""

    def machine_busy_s() -> float:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user

    try:
        machine0, own0 = machine_busy_s(), time.process_time()
    except (OSError, ValueError, IndexError):
        return None
    time.sleep(window_s)
    return (machine_busy_s() - machine0) / window_s, (time.process_time() - own0) / window_s


def busy_machine_line(name: str, use: tuple[float, float] | None = None) -> str | None:
    """One line when other processes already keep at least half of this machine's cores busy as a stage starts
    (two torch processes on 2 cores run 5-7x slower than one after the other): the cores they use, the cores and the
    threads the stage will use. Measured over a moment now (`cpu_use`), not from the load average, which still holds
    this pipeline's previous stage for a minute. `use`: (machine, own) busy cores, measured when not given."""
    cores = os.cpu_count() or 1
    use = use if use is not None else cpu_use()
    if use is None:
        return None
    others = max(0.0, use[0] - use[1])
    if others < max(1.0, cores / 2) * 0.9:
        return None
    threads = os.environ.get("OMP_NUM_THREADS") or f"{cores} (one per core)"
    return (f"[{name}] this machine is already busy (other processes use {others:.1f} of its {cores} cores): the "
            f"stage's {threads} torch threads will share them and run slower; set OMP_NUM_THREADS or run it when "
            "the other work is done")


def use_threads(recipe: Recipe) -> None:
    """The recipe's `threads` (the stage commands' --threads): torch's CPU pool in this process and
    OMP_NUM_THREADS / MKL_NUM_THREADS of every process a stage starts (each training worker, capture's, vLLM's
    engine takes its own); 0 leaves torch's default (one thread a core) and the environment as they are."""
    if recipe.threads < 0:
        raise SpeculatorsError(f"threads must be >= 0 (0: one a core), got {recipe.threads}")
    if recipe.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(recipe.threads)
        torch = sys.modules.get("torch")  # not imported yet: it reads OMP_NUM_THREADS when it is
        if torch is not None:
            torch.set_num_threads(recipe.threads)


def run_stage(name: str, recipe: Recipe, *, force: bool = False, log: Callable[[str], None] = print) -> dict:
    run, _ = stage(name).load()
    use_threads(recipe)
    return _timed(run, recipe, force)


def run_pipeline(recipe: Recipe, *, only: list[str] | None = None, force: bool = False,
                 log: Callable[[str], None] = print) -> dict[str, dict]:
    """Run every enabled stage in order; skip stages whose outputs are already complete and valid."""
    check_family(recipe.speculator.family, " (speculator.family)")
    use_threads(recipe)
    unknown = sorted(set(only or ()) - {s.name for s in STAGES})
    if unknown:
        raise SpeculatorsError(f"unknown stage(s) {unknown}; stages: {', '.join(s.name for s in STAGES)}")
    results: dict[str, dict] = {}
    for s in STAGES:
        if only and s.name not in only:
            continue
        if not s.enabled(recipe):
            results[s.name] = {"status": "disabled"}
            log(f"[{s.name}] disabled by the recipe")
            continue
        run, is_complete = s.load()
        if not force and is_complete(recipe):
            results[s.name] = {"status": "skipped (complete)"}
            log(f"[{s.name}] outputs complete, skipping")
            continue
        log(f"[{s.name}] {s.summary}")
        busy = busy_machine_line(s.name)
        if busy:
            log(busy)
        summary = _timed(run, recipe, force)
        summary.setdefault("status", "done")
        results[s.name] = summary
    return results
