"""The draft decoder shared by EAGLE-3 and MTP, and how it runs in training and in drafting.

What it does:
- `DecoderSpec`: the shape of a draft decoder layer in the Llama or Qwen3 layout (Qwen3 adds per-head q/k RMSNorm),
  derived from any target's config (the draft layout does not follow the target family), and written back as an
  HF `transformer_layer_config` dict.
- `RMSNorm`, `Rotary` (the target's RoPE settings, incl. scaled variants via transformers' frequency helpers),
  `Attention`, `MLP` (SwiGLU), `DecoderLayer` (optionally "fused": EAGLE-3's first layer whose q/k/v read
  `cat(input_layernorm(embed), hidden_norm(hidden))` and whose residual is `hidden`). Parameter names follow the
  HF / vLLM layout (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `hidden_norm`, ...).
- Two attention paths with explicit masks and no HF modules:
  * `ttt_attention` (training-time test): step k at query t sees the step-0 keys at positions <= t (additive
    mask) plus the diagonal keys of steps 1..k at t. O(T^2 + T*k) memory; steps k >= 1 at the live positions
    only (`ttt_live.live_attention`).
  * `kv_cache.cached_attention` (drafting): SDPA over a preallocated `KVCache` with a boolean mask (committed prefix +
    the node's ancestors among the speculative slots).
- Small construction helpers every family uses (`verifier_info`, `target_dims`, `check_full_vocab`; each family's
  options block is its config dataclass, models/<family>/<family>_config.py).

What it does not do: the recurrent draft model built from these layers (recurrent.py), family-specific
inputs/heads (eagle3/eagle3_model.py, mtp/mtp_model.py), tree-building policies (drafting.py), file I/O (io.py), losses (speculators.train).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from speculators.core.errors import SpeculatorsError
from speculators.core.target import text_config
from speculators.models.base import TargetWeights
from speculators.models.kv_cache import AttendFn
from speculators.models.ttt_live import live_attention

DRAFT_ARCHS = ("llama", "qwen3")


# ----------------------------------------------------------------------------------------------------------------
# layer spec


def _rope_parameters(tc: Any) -> dict:
    """The target's RoPE settings as a transformers-5 `rope_parameters` dict (rope_type + rope_theta + extras)."""
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type configs
    if not isinstance(params, dict) or not params:
        scaling = getattr(tc, "rope_scaling", None) or {}
        params = {**scaling, "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", float(getattr(tc, "rope_theta", 10000.0)))
    return params


@dataclass(frozen=True)
class DecoderSpec:
    """Shape of one draft decoder layer (Llama or Qwen3 layout)."""

    arch: str  # "llama" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.arch not in DRAFT_ARCHS:
            raise SpeculatorsError(f"speculator.draft_arch {self.arch!r} is not supported; use one of {DRAFT_ARCHS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpeculatorsError(f"draft num_attention_heads {self.num_attention_heads} is not a multiple of "
                                   f"num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_target(cls, tc: Any, arch: str, intermediate_size: int | None = None) -> DecoderSpec:
        """Draft layer sized like the target's layers; the intermediate size defaults to the target's dense MLP
        size (`intermediate_size`, else 3*H for MoE configs without one)."""
        hidden = int(tc.hidden_size)
        heads = int(tc.num_attention_heads)
        inter = intermediate_size or getattr(tc, "intermediate_size", None) or 3 * hidden
        return cls(arch=arch, hidden_size=hidden, intermediate_size=int(inter), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(tc, "head_dim", None) or hidden // heads),
                   rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
                   max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 4096),
                   rope_parameters=_rope_parameters(tc),
                   attention_bias=bool(getattr(tc, "attention_bias", False)) if arch == "llama" else False,
                   mlp_bias=False, initializer_range=float(getattr(tc, "initializer_range", None) or 0.02))

    @classmethod
    def from_layer_config(cls, d: dict) -> DecoderSpec:
        """Inverse of `layer_config` (reads a `transformer_layer_config` dict)."""
        try:
            rope = d.get("rope_parameters") or {**(d.get("rope_scaling") or {}),
                                                "rope_theta": float(d.get("rope_theta", 10000.0))}
            rope = dict(rope)
            rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default")) or "default"
            return cls(arch=d["model_type"], hidden_size=int(d["hidden_size"]),
                       intermediate_size=int(d["intermediate_size"]),
                       num_attention_heads=int(d["num_attention_heads"]),
                       num_key_value_heads=int(d["num_key_value_heads"]), head_dim=int(d["head_dim"]),
                       rms_norm_eps=float(d["rms_norm_eps"]),
                       max_position_embeddings=int(d["max_position_embeddings"]), rope_parameters=rope,
                       attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
                       initializer_range=float(d.get("initializer_range", 0.02)))
        except KeyError as exc:
            raise SpeculatorsError(f"transformer_layer_config lacks {exc}; the checkpoint config is incomplete") \
                from None

    def layer_config(self, vocab_size: int, num_layers: int) -> dict:
        """HF decoder config of the draft (`transformer_layer_config` in the vLLM speculators format)."""
        rope = dict(self.rope_parameters)
        scaling = None if rope.get("rope_type", "default") == "default" else \
            {k: v for k, v in rope.items() if k != "rope_theta"}
        out = {"model_type": self.arch, "architectures": [
            "LlamaForCausalLM" if self.arch == "llama" else "Qwen3ForCausalLM"],
            "num_hidden_layers": num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "vocab_size": vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling, "rope_parameters": rope,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0,
            "initializer_range": self.initializer_range, "tie_word_embeddings": False, "use_cache": True}
        if self.arch == "llama":
            out.update(mlp_bias=self.mlp_bias, pretraining_tp=1)
        return out


