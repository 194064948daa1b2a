"""KV memory sized by the work and checked against the machine before it is allocated.

- `work_max_len(prompt_lengths, max_new_tokens, tree_nodes)`: the cache length a batch of requests needs (its
  longest prompt + new tokens + room for one draft tree), instead of the target's maximum context.
- `available_bytes(device)`: memory that can still be allocated there (CPU: `MemAvailable` of /proc/meminfo, else
  total physical memory; CUDA: `torch.cuda.mem_get_info`).
- `check_fits(need, device, what, advice)`: one-line `SpeculatorsError` when `need` bytes exceed what is available
  (less a safety margin), raised before anything is allocated.

A real target shows why: SmolLM2-135M's KV cache is 46 KB per token in fp32 (30 layers x 2 x 3 heads x 64 x 4 B),
so 64 slots of its 8,192-token context need 24 GB, while rows of 1,024 tokens need 3 GB.

Not here: the cache itself (kv_cache.py), which requests share a forward (batching.py), model weights' memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from speculators.core.errors import SpeculatorsError

# what a check leaves free for everything else the process allocates (activations, logits, the allocator's slack)
SAFETY_FRACTION = 0.85
GIB = 1024 ** 3


def work_max_len(prompt_lengths: Iterable[int], max_new_tokens: int | Iterable[int], tree_nodes: int = 0) -> int:
    """KV cache length for requests of these prompt lengths and new-token budgets (one int for all, or one each):
    the longest prompt + its budget + `tree_nodes` slots a draft tree may fill past the last committed token."""
    lengths = list(prompt_lengths)
    budgets = [int(max_new_tokens)] * len(lengths) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(lengths):
        raise ValueError(f"{len(lengths)} prompt lengths but {len(budgets)} new-token budgets")
    longest = max((p + b for p, b in zip(lengths, budgets, strict=True)), default=1)
    return max(2, longest + int(tree_nodes) + 1)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes(device: torch.device | str) -> int:
    """Bytes that can still be allocated on `device` now."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    avail = _meminfo_available()
    if avail is not None:
        return avail
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_fits(need: int, device: torch.device | str, what: str, advice: str) -> None:
    """Raise SpeculatorsError (one line) when `need` bytes on `device` exceed the available memory's safe share."""
    have = available_bytes(device)
    if need > SAFETY_FRACTION * have:
        raise SpeculatorsError(f"{what} need {need / GIB:.2f} GiB but {torch.device(device).type} has "
                               f"{have / GIB:.2f} GiB available; {advice}")
