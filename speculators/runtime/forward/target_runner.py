"""The target's forward over a draft tree (or a prompt chunk) against the static KV cache.

A compact re-implementation of the Llama-family decoder forward (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE:
anything whose layers are `self_attn.{q,k,v,o}_proj` [+ `q_norm`/`k_norm`], `input_layernorm`,
`post_attention_layernorm`, `mlp`) that reuses the Hugging Face modules themselves — embeddings, projections,
norms, MLP / MoE blocks, the rotary-embedding module and its `apply_rotary_pos_emb` — so weights, PEFT adapters
and RoPE scaling variants come for free. Only the attention is done here, with `scaled_dot_product_attention`
over `StaticKVCache` and an explicit boolean mask: every new token sees the committed prefix plus, among the
new tokens, exactly its tree ancestors and itself; positions = committed length + depth. A prompt chunk is the
special case of a chain. The same forward captures the features a speculator asks for: the residual stream
ENTERING the requested layers ("taps") and the post-norm last hidden state ("last_hidden").

Fused path: when every layer is the plain layout (nn.Linear projections, HF RMSNorms, SiLU-gated MLP), q/k/v and
gate/up each run as ONE matrix product over concatenated weights (the modules' parameters become views of them:
no extra memory, HF `generate` unaffected) and RoPE is applied to all query and key heads in one pass — the same
math, fewer operations (decoding is overhead- and memory-bound). Adapter-wrapped or MoE layers use the modules.

`forward_batch` runs several sequences (each with its own cache, tree and mask) in one pass: their rows are stacked
for every matrix product and attention runs per sequence.

Same code on CPU (fp32) and CUDA (bf16); rows of a multi-node tree round differently from a one-token forward in
bf16 (what that means for greedy equality: engine.py). Not here: sampling, verification, KV commits (kv_cache.py), scheduling
several requests (batching.py), CUDA graphs, families with other layer structures (Gemma-style norms, soft-capping,
fused q/k/v, sinks): those run through their own modules (module_runner.py, which `make_runner` picks for them).
Also here: `RunnerBase` (what every runner offers the engine) and the boolean masks both runners build.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators.core.errors import SpeculatorsError, UnsupportedTargetError
from speculators.core.target import base_model, text_config
from speculators.models.base import FeatureRequest
from speculators.models.fused import rope_heads_last
from speculators.models.layers import apply_rope
from speculators.runtime.forward.row_products import FORMS, RowProducts, pad_segment, trim_output
from speculators.runtime.forward.target_cache import StaticKVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


# RMSNorm classes whose forward is exactly w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)
PLAIN_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm")
SILU_CLASSES = ("SiLU", "SiLUActivation")
PLAIN_ROPE_MODULES = ("modeling_llama", "modeling_mistral", "modeling_qwen2", "modeling_qwen3", "modeling_qwen3_moe")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The HF RMSNorm in one fused operation (float32) or three (lower precisions keep HF's rounding order)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _share_storage(owner: nn.Module, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dim and make each module's parameter a
    view into the result: one matrix product computes all of them, and no memory is duplicated (the modules,
    e.g. for Hugging Face `generate`, keep working with the same values). Done once per model: a second runner on
    the same target (several engines share one loaded target) reuses the matrices recorded on `owner`."""
    key = tuple(m.weight.data_ptr() for m in linears)
    done = owner.__dict__.get("_speculators_fused")
    if done is not None and done[0] == key:
        return done[1], done[2]
    weight = torch.cat([m.weight.data for m in linears])  # [sum(out), in]
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None  # all or none
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start:start + rows]
        if bias is not None:
            m.bias.data = bias[start:start + rows]
        start += rows
    owner.__dict__["_speculators_fused"] = (tuple(m.weight.data_ptr() for m in linears), weight, bias)
    return weight, bias


@dataclass
class _FusedLayer:
    """One decoder layer's operands for the fused path: q/k/v in one product, gate/up in one product."""

    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    q_rows: int  # Hq * D
    kv_rows: int  # Hkv * D
    intermediate: int  # I
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V] for the requested rows (all rows unless `logit_rows` was given)
    features: dict[str, torch.Tensor]  # "taps" [T, n_taps*H], "last_hidden" [T, H] as requested
    hidden: torch.Tensor  # [T, H] the final-norm output of every row: `TargetRunner.logits` of any of its rows


