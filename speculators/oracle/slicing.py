"""A profile of a shape bigger than this machine's memory: time a slice of its decoder layers and scale by the count.

A decoder-only forward costs the embedding and the output head once plus each decoder layer's share, and every layer
of a shape costs the same, so with f(L) the measured cost of a slice of the first L layers (embedding, final norm and
head at full size), f(N) = f(L) + (N - L) * (f(L) - f(k)) / (L - k). `plan_slice` decides from the memory the shape
would take (its parameters counted on the meta device) against the memory available: the whole shape when it fits in
`FILL` of it, else a slice of L = k + span layers (k: the most taps a profiled drafter reads, at least 1), refused in
one line before anything is allocated when even k + 1 layers do not fit. The span (`slice_span`) covers at least
`SPAN_BYTES` of layer weights, at most half the shape and what fits: a one-layer difference of two timings of a
small model is mostly noise (x 26 for SmolLM2), and a slice whose weights sit in the CPU's caches runs faster per
layer than the whole model that streams them. The profile times the slice of L layers (target forward grid,
prefill, drafters, whole runtime steps, whose overhead over the forward does not depend on the depth), keeps its
first k layers (`keep_layers`: the same embedding and head, no second copy), times the forward and prefill of k
layers, and `scale_table` extrapolates them. The drafters of a slice tap its first layers (`slice_taps`): their
cost depends on how many taps they read, not on which.

Not here: the timing (costs.py), the profile's phases (profile.py). A shape whose layers differ (dense layers before
MoE ones, `first_k_dense_replace`) is timed on its first layers: the report says which layers were timed.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from speculators.core.errors import SpeculatorsError
from speculators.models import SPECULATORS
from speculators.oracle.shapes import cut_layers, sliced_config
from speculators.runtime.forward import memory

FILL = 0.7  # the share of the available memory a profile's target may take (activations, drafters, KV caches)
SPAN_BYTES = 256 * 2**20  # layer weights a slice's timed difference covers at least (well past any CPU's caches)
GIB = 2**30


def model_bytes(config: Any, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of the parameters and buffers of the config's causal LM (of its first `layers` decoder layers)."""
    config = sliced_config(config, layers) if layers is not None else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() for t in (*model.parameters(), *model.buffers())) * size


def taps_needed(families: list[str], num_layers: int) -> int:
    """The most hidden-state taps one of `families` reads from a target of `num_layers` layers (its defaults)."""
    counts = [len(SPECULATORS[f].capture_request(None, num_layers).tap_layer_ids or ()) for f in families]
    return max([1, *counts])


def base_layers(families: list[str], num_layers: int) -> int:
    """k: the layers a slice is cut to for its second timing, the most taps one of `families` reads (at least 1)."""
    return min(taps_needed(families, num_layers), num_layers - 1)


def slice_taps(family: str, num_layers: int, layers: int) -> list[int] | None:
    """The taps a `family` drafter reads in a slice of `layers` layers: as many as on the whole shape, its first."""
    ids = SPECULATORS[family].capture_request(None, num_layers).tap_layer_ids
    return None if not ids else list(range(min(len(ids), layers)))


def layer_bytes(config: Any, dtype: torch.dtype) -> tuple[int, int]:
    """(one decoder layer, the rest: embedding, final norm and head) of the config's causal LM, in bytes."""
    one, two = model_bytes(config, dtype, 1), model_bytes(config, dtype, 2)
    return two - one, 2 * one - two


