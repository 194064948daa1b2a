"""The drafting fast path of a draft decoder stack: the math of `layers.run_layers` in fewer, larger operations.

What it does:
- `FusedStack.of(layers)` copies each `DecoderLayer`'s weights into a drafting layout: q/k/v concatenated into one
  matrix and gate/up into another (a layer runs 4 matrix products instead of 7), norms applied with `F.rms_norm`,
  RoPE applied to the queries and keys of all heads in one pass. At drafting sizes (one to a few rows) every
  operation costs about the same fixed overhead on a CPU, so fewer operations is what makes a draft step cheap;
  on a GPU it means fewer kernel launches.
- The copy is rebuilt when a parameter changes (a `.to()`, a weight load, an optimizer step): `of()` keys its cache
  on the parameters' storage, version, dtype and device.
- A stack whose linears are `packed.PackedLinear`s (float16 weights, float32 activations on CPU) packs its fused
  matrices too, and `run_cached` then runs each layer through the TorchScript kernel `packed_layer_kernel()`
  (same operations, no Python per-operation overhead).

What it does not do: training (no autograd: the copies are detached; a packed module is for inference only), the
attention itself in `run` (the caller's `attend` owns keys and values), other layer layouts than
`layers.DecoderLayer`. Outputs match `run_layers` up to float rounding (tests compare them).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators.models.kv_cache import AttendFn, KVCache
from speculators.models.packed import PackedLinear, PackedProduct, packed_float16_available

Linear = Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> [..., out]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> Linear:
    if packed:
        return PackedProduct(weight, bias)
    return functools.partial(F.linear, weight=weight, bias=bias)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat([p.detach() for p in parts]).contiguous()


def rope_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, hd], cos/sin [B, S, 1, hd] -> x rotated (half-rotation layout, as `layers.apply_rope`): the
    queries and keys of all heads in one pass when they sit side by side."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _packed_decoder_layer(x: torch.Tensor, hidden: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, mask: torch.Tensor,
                          input_norm: torch.Tensor, hidden_norm: torch.Tensor | None, post_norm: torch.Tensor,
                          q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                          qkv: torch.classes.quantized.LinearPackedParamsBase,
                          o: torch.classes.quantized.LinearPackedParamsBase,
                          gate_up: torch.classes.quantized.LinearPackedParamsBase,
                          down: torch.classes.quantized.LinearPackedParamsBase,
                          eps: float, nh: int, nkv: int, hd: int, inter: int) -> torch.Tensor:
    """`FusedStack.run` for one layer with packed products. x/hidden [1, S, H], cos/sin [1, S, 1, hd],
    k_cache/v_cache [nkv, max_len, hd] (this layer's; the S new keys/values go to slots start..start+S-1), mask
    [S, L] bool over slots [0, L) -> [1, S, H] pre-norm output."""
    b, s, width = x.shape[0], x.shape[1], x.shape[2]
    if hidden_norm is not None and hidden is not None:  # EAGLE-3's first layer
        a = torch.cat((F.rms_norm(x, [width], input_norm, eps), F.rms_norm(hidden, [width], hidden_norm, eps)), -1)
        residual = hidden
    else:
        a = F.rms_norm(x, [width], input_norm, eps)
        residual = x
    proj = torch.ops.quantized.linear_dynamic_fp16(a, qkv)  # [1, S, (nh + 2 nkv) hd]
    v = proj[:, :, (nh + nkv) * hd:].view(b, s, nkv, hd)
    if q_norm is not None and k_norm is not None:  # Qwen3 layout: per-head norms before RoPE
        qk = torch.cat((F.rms_norm(proj[:, :, :nh * hd].view(b, s, nh, hd), [hd], q_norm, eps),
                        F.rms_norm(proj[:, :, nh * hd:(nh + nkv) * hd].view(b, s, nkv, hd), [hd], k_norm, eps)), 2)
    else:
        qk = proj[:, :, :(nh + nkv) * hd].view(b, s, nh + nkv, hd)
    qk = rope_heads_last(qk, cos, sin)  # [1, S, nh + nkv, hd]
    k_cache[:, start:start + s] = qk[0, :, nh:].transpose(0, 1)
    v_cache[:, start:start + s] = v[0].transpose(0, 1)
    length = mask.shape[1]
    att = F.scaled_dot_product_attention(qk[:, :, :nh].transpose(1, 2), k_cache[None, :, :length],
                                         v_cache[None, :, :length], attn_mask=mask, enable_gqa=nh != nkv)
    h = residual + torch.ops.quantized.linear_dynamic_fp16(att.transpose(1, 2).reshape(b, s, nh * hd), o)
    gu = torch.ops.quantized.linear_dynamic_fp16(F.rms_norm(h, [width], post_norm, eps), gate_up)  # [1, S, 2I]
    return h + torch.ops.quantized.linear_dynamic_fp16(F.silu(gu[:, :, :inter]) * gu[:, :, inter:], down)


@functools.cache
def packed_layer_kernel() -> Any:
    """The TorchScript-compiled `_packed_decoder_layer` (the same operations as `FusedStack.run`, without Python's
    per-operation overhead: a 2-row draft step of the house speculator's layer ~330 -> ~200 microseconds, max
    difference 0.0), or None where scripting fails (callers stay eager)."""
    if not packed_float16_available():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated but still the lowest-overhead CPU path
            return torch.jit.script(_packed_decoder_layer)
    except Exception:  # noqa: BLE001 - any scripting failure means: use the eager path
        return None


@dataclass
class _Layer:
    fused_input: bool  # EAGLE-3's first layer: q/k/v read cat(norm(x), hidden_norm(hidden)), residual = hidden
    input_norm: torch.Tensor  # [H]
    hidden_norm: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    qkv: Linear  # in -> (nh + 2 nkv) hd
    q_norm: torch.Tensor | None  # [hd] (Qwen3 layout)
    k_norm: torch.Tensor | None
    o: Linear  # nh hd -> H
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H
    intermediate: int  # I
    packed: bool  # float16 packed products (the layer's linears are `PackedLinear`s)

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:  # a layers.DecoderLayer
        a, m = layer.self_attn, layer.mlp
        qk_norm = bool(getattr(a, "qk_norm", False))
        packed = isinstance(a.q_proj, PackedLinear)

        def fuse(linears: list[nn.Module]) -> Linear:
            return _linear(_cat([lin.weight for lin in linears]), _cat([lin.bias for lin in linears]), packed)

        return cls(
            fused_input=bool(layer.fused), input_norm=layer.input_layernorm.weight.detach(),
            hidden_norm=layer.hidden_norm.weight.detach() if layer.fused else None,
            post_norm=layer.post_attention_layernorm.weight.detach(), eps=float(layer.input_layernorm.eps),
            qkv=fuse([a.q_proj, a.k_proj, a.v_proj]),
            q_norm=a.q_norm.weight.detach() if qk_norm else None, k_norm=a.k_norm.weight.detach() if qk_norm else None,
            o=fuse([a.o_proj]), gate_up=fuse([m.gate_proj, m.up_proj]), down=fuse([m.down_proj]),
            intermediate=int(m.down_proj.weight.shape[1]), packed=packed)


class FusedStack:
    """A drafting copy of a `DecoderLayer` stack; `run` has the signature and result of `layers.run_layers`."""

    def __init__(self, layers: nn.ModuleList) -> None:
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.layers = [_Layer.of(layer) for layer in layers]

    @staticmethod
    def _key(layers: nn.ModuleList) -> tuple:
        return tuple((type(m), p.data_ptr(), p._version, p.dtype, p.device)
                     for m in layers.modules() for p in m.parameters(recurse=False))

    @classmethod
    def of(cls, layers: nn.ModuleList) -> FusedStack:
        """The cached drafting copy of `layers` (rebuilt when any parameter changed since the last call)."""
        key = cls._key(layers)
        cached = getattr(layers, "_speculators_fused", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, cls(layers))
            object.__setattr__(layers, "_speculators_fused", cached)  # not a submodule, not in the state dict
        return cached[1]

    @torch.no_grad()
    def run_cached(self, x: torch.Tensor, hidden: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, start: int, mask: torch.Tensor) -> torch.Tensor:
        """`run` with the attention over `cache` (`KVCache.attend_fn(start, mask)`): x [1, S, H] (+ hidden) ->
        [1, S, H]. Packed stacks go through the compiled layer kernel."""
        kernel = packed_layer_kernel() if all(layer.packed for layer in self.layers) else None
        if kernel is None or x.shape[0] != 1:
            return self.run(x, hidden, cos, sin, cache.attend_fn(start, mask))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [1, S, 1, hd]
        h = x
        for i, layer in enumerate(self.layers):
            h = kernel(h, hidden if layer.fused_input else None, cos, sin, cache.k[i], cache.v[i], start, mask,
                       layer.input_norm, layer.hidden_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                       layer.qkv.params, layer.o.params, layer.gate_up.params, layer.down.params, layer.eps,
                       self.num_heads, self.num_kv_heads, self.head_dim, layer.intermediate)
        return h

    @torch.no_grad()
    def run(self, x: torch.Tensor, hidden: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            attend: AttendFn) -> torch.Tensor:
        """x [B, S, H] (+ hidden [B, S, H] for a fused first layer), cos/sin [B, S, hd] -> [B, S, H] pre-norm."""
        b, s, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, hd]
        h = x
        for i, layer in enumerate(self.layers):
            size = (h.shape[-1],)
            if layer.fused_input:
                a = torch.cat((F.rms_norm(h, size, layer.input_norm, layer.eps),
                               F.rms_norm(hidden, size, layer.hidden_norm, layer.eps)), dim=-1)  # [B, S, 2H]
                residual = hidden
            else:
                a = F.rms_norm(h, size, layer.input_norm, layer.eps)  # [B, S, H]
                residual = h
            qkv = layer.qkv(a)  # [B, S, (nh + 2 nkv) hd]
            v = qkv[..., (nh + nkv) * hd:].view(b, s, nkv, hd)
            if layer.q_norm is None:
                qk = rope_heads_last(qkv[..., :(nh + nkv) * hd].view(b, s, nh + nkv, hd), cos, sin)  # [B, S, nh + nkv, hd]
                q, k = qk[:, :, :nh], qk[:, :, nh:]
            else:
                q = F.rms_norm(qkv[..., :nh * hd].view(b, s, nh, hd), (hd,), layer.q_norm, layer.eps)
                k = F.rms_norm(qkv[..., nh * hd:(nh + nkv) * hd].view(b, s, nkv, hd), (hd,), layer.k_norm, layer.eps)
                q, k = rope_heads_last(q, cos, sin), rope_heads_last(k, cos, sin)
            o = attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, nh, S, hd]
            h = residual + layer.o(o.transpose(1, 2).reshape(b, s, nh * hd))
            gu = layer.gate_up(F.rms_norm(h, size, layer.post_norm, layer.eps))  # [B, S, 2I]
            inter = layer.intermediate
            h = h + layer.down(F.silu(gu[..., :inter]) * gu[..., inter:])  # [B, S, H]
        return h
