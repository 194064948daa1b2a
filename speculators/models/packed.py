"""Float16 weights with float32 activations on CPUs: FBGEMM's packed float16 matrix products for drafting.

What it does:
- `PackedProduct(weight, bias)`: x [..., in] float32 -> x W^T + b [..., out] float32 with W rounded to float16 (the
  bias stays float32). At drafting sizes (one to a few rows) this kernel is 2-3x faster than a float32 or float16
  `F.linear` of the same shape on this project's CPUs: it reads half the bytes of float32 and, unlike a float16
  `F.linear` on CPU, has a fast few-row path.
- `PackedLinear` / `pack_linears(module)`: every `nn.Linear` of a drafting copy of a speculator becomes such a
  product (inference only); norms, attention and KV caches stay float32 (float16 attention is 2.5x slower than
  float32 on CPU).

What it does not do: GPUs (CUDA keeps dense float16/bfloat16 weights), training, other CPUs' kernels: where this
torch build has no packed float16 kernel (`packed_float16_available()`), callers keep the dense path. The compiled
draft layer that runs these products is `fused.packed_layer_kernel`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def packed_float16_available() -> bool:
    """Whether this torch build has the CPU packed float16 linear kernel (FBGEMM; x86 builds)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(2, 2), None)
        return bool(torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 2), packed).shape == (1, 2))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedProduct:
    """x [..., in] float32 -> x W^T + b [..., out] float32, W rounded to float16 (the bias kept in float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.params = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(),
                                                              None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16.default(x, self.params)


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose product is a `PackedProduct` on CPU.

    `weight` / `bias` stay float32 parameters (the weight rounded to float16 values, so every path computes the same
    product); the packed copy is rebuilt if the weight changes in place. Inputs on other devices fall back to
    `F.linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight = nn.Parameter(linear.weight.detach().half().float(), requires_grad=False)  # [out, in]
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(),
                                                                      requires_grad=False)  # [out]
        self._packed: tuple[tuple, PackedProduct] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.device.type != "cpu" or self.weight.device.type != "cpu":
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        key = (self.weight._version, self.weight.data_ptr(), None if self.bias is None else self.bias._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, PackedProduct(self.weight, self.bias))
        if x.dim() == 1:  # the kernel wants a leading dimension
            return self._packed[1](x.float()[None])[0]
        return self._packed[1](x.float())


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` inside `module` (float32, on CPU) by a `PackedLinear`; returns how many. The module
    is for drafting afterwards (inference only). Nothing is replaced where `packed_float16_available()` is false."""
    if not packed_float16_available():
        return 0
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
