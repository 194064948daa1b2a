"""The checks every export format shares, and the header view of the weight files they read.

- `Tensors(directory, problems)`: name -> (dtype, shape, file) of every *.safetensors file, from the headers only
  (`load(name)` reads one tensor when a check needs the values).
- `read_json_or_note`, `is_int`, `expect_shape`, `unknown_tensors`, `no_model_prefix`: small checks that append one
  line per problem to `problems`.
- `check_floats`: float tensors in one dtype, the one config.json declares, and (deep) finite.
- `check_speculators_config` / `check_layer_config`: the `speculators_config` block and `transformer_layer_config`
  vLLM reads first from a speculators-format config (EAGLE-3, DFlash).
- `pairing_target` / `pairing_problems`: the target pairing.json records, and the export's vocab, fc width and tap
  ids against it.
- `check_weight_dir`: what every format with its own weight files shares (EAGLE-3, DFlash, Medusa): the top-level
  `model_type`, the weight files, the family's layout check, the float dtypes.

It knows no family's tensor layout (models/<family>/<family>_format.py) and never writes anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings")
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


class Tensors:
    """Header view of every *.safetensors file in a directory: name -> (dtype, shape, file)."""

    def __init__(self, directory: Path, problems: list[str]) -> None:
        self.info: dict[str, tuple[str, list[int], Path]] = {}
        self.files = sorted(directory.glob("*.safetensors"))
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        sl = fh.get_slice(k)
                        if k in self.info:
                            problems.append(f"tensor {k} appears in two weight files ({self.info[k][2].name}, {f.name})")
                        self.info[k] = (str(sl.get_dtype()), list(sl.get_shape()), f)
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
                problems.append(f"{f.name} is not a readable safetensors file ({str(exc).splitlines()[0]})")

    def load(self, name: str) -> Any:
        with safe_open(str(self.info[name][2]), framework="pt") as fh:
            return fh.get_tensor(name)

    def shape(self, name: str) -> list[int] | None:
        return self.info[name][1] if name in self.info else None

    def dtype(self, name: str) -> str | None:
        return self.info[name][0] if name in self.info else None


def read_json_or_note(path: Path, problems: list[str]) -> dict | None:
    if not path.is_file():
        problems.append(f"{path.name} is missing from {path.parent}")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{path.name} is not valid JSON ({exc})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} must be a JSON object")
        return None
    return data


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def expect_shape(t: Tensors, name: str, shape: list[int], problems: list[str]) -> None:
    got = t.shape(name)
    if got is None:
        problems.append(f"missing tensor {name} (expected shape {shape})")
    elif got != shape:
        problems.append(f"tensor {name} has shape {got}, expected {shape}")


def check_floats(t: Tensors, config: dict, problems: list[str], deep: bool) -> None:
    want = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or ""))
    floats = [k for k, (dt, _, _) in t.info.items() if dt in FLOAT_DTYPES]
    kinds = sorted({t.dtype(k) for k in floats})
    if len(kinds) > 1:
        problems.append(f"float tensors mix dtypes {kinds}; export them in one dtype")
    if want and kinds and kinds != [want]:
        problems.append(f"config.json declares dtype {config.get('dtype') or config.get('torch_dtype')} but the "
                        f"float tensors are {kinds}")
    if deep:
        for k in floats:
            if not bool(torch.isfinite(t.load(k)).all()):
                problems.append(f"tensor {k} contains NaN or Inf")


def pairing_target(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "pairing.json").read_text()).get("target")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def check_speculators_config(config: dict, problems: list[str], algorithm: str) -> None:
    """speculators_model_type and speculators_config: what vLLM reads first."""
    sc = config.get("speculators_config")
    smt = config.get("speculators_model_type")
    if smt is None:
        problems.append("config.json lacks speculators_model_type (vLLM requires it)")
    elif smt != algorithm:
        problems.append(f"speculators_model_type is {smt!r}; this exporter writes and checks {algorithm!r}")
    if not isinstance(sc, dict):
        problems.append("speculators_config must be a mapping")
        sc = {}
    if sc.get("algorithm") != algorithm:
        problems.append(f"speculators_config.algorithm is {sc.get('algorithm')!r}, expected {algorithm!r}")
    methods = sc.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        problems.append("speculators_config.proposal_methods must be a non-empty list (vLLM reads "
                        "proposal_methods[0].speculative_tokens)")
    else:
        k = methods[0].get("speculative_tokens")
        if not is_int(k) or k < 1:
            problems.append(f"speculators_config.proposal_methods[0].speculative_tokens must be an int >= 1, got {k!r}")
        if sc.get("default_proposal_method") != methods[0].get("proposal_type"):
            problems.append("speculators_config.default_proposal_method must name proposal_methods[0] "
                            f"({methods[0].get('proposal_type')!r}), got {sc.get('default_proposal_method')!r}")
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict) or not isinstance(verifier.get("name_or_path"), str) \
            or not verifier.get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vLLM serves it as the target)")
    elif not isinstance(verifier.get("architectures"), list) or not verifier["architectures"]:
        problems.append("speculators_config.verifier.architectures must list the target's architectures")


def check_layer_config(config: dict, problems: list[str]) -> dict | None:
    """transformer_layer_config with every key vLLM reads; None (and the problem) when unusable."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config must be a mapping (it becomes the draft's HF config in vLLM)")
        return None
    missing = [k for k in LAYER_KEYS if k not in layer]
    if missing:
        problems.append(f"transformer_layer_config lacks {', '.join(missing)}")
        return None
    return layer


