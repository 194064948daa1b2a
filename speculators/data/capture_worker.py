"""One capture process under `accelerate launch` (multi-process / multi-GPU capture).

    accelerate launch --multi_gpu --num_processes N -m speculators.data.capture_worker RECIPE.yaml [--force]

Every rank validates the recipe (`capture.make_job`); rank 0 prepares `features.partial/` (resume or fresh);
rank r then writes shards r, r+N, ... on its own device; after a barrier rank 0 checks all shards, writes the
token frequencies, the draft vocabulary and the merged manifest, and moves the output into place. On CPU the
processes use gloo (`Accelerator(cpu=True)`). `speculators capture` starts this when `capture.num_processes > 1`.

This module only wires accelerate to `speculators.data.capture`; it does no capture work of its own.
"""

from __future__ import annotations

import sys
import time

import typer

from speculators.errors import SpeculatorsError


def main(recipe: str, overrides: list[str] | None = typer.Argument(None),
         force: bool = typer.Option(False, "--force")) -> None:
    import torch
    from accelerate import Accelerator

    from speculators.config import load_recipe
    from speculators.data import capture

    t0 = time.time()
    acc = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = acc.process_index, acc.num_processes
    failed = torch.zeros(1)
    job = None
    try:
        r = load_recipe(recipe, overrides or [])
        job = capture.make_job(r)
        if rank == 0:
            capture.setup_partial(job, force)
    except SpeculatorsError as exc:
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        failed += 1
    failed = acc.reduce(failed.to(acc.device), reduction="sum").cpu()
    if int(failed.item()):
        sys.exit(2)
    try:
        capture.capture_rank(job, rank, world, device=str(acc.device))
    except SpeculatorsError as exc:
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        sys.exit(2)
    acc.wait_for_everyone()
    if rank == 0:
        try:
            capture.finalize(job, time.time() - t0, {"processes": world})
        except SpeculatorsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    acc.wait_for_everyone()


if __name__ == "__main__":
    typer.run(main)
