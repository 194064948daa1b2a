"""The feature-shard codec every writer and reader of `features/` shares (the format itself: `data/shards.py`).

- int8 storage of hidden states: per-token, per-group absmax (`quantize_int8` / `dequantize_int8`,
  `encode_hidden` / `decode_hidden`, `group_size_for`);
- the top-k teacher's id dtype (`topk_id_dtype`) and the positions it is stored at (`stored_teacher_positions`);
- `check_finite` and `write_shard` (one atomic safetensors file with the "speculators" metadata key).

Capture (`data/capture.py`) and the runtime's traffic recorder (`runtime/recording.py`) write shards with these;
`data/shards.py` reads them. Nothing here runs a model, plans shards or writes manifests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from speculators.core.atomic import atomic_path
from speculators.core.errors import SpeculatorsError
from speculators.core.hashing import sha256_file

FEATURES_FORMAT = "speculators.features/v1"
GROUP_SIZE = 128  # channels per int8 absmax scale


def group_size_for(width: int, group: int = GROUP_SIZE) -> int:
    """Largest divisor of `width` that is <= `group` (so every group is full)."""
    g = min(group, width)
    while width % g:
        g -= 1
    return g


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group absmax int8.  x [N, W] float -> q [N, W] int8, scale [N, W/group] float32"""
    n, w = x.shape
    xg = x.float().reshape(n, w // group, group)
    absmax = xg.abs().amax(dim=-1)  # [N, W/g]
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(xg / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, w), scale.float()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, W] int8, scale [N, G] -> [N, W] float32"""
    n, w = q.shape
    g = scale.shape[1]
    return (q.float().reshape(n, g, w // g) * scale.float().unsqueeze(-1)).reshape(n, w)


def encode_hidden(x: torch.Tensor, storage: str, name: str, hidden_size: int) -> dict[str, torch.Tensor]:
    """Storage form of a [N, W] float feature (W a multiple of hidden_size; scale groups never straddle two taps)."""
    if storage == "bf16":
        return {name: x.to(torch.bfloat16).contiguous()}
    q, scale = quantize_int8(x, group_size_for(hidden_size))
    return {name: q.contiguous(), f"{name}_scale": scale.contiguous()}


def decode_hidden(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    if name not in tensors:
        return None
    x = tensors[name]
    if x.dtype == torch.int8:
        return dequantize_int8(x, tensors[f"{name}_scale"])
    return x.float()


def topk_id_dtype(vocab_size: int) -> torch.dtype:
    return torch.int16 if vocab_size <= 32767 else torch.int32


def stored_teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[T] -> [T] bool: positions whose next token is an assistant token: where capture stores the teacher."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    out[:-1] = loss_mask[1:] > 0
    return out


def check_finite(name: str, x: torch.Tensor, where: str) -> None:
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise SpeculatorsError(f"{where}: {name} contains NaN/Inf; the target produced non-finite values "
                               "(try target.dtype=float32)")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[str, int]:
    """Atomically write a shard (temp file, fsync, rename); returns (sha256, bytes)."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"speculators": json.dumps(meta, sort_keys=True)})
        digest = sha256_file(tmp)
        size = tmp.stat().st_size
    return digest, size
