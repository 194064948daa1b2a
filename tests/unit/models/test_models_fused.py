"""The drafting fast path (speculators/models/fused.py) computes what `run_layers` computes, and follows weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_helpers import (
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_target,
)

from speculators.models.fused import FusedStack, packed_layer_kernel
from speculators.models.kv_cache import KVCache
from speculators.models.layers import DecoderLayer, DecoderSpec, Rotary, run_layers
from speculators.models.packed import PackedLinear, pack_linears, packed_float16_available


def _stack(arch: str, first_fused: bool, bias: bool = False, layers: int = 2, seed: int = 0):
    cfg, _ = tiny_target("llama")
    spec = DecoderSpec.from_target(cfg, arch)
    if bias:
        spec = dataclasses.replace(spec, attention_bias=True, mlp_bias=True)
    torch.manual_seed(seed)
    stack = torch.nn.ModuleList([DecoderLayer(spec, fused=first_fused and i == 0) for i in range(layers)])
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0, 0.2)
    return spec, stack


def _run_both(spec, stack, first_fused: bool, cached: bool = False):
    """(run_layers, FusedStack.run or .run_cached) on the same inputs over 3 committed slots; both caches agree."""
    rotary = Rotary(spec)
    g = torch.Generator().manual_seed(1)
    h = spec.hidden_size
    x, hidden = torch.randn(1, 7, h, generator=g), torch.randn(1, 7, h, generator=g)
    hidden = hidden if first_fused else None
    cos, sin = rotary.lookup(torch.arange(3, 10)[None], torch.float32)
    mask = torch.ones(7, 10, dtype=torch.bool).tril(diagonal=3)  # [S, L]: 3 committed slots, then causal
    caches = []
    for _ in range(2):
        cache = KVCache(len(stack), spec.num_key_value_heads, 16, spec.head_dim, "cpu", torch.float32)
        cache.k[:, :, :3] = 0.5
        cache.v[:, :, :3] = -0.25
        caches.append(cache)
    fused = FusedStack.of(stack)
    with torch.no_grad():
        want = run_layers(stack, x, hidden, cos, sin, caches[0].attend_fn(3, mask))
        got = (fused.run_cached(x, hidden, cos, sin, caches[1], 3, mask) if cached
               else fused.run(x, hidden, cos, sin, caches[1].attend_fn(3, mask)))
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-4, rtol=1e-4)
    return want, got


@pytest.mark.parametrize("arch,first_fused,bias", [("llama", True, False), ("llama", False, True),
                                                   ("qwen3", True, False), ("qwen3", False, False)])
def test_fused_stack_equals_run_layers(arch, first_fused, bias):
    spec, stack = _stack(arch, first_fused, bias)
    want, got = _run_both(spec, stack, first_fused)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, got = _run_both(spec, stack, first_fused, cached=True)  # dense weights: run_cached is `run` over the cache
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_copy_follows_weight_changes():
    spec, stack = _stack("llama", True)
    first = FusedStack.of(stack)
    assert FusedStack.of(stack) is first  # cached while nothing changes
    with torch.no_grad():
        stack[1].mlp.up_proj.weight.mul_(2.0)  # in place: same storage, new version
    second = FusedStack.of(stack)
    assert second is not first
    want, got = _run_both(spec, stack, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    stack.to(torch.float64)
    assert FusedStack.of(stack).layers[0].input_norm.dtype == torch.float64
    assert "_speculators_fused" not in str(list(stack.state_dict()))


def test_rotary_lookup_equals_forward_and_grows():
    cfg, _ = tiny_target("llama")
    rotary = Rotary(DecoderSpec.from_target(cfg, "llama"))
    for pos in (torch.tensor([[0, 1, 5]]), torch.tensor([[40, 41]]), torch.tensor([[3]])):
        for dtype in (torch.float32, torch.bfloat16):
            want = rotary(pos, dtype)
            got = rotary.lookup(pos, dtype)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rotary._tables[("cpu", torch.float32)][0].shape[0] == 64  # next power of two past position 41


needs_packed = pytest.mark.skipif(not packed_float16_available(), reason="no packed float16 CPU kernel in this build")


@needs_packed
def test_packed_linear_is_a_float16_weight_product_in_float32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80, bias=True)
    packed = PackedLinear(lin)
    x = torch.randn(3, 5, 48)  # any leading shape
    want = torch.nn.functional.linear(x, lin.weight.half().float(), lin.bias)
    got = packed(x)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 80)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed(x[0, 0]), want[0, 0], atol=1e-5, rtol=1e-5)  # one vector
    assert not torch.equal(packed.weight, lin.weight) and torch.equal(packed.weight, lin.weight.half().float())
    with torch.no_grad():
        packed.weight.mul_(2.0)  # an in-place change re-packs
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, packed.weight, packed.bias), atol=1e-5,
                               rtol=1e-5)


@needs_packed
@pytest.mark.parametrize("arch,first_fused,bias", [("llama", True, False), ("qwen3", False, True),
                                                   ("qwen3", True, False), ("llama", False, True)])
def test_packed_stack_equals_run_layers_with_float16_weights(arch, first_fused, bias):
    spec, stack = _stack(arch, first_fused, bias)
    with torch.no_grad():  # the reference: the same float16-rounded weights in a plain float32 stack
        for m in stack.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.half().float())
    want, _ = _run_both(spec, stack, first_fused)
    assert pack_linears(stack) == 7 * len(stack)
    assert all(layer.packed for layer in FusedStack.of(stack).layers)
    _, got = _run_both(spec, stack, first_fused)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert packed_layer_kernel() is not None
    _, compiled = _run_both(spec, stack, first_fused, cached=True)  # the TorchScript layer kernel
    torch.testing.assert_close(compiled, want, atol=1e-4, rtol=1e-4)
    plain, _ = _run_both(spec, stack, first_fused)  # run_layers through the PackedLinear modules agrees too
    torch.testing.assert_close(plain, want, atol=1e-4, rtol=1e-4)
