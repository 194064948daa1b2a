"""Model shapes for the speedup oracle: a target's architecture with random weights, and random drafter heads.

Speed does not depend on the weights, so `speculators profile` times a model *shape* without downloading it:
- `shape_names()` / `shape_config(name_or_file)`: the shapes kept as data in `data/shapes/<name>.json` (Hugging Face
  `config.json` fields: Llama-3.1-8B and -70B, Qwen3-8B, a tiny Llama for CPU tests), or any config.json path.
- `random_target(name_or_file, device, dtype, layers=None)`: that causal LM built from config with random weights
  (with `layers`, its first decoder layers only: a slice, oracle/slicing.py), created directly on `device` in `dtype`
  (no CPU copy of an 8B model), with a synthetic word-level tokenizer of the same vocabulary ("t0 t1 ...") so the
  runtime can run it unchanged. EOS is removed: a profile decodes for as many cycles as it asks for.
- `random_drafter(target, family, num_steps, ...)`: a family's head (EAGLE-3, Medusa, MTP) built from the target's
  config with random weights (`Speculator.from_target`, on the CPU in the drafting dtype), prepared for drafting as the runtime would (`drafters.prepare_for_drafting`: device, drafting dtype). EAGLE-3 gets a reduced draft vocabulary of `draft_vocab_size` ids (32,000 by
  default, the size of published EAGLE-3 heads for Llama-3.1-8B), capped at the target's vocabulary.

Not here: timing (costs.py), the oracle's model (cost_model.py). Real checkpoints load through
`speculators.core.target`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from speculators.core.config import SpeculatorConfig, TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.package_data import shipped
from speculators.core.target import LoadedTarget
from speculators.models import SPECULATORS
from speculators.models.io import target_weights
from speculators.runtime.drafters.load import draft_dtype_for, prepare_for_drafting

SHAPES_DIR = shipped("data/shapes")
DEFAULT_DRAFT_VOCAB = 32000


def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json")) if SHAPES_DIR.is_dir() else []


def shape_config(name_or_file: str) -> tuple[str, dict]:
    """(display name, config fields) of a named shape or a config.json file."""
    path = Path(name_or_file)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = SHAPES_DIR / f"{name_or_file.lower()}.json"
    if not path.is_file():
        known = ", ".join(shape_names()) or f"none: {SHAPES_DIR} is missing"
        raise SpeculatorsError(f"unknown model shape {name_or_file!r}; known shapes: {known} (or pass a "
                               f"config.json path)")
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"shape file {path} is not valid JSON: {exc}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise SpeculatorsError(f"shape file {path} must be a config.json object with a model_type")
    return path.stem if path.parent == SHAPES_DIR else str(path), fields


def _word_tokenizer(vocab_size: int) -> Any:
    """A real fast tokenizer whose token i is the word "t{i}" (decoding works; the text means nothing)."""
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def shape_model_config(name_or_file: str) -> tuple[str, Any]:
    """(the shape's name, its transformers config), EOS removed."""
    name, fields = shape_config(name_or_file)
    fields = dict(fields)
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        fields.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise SpeculatorsError(f"shape {name}: transformers cannot build a {model_type!r} config: "
                               f"{str(exc).splitlines()[0]}") from None
    config.eos_token_id = None
    return name, config


def random_target(name_or_file: str, device: str, dtype: torch.dtype, seed: int = 0, layers: int | None = None
                  ) -> Any:
    """A `speculators.core.target.LoadedTarget` of the shape with random weights (see the module docstring);
    `layers`: only the first that many decoder layers (a slice, oracle/slicing.py)."""
    name, config = shape_model_config(name_or_file)
    if layers is not None:
        config = sliced_config(config, layers)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except torch.cuda.OutOfMemoryError:
        raise SpeculatorsError(f"shape {name} does not fit on {device} in {dtype}") from None
    model.generation_config.eos_token_id = None
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=_word_tokenizer(int(config.vocab_size)), device=device,
                        dtype=dtype, cfg=TargetConfig(name_or_path=f"shape:{name}", device=device))


def cut_layers(config: Any, layers: int) -> None:
    """`config` says its first `layers` decoder layers only (in place; per-layer lists cut to match)."""
    text = getattr(config, "text_config", None) or config
    for key, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == text.num_hidden_layers:
            setattr(text, key, value[:layers])
    text.num_hidden_layers = layers


def sliced_config(config: Any, layers: int) -> Any:
    """A copy of `config` with its first `layers` decoder layers."""
    config = copy.deepcopy(config)
    cut_layers(config, layers)
    return config


def random_drafter(target: Any, family: str, num_steps: int, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB,
                   draft_dtype: str = "auto", seed: int = 0, layer_ids: list[int] | None = None) -> tuple[Any, str]:
    """(a family's head with random weights for `target`, prepared for drafting; how it computes); `layer_ids`:
    its taps (default: the family's own for the target's layer count)."""
    vocab = int(target.vocab_size)
    dvocab = min(int(draft_vocab_size), vocab) if family == "eagle3" else None
    # a shape has no tokenizer, hence no special ids: DFlash's mask slots embed token 0
    cfg = SpeculatorConfig(family=family, num_steps=num_steps, draft_vocab_size=dvocab, mask_token_id=0)
    d2t = torch.zeros(dvocab, dtype=torch.long) if dvocab is not None and dvocab < vocab else None
    torch.manual_seed(seed)
    # built on the CPU directly in the drafting dtype (random weights need no float32 master copy: a 70B shape's
    # EAGLE-3 head is 8.8 GiB in float32, 4.4 in bfloat16), then moved to the device
    dtype = draft_dtype_for(target, draft_dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        spec = SPECULATORS[family].from_target(target.model.config, cfg, target_weights(target.model),
                                               layer_ids=layer_ids, d2t=d2t)
    finally:
        torch.set_default_dtype(previous)
    return spec, prepare_for_drafting(spec, target.device, dtype)
