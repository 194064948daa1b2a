"""Helpers of the GPU checks: the house target and Hugging Face references on a device and dtype, and the
near-tie rule that says when a greedy divergence is rounding rather than a bug."""

from __future__ import annotations

import functools
import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=4)
def hf_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=4)
def loaded_target(path: str, device: str, dtype: str):
    from speculators.core.config import TargetConfig
    from speculators.core.target import load_target

    return load_target(TargetConfig(name_or_path=path, device=device, dtype=dtype))


def hf_greedy(path: str, device: str, dtype: str, ids: list[int], max_new: int) -> list[int]:
    return list(_hf_greedy(path, device, dtype, tuple(ids), max_new))


@functools.lru_cache(maxsize=256)
def _hf_greedy(path: str, device: str, dtype: str, ids: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    """HF `generate(do_sample=False)` continuation, cached (every drafter is compared with the same references)."""
    model = hf_model(path, device, dtype)
    inp = torch.tensor([ids], device=device)
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=model.generation_config.pad_token_id)
    return tuple(out[0, len(ids):].tolist())


def top2(path: str, device: str, dtype: str, ids: list[int]) -> tuple[float, float]:
    """(top-1 logit, top-1 minus top-2) of the HF forward after `ids`, in that dtype."""
    with torch.no_grad():
        logits = hf_model(path, device, dtype)(torch.tensor([ids], device=device)).logits[0, -1].float()
    v = torch.topk(logits, 2).values
    return float(v[0]), float(v[0] - v[1])


def near_tie_limit(dtype: str, top: float, device: str) -> float:
    """The largest top-2 margin a greedy divergence may have and still count as rounding.
    float32: 1e-4 on CPU (as the integration tests), 1e-3 on CUDA (its kernels reduce a tree-shaped forward in
    another order than a one-token forward). bfloat16: 4 units in the last place of the top logit (8 mantissa
    bits: logits are coarse, and exact bf16 ties are common — measured on the house target on CPU: 1 of 18 rows
    diverged, at a bf16 margin of 0.0)."""
    if dtype == "float32":
        return 1e-3 if device.startswith("cuda") else 1e-4
    return 4 * 2.0 ** (math.floor(math.log2(max(abs(top), 1e-6))) - 7)