def unknown_tensors(unknown: list[str], problems: list[str]) -> None:
    if unknown:
        problems.append(f"unexpected tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''}; vLLM's loader "
                        f"fails on parameter names it does not know")


def pairing_problems(target: dict | None, vocab: int, target_h: int, aux_key: str, aux: list[int],
                      problems: list[str]) -> None:
    """The export's vocab, fc width and tap ids against the target pairing.json records (nothing without one)."""
    if not target:
        return
    if int(target.get("vocab_size", vocab)) != vocab:
        problems.append(f"transformer_layer_config.vocab_size {vocab} differs from the target's "
                        f"{target.get('vocab_size')} (pairing.json)")
    if int(target.get("hidden_size", target_h)) != target_h:
        problems.append(f"fc expects target hidden {target_h} but the target has {target.get('hidden_size')}")
    n = target.get("num_layers")
    if n is not None and any(i >= int(n) for i in aux):
        problems.append(f"{aux_key} {aux} out of range for a {n}-layer target")


def no_model_prefix(t: Tensors, problems: list[str]) -> None:
    bad_prefix = sorted(k for k in t.info if k.startswith("model."))
    if bad_prefix:
        problems.append(f"weights carry a 'model.' prefix ({bad_prefix[0]} ...); vLLM adds it itself, so they "
                        f"would not load")


def check_weight_dir(config: dict, directory: Path, problems: list[str], deep: bool,
                     layout: Callable[[dict, Tensors, dict | None, list[str]], None]) -> None:
    """The checks of a directory vLLM loads as a draft model with its own weight files; `layout(config, tensors,
    target, problems)` is the family's (`target`: what pairing.json records, or None)."""
    if config.get("model_type") not in (None, "speculators", "medusa"):
        problems.append(f"top-level model_type {config['model_type']!r} must be absent: vLLM would route this "
                        f"directory to the plain {config['model_type']} model")
    speculators_format = config.get("speculators_config") is not None or \
        config.get("speculators_model_type") is not None
    if speculators_format and config.get("model_type") == "medusa":
        problems.append("config.json mixes the speculators format with model_type 'medusa'")
    tensors = Tensors(directory, problems)
    if not tensors.files:
        problems.append(f"no *.safetensors weight file in {directory}")
        return
    layout(config, tensors, pairing_target(directory), problems)
    check_floats(tensors, config, problems, deep)