@dataclass
class Segment:
    """One sequence's new tokens for `TargetRunner.forward_batch` (see `TargetRunner.forward` for the fields)."""

    cache: StaticKVCache
    input_ids: torch.Tensor  # [T]
    depths: torch.Tensor | None = None  # [T]; None = a chain
    tree_mask: torch.Tensor | None = None  # [T, T] bool; None = causal chain
    logit_rows: torch.Tensor | None = None  # [R]; None = every row, empty = none


@dataclass
class _Plan:
    cache: StaticKVCache
    input_ids: torch.Tensor  # [T_s]
    positions: torch.Tensor  # [T_s]
    start: int  # first cache slot
    rows: slice  # this segment's rows in the stacked block
    mask: torch.Tensor | None  # [1, 1, T_s, S] bool
    causal: bool
    logit_rows: torch.Tensor | None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


def _default_apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class RunnerBase:
    """What every target runner offers the engine: the features it captures, a cache of the right shape, and
    `forward` / `forward_batch` over new tokens (a prompt chunk, a chain, or a tree with its ancestor mask).
    Subclasses set `model`, `layers`, `embed`, `num_kv_heads`, `head_dim`, `vocab_size`, `device`, `dtype` and
    implement `run_segments` and `logits`; `product_forms` names the formulations their products can take
    (row_products.py)."""

    model: Any
    layers: list[Any]
    embed: Any
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    products: RowProducts = RowProducts()  # untuned: plain products, no padding (the engine tunes its runner)
    product_forms: tuple[str, ...] = ("rows",)

    def run_segments(self, segments: list[Segment], capture: bool = True) -> list[ForwardOutput]:
        raise NotImplementedError

    def forward_batch(self, segments: list[Segment], capture: bool = True) -> list[ForwardOutput]:
        """`run_segments`; one segment runs at the row count `products` finds fastest (padding rows dropped)."""
        if len(segments) == 1:
            seg = segments[0]
            n = int(seg.input_ids.shape[0])
            rows = self.products.padded_rows(n, seg.cache.free)
            if rows > n:
                return [trim_output(self.run_segments([pad_segment(seg, rows)], capture)[0], n)]
        return self.run_segments(segments, capture)

    def run_segments_with(self, products: RowProducts, input_ids: torch.Tensor, cache: StaticKVCache,
                          logit_rows: torch.Tensor) -> None:
        """One forward of `input_ids` [T] as a chain with `products` (unpadded; for `tune_row_products`)."""
        saved, self.products = self.products, products
        try:
            self.run_segments([Segment(cache, input_ids, logit_rows=logit_rows)], capture=False)
        finally:
            self.products = saved

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def set_features(self, features: FeatureRequest | None) -> None:
        taps = tuple(features.tap_layer_ids or ()) if features else ()
        bad = [i for i in taps if not 0 <= i < len(self.layers)]
        if bad:
            raise SpeculatorsError(f"speculator asks for taps entering layers {bad}, but the target has "
                                   f"{len(self.layers)} layers; it was trained for another target")
        self.tap_layers = taps
        self.want_last_hidden = bool(features and features.last_hidden)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def cache_bytes(self, max_len: int) -> int:
        """Bytes of one `new_cache(max_len)` ([L, 2, Hkv, max_len, D] in the runner's dtype)."""
        return self.num_layers * 2 * self.num_kv_heads * int(max_len) * self.head_dim * self.dtype.itemsize

    def new_cache(self, max_len: int) -> StaticKVCache:
        return StaticKVCache(self.num_layers, self.num_kv_heads, self.head_dim, max_len, self.device, self.dtype)

    def forward(self, cache: StaticKVCache, input_ids: torch.Tensor, depths: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logit_rows: torch.Tensor | None = None,
                capture: bool = True) -> ForwardOutput:
        """Run T new tokens placed at cache slots [cache.length, cache.length + T).

        input_ids [T]; depths [T] (None = a chain: 0..T-1); tree_mask [T, T] bool (None = causal chain):
        mask[i, j] = token j is token i or one of its ancestors. logit_rows [R] (None = every row; an empty tensor
        skips the output head: `logits(out.hidden[rows])` computes any rows later).
        Does NOT advance cache.length: the caller commits what it keeps.
        """
        return self.forward_batch([Segment(cache, input_ids, depths, tree_mask, logit_rows)], capture)[0]

    def _plan(self, seg: Segment, offset: int) -> _Plan:
        """Where a segment's rows go (from `offset` in the stacked block), its positions and its attention mask
        (None when plain causal or full)."""
        start = seg.cache.length
        n = int(seg.input_ids.shape[0])
        dev = self.device
        chain = seg.depths is None
        depths = torch.arange(n, device=dev) if chain else seg.depths.to(dev)  # [T_s]
        positions = start + depths  # [T_s]
        if not chain:
            mask = prefix_tree_mask(start, positions, seg.tree_mask.to(dev))  # [1, 1, T_s, S] bool
        elif n > 1 and start > 0:
            mask = prefix_tree_mask(start, positions, None)
        else:
            mask = None  # one query token sees everything, or a causal prompt from slot 0
        return _Plan(cache=seg.cache, input_ids=seg.input_ids.to(dev), positions=positions, start=start,
                     rows=slice(offset, offset + n), mask=mask, causal=chain and start == 0 and n > 1,
                     logit_rows=seg.logit_rows)


