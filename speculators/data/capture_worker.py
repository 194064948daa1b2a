"""One capture process under `accelerate launch` (multi-process / multi-GPU capture).

    accelerate launch --multi_gpu --num_processes N -m speculators.cli worker-capture RECIPE.yaml [--force]

Every rank validates the recipe (`capture.make_job`); rank 0 prepares `features.partial/` (resume or fresh);
rank r then writes shards r, r+N, ... on its own device; after a barrier rank 0 checks all shards, writes the
token frequencies, the draft vocabulary and the merged manifest, and moves the output into place. On CPU the
processes use gloo (`Accelerator(cpu=True)`). `speculators capture` starts this when `capture.num_processes > 1`.

This module only wires accelerate to `speculators.data.capture`; it does no capture work of its own and parses
no arguments (`cli.py`'s hidden `worker-capture` command calls `run_rank`).
"""

from __future__ import annotations

import logging
import sys
import time

import torch
from accelerate import Accelerator

from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import load_recipe
from speculators.data import capture

log = logging.getLogger(__name__)


def run_rank(recipe: str, overrides: list[str], force: bool) -> None:
    """This process's share of a launched capture (every rank calls it); exits 2 on a user error on any rank."""
    t0 = time.time()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = acc.process_index, acc.num_processes
    failed = torch.zeros(1)
    job = None
    try:
        r = load_recipe(recipe, overrides)
        job = capture.make_job(r)
        if rank == 0:
            capture.setup_partial(job, force)
    except SpeculatorsError as exc:
        log.error("[rank %d] %s", rank, exc)
        failed += 1
    failed = acc.reduce(failed.to(acc.device), reduction="sum").cpu()
    if int(failed.item()):
        sys.exit(2)
    try:
        capture.capture_rank(job, rank, world, device=str(acc.device))
    except SpeculatorsError as exc:
        log.error("[rank %d] %s", rank, exc)
        sys.exit(2)
    acc.wait_for_everyone()
    if rank == 0 and not capture.missing_shards(job):  # other nodes' shards missing: the last node finalises
        try:
            capture.finalize(job, time.time() - t0, {"processes": world})
        except SpeculatorsError as exc:
            log.error("%s", exc)
            sys.exit(2)
    acc.wait_for_everyone()
