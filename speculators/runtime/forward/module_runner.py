"""The target's forward over a draft tree through the model's OWN modules: any decoder-only HF causal LM.

`ModuleTargetRunner` is the general path beside the fused Llama-family `TargetRunner`: it calls the model's own
decoder (`model.get_decoder()`) with
- `position_ids` = committed length + depth of each new token,
- an explicit additive 4D attention mask (the committed prefix + the tree's ancestor mask; HF's mask builders
  return a 4D mask as is), replaced per layer by its sliding-window or attention-chunk restriction through a
  forward pre-hook on the layer's `self_attn` where the context reaches past it,
- a `CacheWriter` as the model's cache: each attention module's `cache.update(k, v, layer_idx)` writes the new
  keys/values into the runtime's `StaticKVCache` at the forward's first slot and reads back slots [0, end).
Everything else — embeddings (and their scaling), fused q/k/v, q/k norms, RoPE variants (per layer type, partial,
LongRoPE), soft-capping, attention sinks, the eager / SDPA attention kernels, MoE blocks, post-norms — is the
model's own code, so the same commits and masks serve Gemma 3, Phi-3, gpt-oss, OLMo 2 and the Llama family alike.
Taps are the residual entering a layer (`target.TapRecorder`'s pre-hooks, as capture records them).

Construction PROVES the path on the model itself (`_probe`): a prompt chunk, a KV commit and a tree with a decoy
branch must give the model's own full-forward logits, every layer must write its keys/values through the cache
(a recurrent or convolution layer keeps a state a tree-masked forward cannot verify), and keys and values must
share one shape across layers. A target that fails any of these raises `UnsupportedTargetError` naming its model
type and the reason, in one line.

Not here: stacking several sequences' rows into one product (`forward_batch` runs one decoder call per
sequence), the fused operations of the Llama path, latent-attention caches (keys and values of different widths),
per-layer KV shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from speculators.core.errors import SpeculatorsError, UnsupportedTargetError
from speculators.core.target import (
    TapRecorder,
    base_model,
    cache_kwarg,
    decoder,
    decoder_layers,
    input_embeddings,
    output_head,
    text_config,
)
from speculators.core.trees import ancestor_mask, depths_of
from speculators.models.base import FeatureRequest
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.forward.target_runner import (
    SUPPORTED_MODEL_TYPES,
    ForwardOutput,
    RunnerBase,
    Segment,
    TargetRunner,
    prefix_tree_mask,
    window_mask,
)

# the probe's tolerance on max |logit difference| / max |logit|: shape-dependent rounding passes, a wrong mask,
# position or cache does not (those change logits by O(1))
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
PROBE_TOLERANCE_LOW_PRECISION = 5e-2


class CacheWriter:
    """What the HF attention modules see as their cache during one runner forward: `update` stores the T new
    keys/values [1, Hkv, T, D] of layer `layer_idx` at slots [start, start + T) of `cache` and returns the keys /
    values of slots [0, start + T) as [1, Hkv, S, D]. `written` records the layers that went through it."""

    def __init__(self, cache: StaticKVCache | None, start: int) -> None:
        self.cache = cache  # None: the probe's first pass, which only records shapes
        self.start = start
        self.written: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}  # layer -> ((Hkv, D) of k, of v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.written[int(layer_idx)] = (_heads_dim(key_states), _heads_dim(value_states))
        if self.cache is None:
            return key_states, value_states
        end = self.start + key_states.shape[2]
        self.cache.write(layer_idx, key_states[0], value_states[0], self.start)
        keys, values = self.cache.keys_values(layer_idx, end)  # [Hkv, S, D]
        return keys[None], values[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start


def _heads_dim(states: torch.Tensor) -> tuple[int, int]:
    return int(states.shape[1]), int(states.shape[3])  # [B, H, T, D] -> (H, D)


Restriction = tuple[str, int]  # ("sliding", window) | ("chunked", chunk size)


def layer_restrictions(layers: list[Any], cfg: Any) -> list[Restriction | None]:
    """What narrows each decoder layer's attention beyond the causal / tree mask (None = nothing), as the model's
    attention reads it: a sliding window — the attention module's own `sliding_window` where it has one (Qwen2,
    Qwen3-MoE, Gemma 3, gpt-oss), else the config's for the layers `layer_types` marks sliding, or for every layer
    when the config has no layer types (Mistral, Phi-3) — or, for the layers `layer_types` marks
    "chunked_attention" (Llama 4), the config's `attention_chunk_size`."""
    win = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    out: list[Restriction | None] = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if types is not None and types[i] == "chunked_attention":
            out.append(("chunked", int(chunk)) if chunk else None)
            continue
        if attn is not None and hasattr(attn, "sliding_window"):
            w = attn.sliding_window
        elif types is not None:
            w = win if types[i] == "sliding_attention" else None
        else:
            w = win
        out.append(("sliding", int(w)) if w else None)
    return out