class TargetRunner(RunnerBase):
    """Runs a loaded Hugging Face causal LM over new tokens with a `StaticKVCache`."""

    product_forms = FORMS

    def __init__(self, model: Any, features: FeatureRequest | None = None) -> None:
        self.model = model
        hf = base_model(model)
        cfg = text_config(hf.config)
        model_type = getattr(cfg, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedTargetError(
                f"the bundled runtime cannot run target model type {model_type!r} (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); serve this target with vLLM instead")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(cfg, key, None):
                raise UnsupportedTargetError(f"the bundled runtime does not implement {key} (target {model_type})")
        decoder = hf.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.rotary = getattr(decoder, "rotary_emb", None)
        self.lm_head = hf.get_output_embeddings()
        if self.rotary is None or self.lm_head is None:
            raise SpeculatorsError(f"target {model_type}: no rotary embedding / output head found; unsupported layout")
        attn0 = self.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not all(hasattr(layer.self_attn, name) for layer in self.layers):
                raise SpeculatorsError(f"target {model_type}: attention without {name}; unsupported layout")
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.windows = [self._window(layer, cfg, model_type) for layer in self.layers]
        self.qk_norms = [(getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))
                         for layer in self.layers]
        module = sys.modules.get(type(attn0).__module__)
        self.apply_rope: Callable = getattr(module, "apply_rotary_pos_emb", None) or _default_apply_rope
        # HF's standard apply_rotary_pos_emb (q * cos + rotate_half(q) * sin) in the Llama-layout families
        self.plain_rope = self.apply_rope is _default_apply_rope or (
            getattr(self.apply_rope, "__module__", "").rsplit(".", 1)[-1] in PLAIN_ROPE_MODULES)
        self.vocab_size = int(cfg.vocab_size)
        self.fused = self._fuse_layers()
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.set_features(features)

    def _fuse_layers(self) -> list[_FusedLayer] | None:
        """The fused path's operands, when every layer is the plain Llama layout (nn.Linear projections without
        adapters, HF RMSNorms, a SiLU-gated MLP); else None and the forward calls the HF modules one by one.
        Fewer, larger products matter at decoding sizes: on a CPU each operation has a fixed cost (measured on
        the house target, A/B in one process: a 1-token forward 4-9% faster), on a GPU each is a kernel launch."""
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            projections = [a.q_proj, a.k_proj, a.v_proj, getattr(m, "gate_proj", None), getattr(m, "up_proj", None)]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if (any(type(p) is not nn.Linear for p in projections)
                    or any(type(n).__name__ not in PLAIN_RMSNORMS for n in norms)
                    or type(getattr(m, "act_fn", None)).__name__ not in SILU_CLASSES
                    or len({p.bias is None for p in projections[:3]}) > 1
                    or len({p.bias is None for p in projections[3:]}) > 1):
                return None
        fused = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _share_storage(a, [a.q_proj, a.k_proj, a.v_proj])
            gate_up_w, gate_up_b = _share_storage(m, [m.gate_proj, m.up_proj])
            fused.append(_FusedLayer(
                qkv_weight=qkv_w, qkv_bias=qkv_b, gate_up_weight=gate_up_w, gate_up_bias=gate_up_b,
                q_rows=a.q_proj.weight.shape[0], kv_rows=a.k_proj.weight.shape[0],
                intermediate=m.gate_proj.weight.shape[0], input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight, eps=float(layer.input_layernorm.variance_epsilon)))
        return fused

    def _attention_inputs(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [1, T, H], cos/sin [1, T, D] -> q [1, Hq, T, D], k [1, Hkv, T, D] (q/k norms and RoPE applied),
        v [1, Hkv, T, D]."""
        n, d = h.shape[1], self.head_dim
        if self.fused is None:
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # [1, T, H]
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            f = self.fused[i]
            qkv = self.products.linear(_rms_norm(h, f.input_norm, f.eps), f.qkv_weight, f.qkv_bias)  # [1, T, (Hq + 2 Hkv) D]
            if self.plain_rope and self.qk_norms[i] == (None, None):
                # the standard half-rotation RoPE on the queries and keys of all heads in one pass (same math)
                qk = rope_heads_last(qkv[..., :f.q_rows + f.kv_rows].view(1, n, -1, d), cos[:, :, None],
                                     sin[:, :, None])  # [1, T, Hq + Hkv, D]
                heads = f.q_rows // d
                v = qkv[..., f.q_rows + f.kv_rows:].view(1, n, -1, d)
                return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
            q, k, v = qkv.split([f.q_rows, f.kv_rows, f.kv_rows], dim=-1)
        q, k, v = q.view(1, n, -1, d), k.view(1, n, -1, d), v.view(1, n, -1, d)  # [1, T, heads, D]
        q_norm, k_norm = self.qk_norms[i]
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, H*, T, D]
        return q, k, v.transpose(1, 2)

    def _mlp(self, i: int, layer: Any, h: torch.Tensor) -> torch.Tensor:
        """h [1, T, H] -> the MLP (or MoE) block's output [1, T, H] on post_attention_layernorm(h)."""
        if self.fused is None:
            out = layer.mlp(layer.post_attention_layernorm(h))
            return out[0] if isinstance(out, tuple) else out
        f = self.fused[i]
        gate_up = self.products.linear(_rms_norm(h, f.post_norm, f.eps), f.gate_up_weight, f.gate_up_bias)  # [1, T, 2I]
        return self._project(layer.mlp.down_proj, F.silu(gate_up[..., :f.intermediate]) * gate_up[..., f.intermediate:])

    def _project(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """A projection module on x [..., In]: a plain nn.Linear in this row count's formulation, else the module."""
        if type(module) is nn.Linear:
            return self.products.linear(x, module.weight, module.bias)
        return module(x)

    @staticmethod
    def _window(layer: Any, cfg: Any, model_type: str) -> int | None:
        win = getattr(layer.self_attn, "sliding_window", None)
        if win is None and model_type == "mistral":
            win = getattr(cfg, "sliding_window", None)
        return int(win) if win else None

    @torch.no_grad()
    def run_segments(self, segments: list[Segment], capture: bool = True) -> list[ForwardOutput]:
        """`forward` for several sequences (each with its own cache) in ONE pass: their tokens are stacked into
        one row block for every matrix product (embeddings, q/k/v, o, MLP), attention runs per sequence against
        its own cache and mask. On hardware where a decoding step is bound by reading the weights, B sequences
        cost little more than one. Rows never mix: each sequence's outputs are those of its own `forward`."""
        plans: list[_Plan] = []
        for seg in segments:
            plans.append(self._plan(seg, plans[-1].rows.stop if plans else 0))
        want_taps = capture and bool(self.tap_layers)
        ids = torch.cat([p.input_ids for p in plans]) if len(plans) > 1 else plans[0].input_ids  # [T]
        positions = torch.cat([p.positions for p in plans]) if len(plans) > 1 else plans[0].positions  # [T]
        total = int(ids.shape[0])
        h = self.embed(ids[None])  # [1, T, H]
        cos, sin = self.rotary(h, positions[None])  # [1, T, D] each
        taps: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if want_taps and i in self.tap_layers:
                taps.append(h[0])
            q, k, v = self._attention_inputs(i, layer, h, cos, sin)  # [1, Hq | Hkv, T, D], RoPE applied
            outs = [self._attend(i, p, q[:, :, p.rows], k[0, :, p.rows], v[0, :, p.rows]) for p in plans]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, Hq, T, D]
            h = h + self._project(layer.self_attn.o_proj, out.transpose(1, 2).reshape(1, total, -1))
            h = h + self._mlp(i, layer, h)  # [1, T, H]
        last = self.norm(h)[0]  # [T, H]
        results = []
        for p, logits in zip(plans, self._head_rows(last, plans), strict=True):
            rows = last[p.rows]  # [T_s, H]
            features: dict[str, torch.Tensor] = {}
            if want_taps:
                features["taps"] = torch.cat([t[p.rows] for t in taps], dim=-1)  # [T_s, n_taps*H]
            if capture and self.want_last_hidden:
                features["last_hidden"] = rows
            results.append(ForwardOutput(logits=logits, features=features, hidden=rows))
        return results

    def _head_rows(self, last: torch.Tensor, plans: list[_Plan]) -> list[torch.Tensor]:
        """The output head on every segment's requested rows: ONE product over all of them when several segments
        share the forward (the head reads its weights once), else the segment's own. -> [R_s, V] per segment"""
        dev = self.device
        picks = [torch.arange(p.rows.start, p.rows.stop, device=dev) if p.logit_rows is None
                 else p.logit_rows.to(dev) + p.rows.start for p in plans]  # [R_s] rows of `last`
        if len(plans) == 1:
            return [self.logits(last if plans[0].logit_rows is None else last[picks[0]])]
        logits = self.logits(last[torch.cat(picks)])  # [sum R_s, V]
        return list(logits.split([int(x.shape[0]) for x in picks]))

    def _attend(self, i: int, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One segment's attention in layer i: q [1, Hq, T_s, D]; k, v [Hkv, T_s, D] are written to its cache
        first. -> [1, Hq, T_s, D]"""
        n = q.shape[2]
        plan.cache.write(i, k, v, plan.start)
        keys, values = plan.cache.keys_values(i, plan.start + n)  # [Hkv, S, D]
        mask, causal = plan.mask, plan.causal
        win = self.windows[i]
        if win is not None and plan.start + n > win:
            if win not in plan.window_masks:
                plan.window_masks[win] = window_mask(plan.start, plan.positions, plan.mask, win)
            mask, causal = plan.window_masks[win], False
        return F.scaled_dot_product_attention(
            q, keys[None], values[None], attn_mask=mask, is_causal=causal, scale=self.scaling,
            enable_gqa=self.num_kv_heads != self.num_heads)  # [1, Hq, T_s, D]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden rows [R, H] (from `ForwardOutput.hidden`) -> logits [R, V]. On CPU as
        `RowProducts.head` runs it (a few rows times a wide vocabulary as W @ rows^T; one row as two where the
        tuning measured that faster); same dot products."""
        if rows.shape[0] == 0:
            return rows.new_empty(0, self.vocab_size)
        head = self.lm_head
        if self.device.type == "cpu" and type(head) is torch.nn.Linear and head.bias is None:
            return self.products.head(rows, head.weight)
        return head(rows)


def prefix_tree_mask(start: int, positions: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[1, 1, T, start + T] bool (True = attend): the committed prefix, then the tree's ancestor mask (causal if
    None), for T new tokens at `positions` [T] placed at cache slots [start, start + T)."""
    n = positions.shape[0]
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    prefix = torch.ones(n, start, dtype=torch.bool, device=positions.device)
    return torch.cat([prefix, tree_mask], dim=1)[None, None]


def window_mask(start: int, positions: torch.Tensor, mask: torch.Tensor | None, window: int) -> torch.Tensor:
    """`mask` (None = causal) restricted to keys with position > query position - window (HF sliding-window
    semantics). -> [1, 1, T, start + T] bool"""
    base = mask if mask is not None else prefix_tree_mask(start, positions, None)
    key_pos = torch.cat([torch.arange(start, device=positions.device), positions])  # [S]
    near = key_pos[None, :] > positions[:, None] - window  # [T, S]
    return base & near[None, None]
