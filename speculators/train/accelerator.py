"""The accelerate side of training: building the `Accelerator` for the recipe (CPU / DDP / DeepSpeed ZeRO-2/3 /
FSDP, precision), the module wrapper the distributed engines see, and what a run records about its environment
(package versions, peak memory). It trains nothing.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import resource
import sys
from typing import Any

import accelerate
import torch
import transformers
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
from torch import nn
from transformers.integrations import unset_hf_deepspeed_config

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError

# ----------------------------------------------------------------------------------------------------------------
# environment


def package_versions() -> dict:
    out = {"speculators": importlib.metadata.version("speculators"), "torch": torch.__version__,
           "transformers": transformers.__version__, "accelerate": accelerate.__version__,
           "python": platform.python_version()}
    if "deepspeed" in sys.modules:
        out["deepspeed"] = sys.modules["deepspeed"].__version__
    return out


def peak_memory_mb(device: Any) -> float:
    """Peak memory of this process: CUDA max allocated on GPU, max RSS on CPU (MiB)."""
    if getattr(device, "type", str(device)) == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def _reset_accelerate_state() -> None:
    """A fresh accelerate state for in-process runs (tests, train-bench); launched workers start fresh anyway."""
    if os.environ.get("LOCAL_RANK") is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def deepspeed_launched() -> bool:
    """Whether `accelerate launch` started this process under DeepSpeed (it says so in the environment)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def make_accelerator(recipe: Recipe) -> Any:
    _reset_accelerate_state()
    cuda = torch.cuda.is_available() and not recipe.target.device.startswith("cpu")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not cuda:
        raise SpeculatorsError("FSDP needs CUDA GPUs (accelerate runs FSDP on CPU undistributed); on CPU use "
                               "recipes/accelerate/cpu-ddp-2.yaml or deepspeed-zero2.yaml")
    precision = recipe.train.precision
    mixed = "bf16" if precision == "bf16" or (precision == "auto" and cuda) else "no"
    handlers: list[Any] = [DistributedDataParallelKwargs(find_unused_parameters=False)]
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": recipe.train.grad_accum, "mixed_precision": mixed,
                              "step_scheduler_with_optimizer": False}
    if not cuda and deepspeed_launched():
        # accelerate disables DeepSpeed under cpu=True; gloo keeps DeepSpeed and gives every rank its index
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    elif not cuda:
        kwargs["cpu"] = True
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def configure_deepspeed(acc: Any, recipe: Recipe) -> None:
    """Fill the "auto" entries of a DeepSpeed config from the recipe (no model config needed)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    cfg = plugin.deepspeed_config
    t = recipe.train
    values = {"train_micro_batch_size_per_gpu": t.batch_size, "gradient_accumulation_steps": t.grad_accum,
              "gradient_clipping": t.grad_clip, "train_batch_size": t.batch_size * t.grad_accum * acc.num_processes}
    for key, value in values.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    zero = cfg.get("zero_optimization", {})
    for key in [k for k, v in zero.items() if v == "auto"]:
        raise SpeculatorsError(f"DeepSpeed config: zero_optimization.{key} is 'auto', which needs a model config; "
                               "give a number (see recipes/deepspeed/zero3.json)")


@contextlib.contextmanager
def plain_init(acc: Any) -> Any:
    """Build the target and the speculator unpartitioned even under ZeRO-3 (accelerate registers its DeepSpeed
    config with transformers, which would otherwise load the target with zero.Init: empty local weights)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def train_module_class() -> type:
    class _TrainModule(nn.Module):
        """Routes `forward` to the speculator's `forward_train`, so DDP / DeepSpeed / FSDP wrappers see a forward."""

        def __init__(self, spec: Any) -> None:
            super().__init__()
            self.spec = spec

        def forward(self, batch: dict) -> list:
            return self.spec.forward_train(batch)

    return _TrainModule
