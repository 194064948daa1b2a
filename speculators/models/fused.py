"""The drafting fast path of a draft decoder stack: the math of `layers.run_layers` in fewer, larger operations.

What it does:
- `FusedStack.of(layers)` copies each `DecoderLayer`'s weights into a drafting layout: q/k/v concatenated into one
  matrix and gate/up into another (a layer runs 4 matrix products instead of 7), norms applied with `F.rms_norm`,
  RoPE applied to the queries and keys of all heads in one pass. At drafting sizes (one to a few rows) every
  operation costs about the same fixed overhead on a CPU, so fewer operations is what makes a draft step cheap;
  on a GPU it means fewer kernel launches.
- The copy is rebuilt when a parameter changes (a `.to()`, a weight load, an optimizer step): `of()` keys its cache
  on the parameters' storage, version, dtype and device.

What it does not do: training (no autograd: the copies are detached), the attention itself (the caller's `attend`
owns keys and values), other layer layouts than `layers.DecoderLayer`. Outputs match `run_layers` up to float
rounding (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from speculators.models.layers import AttendFn, DecoderLayer


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat([p.detach() for p in parts]).contiguous()


def rope_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, hd], cos/sin [B, S, 1, hd] -> x rotated (half-rotation layout, as `layers.apply_rope`): the
    queries and keys of all heads in one pass when they sit side by side."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class _Layer:
    fused_input: bool  # EAGLE-3's first layer: q/k/v read cat(norm(x), hidden_norm(hidden)), residual = hidden
    input_norm: torch.Tensor  # [H]
    hidden_norm: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    qkv_w: torch.Tensor  # [(nh + 2 nkv) hd, in]
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd] (Qwen3 layout)
    k_norm: torch.Tensor | None
    o_w: torch.Tensor  # [H, nh hd]
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor  # [2 I, H]
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor  # [H, I]
    down_b: torch.Tensor | None

    @classmethod
    def of(cls, layer: DecoderLayer) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        qk_norm = bool(getattr(a, "qk_norm", False))
        return cls(
            fused_input=bool(layer.fused), input_norm=layer.input_layernorm.weight.detach(),
            hidden_norm=layer.hidden_norm.weight.detach() if layer.fused else None,
            post_norm=layer.post_attention_layernorm.weight.detach(), eps=float(layer.input_layernorm.eps),
            qkv_w=_cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            qkv_b=_cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
            q_norm=a.q_norm.weight.detach() if qk_norm else None, k_norm=a.k_norm.weight.detach() if qk_norm else None,
            o_w=a.o_proj.weight.detach(), o_b=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
            gate_up_w=_cat([m.gate_proj.weight, m.up_proj.weight]), gate_up_b=_cat([m.gate_proj.bias, m.up_proj.bias]),
            down_w=m.down_proj.weight.detach(), down_b=None if m.down_proj.bias is None else m.down_proj.bias.detach())


class FusedStack:
    """A drafting copy of a `DecoderLayer` stack; `run` has the signature and result of `layers.run_layers`."""

    def __init__(self, layers: nn.ModuleList) -> None:
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.layers = [_Layer.of(layer) for layer in layers]
        self.intermediate = self.layers[0].down_w.shape[1]

    @staticmethod
    def _key(layers: nn.ModuleList) -> tuple:
        return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in layers.parameters())

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
    def run(self, x: torch.Tensor, hidden: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            attend: AttendFn) -> torch.Tensor:
        """x [B, S, H] (+ hidden [B, S, H] for a fused first layer), cos/sin [B, S, hd] -> [B, S, H] pre-norm."""
        b, s, _ = x.shape
        nh, nkv, hd, inter = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate
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
            qkv = F.linear(a, layer.qkv_w, layer.qkv_b)  # [B, S, (nh + 2 nkv) hd]
            v = qkv[..., (nh + nkv) * hd:].view(b, s, nkv, hd)
            if layer.q_norm is None:
                qk = rope_heads_last(qkv[..., :(nh + nkv) * hd].view(b, s, nh + nkv, hd), cos, sin)  # [B, S, nh + nkv, hd]
                q, k = qk[:, :, :nh], qk[:, :, nh:]
            else:
                q = F.rms_norm(qkv[..., :nh * hd].view(b, s, nh, hd), (hd,), layer.q_norm, layer.eps)
                k = F.rms_norm(qkv[..., nh * hd:(nh + nkv) * hd].view(b, s, nkv, hd), (hd,), layer.k_norm, layer.eps)
                q, k = rope_heads_last(q, cos, sin), rope_heads_last(k, cos, sin)
            o = attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, nh, S, hd]
            h = residual + F.linear(o.transpose(1, 2).reshape(b, s, nh * hd), layer.o_w, layer.o_b)
            gu = F.linear(F.rms_norm(h, size, layer.post_norm, layer.eps), layer.gate_up_w, layer.gate_up_b)
            h = h + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], layer.down_w, layer.down_b)  # [B, S, H]
        return h
