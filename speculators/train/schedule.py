"""The learning-rate schedule of training (transformers' `get_scheduler`: warmup, then cosine / linear decay or
constant), positioned at a resumed step. It runs no step and touches no model.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

from speculators.core.config import TrainConfig


def lr_schedule(optimizer: Any, t: TrainConfig, total: int, warmup: int, start_step: int = 0) -> LambdaLR:
    """The learning-rate schedule, from transformers (`get_scheduler`): linear warmup over `warmup` optimizer steps,
    then cosine / linear decay to `t.min_lr_ratio` x `t.lr` at `total` (warmup-stable-decay with no stable phase),
    or constant. Positioned at `start_step` (a resumed run continues where it stopped); step it after every
    optimizer step."""
    if t.schedule == "constant":
        name, options = "constant_with_warmup", {}
    else:
        name, options = "warmup_stable_decay", {"num_stable_steps": 0, "num_decay_steps": max(1, total - warmup),
                                                "decay_type": t.schedule, "min_lr_ratio": t.min_lr_ratio}
    for group in optimizer.param_groups:  # a resumed optimizer state holds its last step's lr: start from the recipe's
        group["lr"] = group["initial_lr"] = t.lr
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, scheduler_specific_kwargs=options)
    with warnings.catch_warnings():  # fast-forwarding without optimizer steps is what resuming means
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start_step):
            scheduler.step()
    return scheduler


def warmup_steps(total: int, ratio: float) -> int:
    return int(math.ceil(total * ratio)) if ratio > 0 else 0