def restricted_mask(start: int, positions: torch.Tensor, mask: torch.Tensor, restriction: Restriction
                    ) -> torch.Tensor:
    """`mask` [1, 1, T, S] bool narrowed by a layer's restriction: keys within the sliding window (HF semantics:
    key position > query position - window), or in the query's own chunk (position // chunk size equal)."""
    kind, size = restriction
    if kind == "sliding":
        return window_mask(start, positions, mask, size)
    key_pos = torch.cat([torch.arange(start, device=positions.device), positions])  # [S]
    same = (key_pos[None, :] // size) == (positions[:, None] // size)  # [T, S]
    return mask & same[None, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attend-mask -> the additive float mask that both HF's eager and SDPA attention apply."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


class ModuleTargetRunner(RunnerBase):
    """Runs a loaded Hugging Face causal LM over new tokens with a `StaticKVCache`, through its own modules."""

    def __init__(self, model: Any, features: FeatureRequest | None = None) -> None:
        self.model = model
        hf = base_model(model)
        cfg = text_config(hf.config)
        self.model_type = str(getattr(cfg, "model_type", "?"))
        try:
            self.layers = list(decoder_layers(model))
            self.decoder = decoder(model)
        except (SpeculatorsError, AttributeError) as exc:
            raise self._unsupported(f"no decoder layers found ({exc})") from None
        mixers = [i for i, layer in enumerate(self.layers) if getattr(layer, "self_attn", None) is None]
        if mixers:
            raise self._unsupported(f"decoder layers {mixers} have no self-attention (recurrent or convolution "
                                    f"mixers keep a state that a tree-masked verification forward cannot branch)")
        self.embed = input_embeddings(model)
        self.lm_head = output_head(model)
        if self.lm_head is None:
            raise self._unsupported("no output head found")
        self.cache_kw = cache_kwarg(self.decoder)
        self.restrictions = layer_restrictions(self.layers, cfg)
        self.softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.logit_scale = float(getattr(cfg, "logit_scale", None) or 1.0)  # Cohere-style: logits * scale
        self.logits_divisor = float(getattr(cfg, "logits_scaling", None) or 1.0)  # Granite-style: logits / s
        self.vocab_size = int(cfg.vocab_size)
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.set_features(features)
        self.num_kv_heads, self.head_dim = self._kv_shape()
        self._probe()

    def _unsupported(self, why: str) -> UnsupportedTargetError:
        return UnsupportedTargetError(f"the bundled runtime cannot run target model type {self.model_type!r}: "
                                      f"{why}; serve this target with vLLM instead")

    # ---- the forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run_segments(self, segments: list[Segment], capture: bool = True) -> list[ForwardOutput]:
        """`forward` of each sequence, one decoder call each (see `RunnerBase.forward` for the fields)."""
        return [self._forward_one(seg, capture) for seg in segments]

    def _forward_one(self, seg: Segment, capture: bool) -> ForwardOutput:
        plan = self._plan(seg, 0)
        mask = plan.mask if plan.mask is not None else prefix_tree_mask(plan.start, plan.positions, None)
        writer = CacheWriter(plan.cache, plan.start)
        hidden, taps = self._decode(plan.input_ids, plan.positions, mask, writer, capture)
        features: dict[str, torch.Tensor] = {}
        if taps is not None:
            features["taps"] = taps
        if capture and self.want_last_hidden:
            features["last_hidden"] = hidden
        rows = hidden if plan.logit_rows is None else hidden[plan.logit_rows.to(self.device)]
        return ForwardOutput(logits=self.logits(rows), features=features, hidden=hidden)

    def _decode(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, writer: CacheWriter,
                capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [T]; mask [1, 1, T, S] bool -> final-norm hidden [T, H], taps [T, n_taps * H] | None."""
        start, n = writer.start, int(ids.shape[0])
        full = additive(mask, self.dtype)  # [1, 1, T, S]
        narrowed: dict[Restriction, torch.Tensor] = {}
        want_taps = capture and bool(self.tap_layers)
        with ExitStack() as stack:
            for i, r in enumerate(self.restrictions):
                if r is not None and start + n > r[1]:  # else every key is inside the window / the first chunk
                    if r not in narrowed:
                        narrowed[r] = additive(restricted_mask(start, positions, mask, r), self.dtype)
                    stack.enter_context(_masked(self.layers[i].self_attn, narrowed[r]))
            recorder = stack.enter_context(TapRecorder(self.model, list(self.tap_layers))) if want_taps else None
            out = self.decoder(input_ids=ids[None], attention_mask=full, position_ids=positions[None],
                               use_cache=True, **{self.cache_kw: writer})
        taps = recorder.taps()[0] if recorder is not None else None
        return out.last_hidden_state[0], taps

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden rows [R, H] -> logits [R, V], as the model's causal-LM head computes them (output
        head, then the config's logit scale / soft-capping; `_probe` checks they equal the model's)."""
        if rows.shape[0] == 0:
            return rows.new_empty(0, self.vocab_size)
        logits = self.lm_head(rows)  # [R, V]
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ---- proving the path on this model ----------------------------------------------------------------------
    def _probe_ids(self, n: int) -> torch.Tensor:
        return (torch.arange(n, device=self.device) * 7 + 3) % self.vocab_size  # [n]

    @torch.no_grad()
    def _kv_shape(self) -> tuple[int, int]:
        """(kv heads, head dim) as the attention modules hand them to the cache: every layer must write, with
        one shape for keys and values."""
        ids = self._probe_ids(3)
        writer = CacheWriter(None, 0)
        positions = torch.arange(3, device=self.device)
        self._attempt(lambda: self._decode(ids, positions, prefix_tree_mask(0, positions, None), writer, False))
        silent = [i for i in range(len(self.layers)) if i not in writer.written]
        if silent:
            raise self._unsupported(f"layers {silent} keep no keys/values in the cache (a recurrent or convolution "
                                    f"state, which a tree-masked verification forward cannot branch)")
        shapes = {shape for pair in writer.written.values() for shape in pair}
        if len(shapes) != 1:
            raise self._unsupported(f"its keys/values have several shapes {sorted(shapes)} (latent attention or "
                                    f"per-layer head sizes); the runtime's cache needs one")
        heads, dim = next(iter(shapes))
        return int(heads), int(dim)

    @torch.no_grad()
    def _probe(self) -> None:
        """A 5-token prompt chunk, its commit, then a tree [root, a, decoy, a's child] must give the model's own
        logits of the true path (one full causal forward without a cache)."""
        ids = self._probe_ids(8)
        reference = self.model(input_ids=ids[None], use_cache=False).logits[0].float()  # [8, V]
        cache = self.new_cache(16)
        parents = torch.tensor([-1, 0, 0, 1], device=self.device)
        tokens = torch.stack([ids[5], ids[6], (ids[6] + 1) % self.vocab_size, ids[7]])  # node 2 is a decoy

        def prompt_then_tree() -> torch.Tensor:
            prompt = self.forward(cache, ids[:5], capture=False).logits  # [5, V]
            cache.commit(list(range(5)))
            tree = self.forward(cache, tokens, depths_of(parents), ancestor_mask(parents), capture=False)
            return torch.cat([prompt, tree.logits[[0, 1, 3]]])  # [8, V]

        ours = self._attempt(prompt_then_tree).float()
        err = float((ours - reference).abs().max()) / max(float(reference.abs().max()), 1e-6)
        tol = PROBE_TOLERANCE.get(self.dtype, PROBE_TOLERANCE_LOW_PRECISION)
        if not err <= tol:
            raise self._unsupported(f"its forward through a tree mask and the runtime's cache differs from its own "
                                    f"forward (relative logit error {err:.2e} > {tol:.0e})")


    def _attempt(self, run: Callable[[], Any]) -> Any:
        """`run()`, where any failure means the same thing: this forward does not take the runtime's cache."""
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - the model's own code raised; say so in one line
            raise self._unsupported(f"its forward does not run with the runtime's cache and mask "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None


class _masked:
    """Context manager: while open, `attn`'s forward receives `mask` as its attention_mask (a pre-hook)."""

    def __init__(self, attn: Any, mask: torch.Tensor) -> None:
        self.attn, self.mask = attn, mask
        self.handle: Any = None

    def __enter__(self) -> _masked:
        def swap(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return args, {**kwargs, "attention_mask": self.mask}

        self.handle = self.attn.register_forward_pre_hook(swap, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def fused_path_applies(model: Any) -> bool:
    """The compact Llama-family forward (`TargetRunner`) runs this target: its model type is one it implements
    and no soft-capping is configured."""
    cfg = text_config(base_model(model).config)
    return (getattr(cfg, "model_type", None) in SUPPORTED_MODEL_TYPES
            and not any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "attn_logit_softcapping")))


def make_runner(model: Any, features: FeatureRequest | None = None, path: str = "auto") -> RunnerBase:
    """The target runner for `model`: "auto" = the fused Llama-family path where it applies, else the module
    path; "fused" / "modules" force one (tests run the Llama family through both)."""
    factories: dict[str, Callable[..., RunnerBase]] = {"fused": TargetRunner, "modules": ModuleTargetRunner}
    if path == "auto":
        path = "fused" if fused_path_applies(model) else "modules"
    if path not in factories:
        raise SpeculatorsError(f"runner path must be auto, fused or modules, got {path!r}")
    return factories[path](model, features)