# ----------------------------------------------------------------------------------------------------------------
# modules


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 (HF Llama/Qwen3 semantics)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_frequencies(spec: DecoderSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scaling of the draft's RoPE."""
    rope = spec.rope_parameters
    kind = rope.get("rope_type", "default")
    if kind == "default":
        dim = spec.head_dim
        inv = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv, 1.0

    if kind not in ROPE_INIT_FUNCTIONS:
        raise SpeculatorsError(f"RoPE type {kind!r} of the target is not supported by the draft layer")
    cfg = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                      head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
                      rope_parameters=dict(rope))
    inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    return inv.float(), float(scale)


class Rotary(nn.Module):
    """cos/sin tables for position ids. The frequencies stay float32 whatever dtype the module is cast to."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        inv, self.scaling = rope_frequencies(spec)
        self._inv_freq = {"cpu": inv}
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq["cpu"].to(device)
        return self._inv_freq[key]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., S] long -> cos, sin [..., S, head_dim]"""
        freqs = positions[..., None].float() * self.inv_freq(positions.device)  # [..., S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., S, hd]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` read from a cached table (drafting: one gather instead of six operations per step); the table
        grows to the next power of two past `upto` (the caller's bound on the positions: no device sync), else past
        the largest position asked for."""
        need = int(upto) if upto is not None else int(positions.max()) + 1
        key = (str(positions.device), dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < need:
            table = self.forward(torch.arange(1 << (need - 1).bit_length(), device=positions.device), dtype)
            self._tables[key] = table
        return table[0][positions], table[1][positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, S, hd], cos/sin [B, S, hd] -> [B, h, S, hd]"""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """q/k/v/o projections (+ q_norm/k_norm for the Qwen3 layout); the attention itself is done by the caller."""

    def __init__(self, spec: DecoderSpec, in_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (spec.num_attention_heads, spec.num_key_value_heads,
                                                            spec.head_dim)
        bias = spec.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=bias)
        self.qk_norm = spec.arch == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def project(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """a [B, S, in] -> q [B, nh, S, hd], k [B, nkv, S, hd], v [B, nkv, S, hd] (RoPE applied to q, k)"""
        b, s, _ = a.shape
        q = self.q_proj(a).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(a).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(a).view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. `fused=True` is EAGLE-3's first layer: q/k/v read
    cat(input_layernorm(x), hidden_norm(hidden)) [2H] and the residual is `hidden` (norm_before_residual=False)."""

    def __init__(self, spec: DecoderSpec, fused: bool = False) -> None:
        super().__init__()
        h = spec.hidden_size
        self.fused = fused
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        if fused:
            self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = Attention(spec, 2 * h if fused else h)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def attn_input(self, x: torch.Tensor, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention input [B, S, H or 2H], residual [B, S, H])"""
        if self.fused:
            if hidden is None:
                raise ValueError("a fused (EAGLE-3 first) layer needs the hidden input")
            return torch.cat((self.input_layernorm(x), self.hidden_norm(hidden)), dim=-1), hidden
        return self.input_layernorm(x), x


def run_layers(layers: nn.ModuleList, x: torch.Tensor, hidden: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
    """The decoder stack on x [B, S, H] (+ hidden [B, S, H] for a fused first layer); `attend(layer_index, q, k, v)`
    supplies the attention (it owns the keys/values of other positions and steps). -> [B, S, H] pre-norm output"""
    h = x
    for i, layer in enumerate(layers):
        a, residual = layer.attn_input(h, hidden if i == 0 else None)
        q, k, v = layer.self_attn.project(a, cos, sin)
        o = attend(i, q, k, v)  # [B, nh, S, hd]
        b, nh, s, hd = o.shape
        h = residual + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, s, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def init_linear_weights(module: nn.Module, std: float) -> None:
    """HF-style init: Linear weights ~ N(0, std), biases 0; norms 1."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


# ----------------------------------------------------------------------------------------------------------------
# construction helpers shared by the families


def verifier_info(target_config: Any) -> dict:
    """{name_or_path, architectures} of the target (the exporter overwrites name_or_path with the recipe's)."""
    return {"name_or_path": str(getattr(target_config, "_name_or_path", "") or getattr(target_config, "name_or_path",
                                                                                     "") or ""),
            "architectures": list(getattr(target_config, "architectures", None) or [])}


def target_dims(target_config: Any, weights: TargetWeights) -> tuple[Any, int, int]:
    """(text config, vocab size, hidden size) of a target, with its frozen weights checked against them."""
    tc = text_config(target_config)
    vocab, hidden = int(tc.vocab_size), int(tc.hidden_size)
    for name in ("embed_tokens", "lm_head"):
        t = getattr(weights, name)
        if tuple(t.shape) != (vocab, hidden):
            raise SpeculatorsError(f"target {name} has shape {list(t.shape)}, expected [{vocab}, {hidden}] from the "
                                   "target config; the weights and the config come from different models")
    return tc, vocab, hidden


def check_full_vocab(family: str, draft_vocab_size: int | None, d2t: torch.Tensor | None, vocab: int) -> None:
    """Families that draft over the full target vocabulary (Medusa, MTP) refuse a reduced one."""
    if draft_vocab_size not in (None, vocab) or (d2t is not None and int(torch.as_tensor(d2t).numel()) != vocab):
        raise SpeculatorsError(f"{family} drafts over the full target vocab; unset speculator.draft_vocab_size "
                               "(reduced vocabularies are an eagle3 option)")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------------------
# attention: training-time test (training) and KV-cached drafting (runtime)


def train_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Additive step-0 mask [B, 1, T, T] float32: causal, padded keys removed (a query always sees itself, so no
    row is empty)."""
    b, t = attention_mask.shape
    dev = attention_mask.device
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()  # [T, T]
    allowed = (causal[None] & (attention_mask[:, None, :] > 0)) | torch.eye(t, dtype=torch.bool, device=dev)[None]
    mask = torch.zeros(b, 1, t, t, dtype=torch.float32, device=dev)
    return mask.masked_fill(~allowed[:, None], float("-inf"))


def train_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] of a (left- or right-) padded batch: index among the real tokens."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask0: torch.Tensor,
                  diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Step-k attention of the training-time test.

    q [B, nh, T, hd]; k0/v0 [B, nkv, T, hd] the step-0 keys/values; mask0 [B, 1, T, T] additive; diag_k/diag_v:
    k tensors [B, nkv, T, hd], the keys/values of steps 1..k at the SAME position as the query.
    Query t attends to {step-0 keys s allowed by mask0[t, s]} + {diag_k[i][t] for every i}. -> [B, nh, T, hd]
    """
    b, nh, t, hd = q.shape
    nkv = k0.shape[1]
    g = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    qg = q.reshape(b, nkv, g, t, hd)  # [B, nkv, g, T, hd]
    s0 = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, nkv, g, T, T]
    s0 = s0 + mask0.unsqueeze(1)  # mask [B, 1, 1, T, T]
    sd = [(qg * kd.unsqueeze(2)).sum(-1, keepdim=True).float() * scale for kd in diag_k]  # [B, nkv, g, T, 1] each
    p = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1).to(q.dtype)  # [B, nkv, g, T, T + k]
    out = torch.matmul(p[..., :t], v0.unsqueeze(2))  # [B, nkv, g, T, hd]
    for i, vd in enumerate(diag_v):
        out = out + p[..., t + i: t + i + 1] * vd.unsqueeze(2)
    return out.reshape(b, nh, t, hd)


class TTTAttention:
    """Keys/values of every layer across the unrolled steps of one `forward_train` call.

    Steps k >= 1 may run on a subset of the positions only (`for_step(k, live)`: their queries, keys and values
    are [1, n, N, hd] at the flat positions `live` b*T+t): a query at t reads the step-0 keys and the keys of steps
    1..k at t itself, so positions outside `live` never influence those inside it; their attention is computed
    at the live rows only (`ttt_live.live_attention`)."""

    def __init__(self, num_layers: int, mask0: torch.Tensor) -> None:
        self.mask0 = mask0
        self.k0: list[torch.Tensor | None] = [None] * num_layers
        self.v0: list[torch.Tensor | None] = [None] * num_layers
        self.dk: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.dv: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def for_step(self, step: int, live: torch.Tensor | None = None) -> AttendFn:
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if step == 0:
                self.k0[i], self.v0[i] = k, v
                return ttt_attention(q, k, v, self.mask0, [], [])
            self.dk[i].append(k)
            self.dv[i].append(v)
            if live is not None:  # [1, nh, N, hd]: only the live rows (ttt_live.py)
                return live_attention(q, self.k0[i], self.v0[i], self.mask0, self.dk[i], self.dv[i], live)
            return ttt_attention(q, self.k0[i], self.v0[i], self.mask0, self.dk[i], self.dv[i])  # [B, nh, T, hd]

        return attend