def drafter_bytes(config: Any, families: list[str], num_steps: int, draft_vocab: int,
                  dtype: torch.dtype = torch.float32) -> int:
    """What the random heads of `families` take while they are built (on the CPU in the drafting `dtype`):
    a draft decoder layer the size of the target's, their own output heads (Medusa: one per step) and their frozen
    copies of the target's embedding (EAGLE-3, MTP, DFlash) and head (MTP, DFlash)."""
    text = getattr(config, "text_config", None) or config
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    layer = layer_bytes(config, torch.float32)[0] // 4  # parameters
    per_family = {"eagle3": layer + 3 * hidden * hidden + min(draft_vocab, vocab) * hidden + vocab * hidden,
                  "medusa": num_steps * (hidden * hidden + vocab * hidden),
                  "mtp": layer + 2 * hidden * hidden + 2 * vocab * hidden,
                  "dflash": layer + 2 * vocab * hidden}
    return dtype.itemsize * sum(per_family.get(f, layer + 2 * vocab * hidden) for f in families)


def plan_slice(config: Any, dtype: torch.dtype, device: str, families: list[str], mode: str,
               heads: int = 0) -> int | None:
    """None: profile the whole shape; else the layers of the slice to time (see the module docstring). `mode`:
    auto (a slice when the shape does not fit), always, never; `heads`: the bytes the drafters take besides."""
    n = int((getattr(config, "text_config", None) or config).num_hidden_layers)
    need, room = model_bytes(config, dtype) + heads, memory.available_bytes(device)
    dt = str(dtype).removeprefix("torch.")
    with_heads = f" with the {', '.join(families)} heads ({heads / GIB:.1f} GiB)" if heads else ""
    base = base_layers(families, n)
    layers = base + 1
    if mode == "never" or (mode == "auto" and need <= FILL * room) or layers >= n:
        if mode == "never" and need > FILL * room:
            raise SpeculatorsError(f"the whole shape takes {need / GIB:.1f} GiB in {dt}{with_heads}, more than "
                                   f"{FILL:.0%} of the {room / GIB:.1f} GiB available on {device}; drop --slice never")
        return None
    sliced = model_bytes(config, dtype, layers) + heads
    if sliced > FILL * room:
        hints = [*(["--dtype bfloat16"] if dtype == torch.float32 else []),
                 *(["fewer --families"] if heads and len(families) > 1 else [])]
        raise SpeculatorsError(f"even a slice of {layers} of its {n} layers takes {sliced / GIB:.1f} GiB in {dt} "
                               f"(the embedding and the head at full size){with_heads}, more than {FILL:.0%} of the "
                               f"{room / GIB:.1f} GiB available on {device}; "
                               f"{'try ' + ' or '.join(hints) if hints else 'it needs a machine with more memory'}")
    return base + slice_span(config, dtype, base, FILL * room - heads)


def slice_span(config: Any, dtype: torch.dtype, base: int, room: float) -> int:
    """Layers past the first `base` a slice times: enough for `SPAN_BYTES` of layer weights, at least 1, at most
    up to half the shape's layers and what fits in `room` bytes with the embedding and the head."""
    n = int((getattr(config, "text_config", None) or config).num_hidden_layers)
    layer, rest = layer_bytes(config, dtype)
    wanted = -(-SPAN_BYTES // max(layer, 1))
    fits = int((room - rest) // max(layer, 1)) - base
    return max(1, min(wanted, n // 2 - base, fits))


def keep_layers(model: Any, layers: int) -> None:
    """Keep the first `layers` decoder layers of a Hugging Face causal LM in place (its config says so)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    inner.layers = inner.layers[:layers]
    cut_layers(model.config, layers)


def scale_table(big: dict, small: dict, big_layers: int, small_layers: int, num_layers: int) -> dict:
    """f(N) per entry of two measured tables (nested dicts of seconds) of slices of `big_layers` and `small_layers`;
    an entry measured in one of them only is left out. A layer's share below zero (timing noise) counts 0."""
    out: dict = {}
    for key, value in big.items():
        if key not in small:
            continue
        if isinstance(value, dict):
            out[key] = scale_table(value, small[key], big_layers, small_layers, num_layers)
        else:
            per_layer = max(0.0, value - small[key]) / (big_layers - small_layers)
            out[key] = value + (num_layers - big_layers) * per_layer
    return out
