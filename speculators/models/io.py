"""Speculator checkpoints on disk: `config.json` (the family's vLLM-layout config + `speculators_native`) and
`model.safetensors`, written atomically and loaded strictly.

- `save_speculator(spec, directory, metadata)`: writes into a temp dir next to `directory` and renames it into
  place (when `directory` already exists, e.g. with a `training_state/` inside, the two files are replaced one by
  one, weights first and config last). Frozen copies of target tensors (`TARGET_TENSORS` of the family:
  embed_tokens, MTP's lm_head) are NOT saved when they still equal the target's; the config records, per such
  tensor, its source and a digest (sha256 + norm + probe values) under `speculators_native.target_tensors`.
- `load_speculator(directory, target_weights)`: strict. Missing files, unknown families, missing / unexpected /
  mis-shaped tensors, and a target whose frozen tensors differ from the recorded digest (a different target)
  raise `SpeculatorsError`; nothing is ever left at its random initialisation.
- `read_speculator_config(directory)`, `target_weights(model)` (the frozen tensors of a
  loaded HF model or PeftModel), `tensor_digest`, `digests_match`.

Not here: training state (optimizer, RNG: speculators.train.checkpoint), pairing.json (speculators.core.pairing),
the vLLM export (speculators.export.vllm), which family a config is (`models.family_of`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speculators.core.atomic import atomic_dir, atomic_path
from speculators.core.errors import SpeculatorsError
from speculators.core.target import final_norm, input_embeddings, output_head
from speculators.models import SPECULATORS, family_of
from speculators.models.base import Speculator, TargetWeights

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_PROBES = 16
DIGEST_CHUNK = 1 << 24  # elements hashed at a time (64 MiB as float32)


# ----------------------------------------------------------------------------------------------------------------
# digests of frozen target tensors


def probe_indices(numel: int, count: int) -> list[int]:
    """`count` indices spread evenly over [0, numel) from the first to the last element, in exact integer arithmetic
    (a float32 `linspace` rounds past the end of any tensor over 2^24 elements: a 49152 x 576 embedding)."""
    n = min(count, numel)
    if n <= 1:
        return [0] * n
    return [(i * (numel - 1)) // (n - 1) for i in range(n)]


def tensor_digest(t: torch.Tensor) -> dict:
    """Identity of a (frozen target) tensor: sha256 of its float32 bytes, shape, L2 norm and 16 probe values.
    Read in chunks of `DIGEST_CHUNK` elements: a 70B target's embedding (1.05B values) would otherwise need a float32
    copy, its bytes and a float64 copy at once (~17 GB)."""
    flat = t.detach().reshape(-1)
    sha, squares = hashlib.sha256(), 0.0
    for start in range(0, flat.numel(), DIGEST_CHUNK):
        part = flat[start:start + DIGEST_CHUNK].to(device="cpu", dtype=torch.float32).contiguous()
        sha.update(part.numpy().data)
        squares += float(part.double().square().sum())
    idx = probe_indices(flat.numel(), _PROBES)
    probe = flat[torch.tensor(idx, dtype=torch.long, device=flat.device)].to(device="cpu", dtype=torch.float32)
    return {"shape": list(t.shape), "sha256": sha.hexdigest(), "norm": math.sqrt(squares),
            "probe": [float(x) for x in probe]}


def digests_match(a: dict, b: dict) -> bool:
    """Same tensor, or the same tensor up to a dtype round trip (bf16/fp16 rounding)."""
    if a.get("sha256") == b.get("sha256"):
        return True
    if list(a.get("shape", [])) != list(b.get("shape", [])) or "norm" not in a or "norm" not in b:
        return False
    numel = max(1, math.prod(a["shape"]))
    na, nb = float(a["norm"]), float(b["norm"])
    if abs(na - nb) > 1e-2 * max(na, nb, 1e-12):
        return False
    atol = 1e-2 * max(na, nb) / math.sqrt(numel) + 1e-12
    pairs = zip(a.get("probe", []), b.get("probe", []), strict=False)
    return all(abs(x - y) <= atol + 1e-2 * abs(y) for x, y in pairs)


# ----------------------------------------------------------------------------------------------------------------
# target weights


def target_weights(model: Any) -> TargetWeights:
    """The frozen tensors a speculator copies from its target (HF model or PeftModel), detached."""
    emb, head, norm = input_embeddings(model), output_head(model), final_norm(model)
    if emb is None or head is None or getattr(norm, "weight", None) is None:
        raise SpeculatorsError(f"cannot find the embedding, lm_head and final norm of {type(model).__name__}")
    return TargetWeights(embed_tokens=emb.weight.detach(), lm_head=head.weight.detach(),
                         final_norm=norm.weight.detach())


# ----------------------------------------------------------------------------------------------------------------
# config


def read_speculator_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise SpeculatorsError(f"speculator checkpoint {directory} has no {CONFIG_NAME}; is it a speculator dir?")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpeculatorsError(f"{path} is not valid JSON ({exc}); the checkpoint is corrupt") from None
    if not isinstance(config, dict):
        raise SpeculatorsError(f"{path} does not hold a JSON object")
    return config


# ----------------------------------------------------------------------------------------------------------------
# save


def _tensors_to_save(spec: Speculator) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    state = spec.state_dict()
    records: dict[str, dict] = {k: dict(v) for k, v in (getattr(spec, "target_tensors", None) or {}).items()}
    tensors: dict[str, torch.Tensor] = {}
    target_names = spec.TARGET_TENSORS
    for name, t in state.items():
        if name in target_names:
            rec = records.get(name)
            digest = tensor_digest(t)
            if rec is not None and digests_match(digest, rec):
                records[name] = {**rec, "saved": False}
                continue
            records[name] = {"source": target_names[name], **digest, "saved": True}
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return tensors, records


def save_speculator(spec: Speculator, directory: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write `spec` to `directory` (config.json + model.safetensors), atomically; `metadata` (recipe, versions,
    step, target fingerprint, ...) goes into `speculators_native` (the family's own keys win)."""
    directory = Path(directory)
    tensors, records = _tensors_to_save(spec)
    config = spec.config_dict()
    native = config.get("speculators_native") or {}
    native = {**(metadata or {}), **native, "target_tensors": records, "weights": WEIGHTS_NAME}
    config["speculators_native"] = native
    text = json.dumps(config, indent=2, default=_json_default) + "\n"
    directory.parent.mkdir(parents=True, exist_ok=True)
    st_meta = {"format": "pt", "family": str(native.get("family", ""))}
    if not directory.exists():
        with atomic_dir(directory) as tmp:
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=st_meta)
            (tmp / CONFIG_NAME).write_text(text)
        return
    if not directory.is_dir():
        raise SpeculatorsError(f"cannot save a speculator to {directory}: it exists and is not a directory")
    # both written before either is replaced; the weights are replaced first, then the config
    with atomic_path(directory / CONFIG_NAME) as tmp_c, atomic_path(directory / WEIGHTS_NAME) as tmp_w:
        save_file(tensors, str(tmp_w), metadata=st_meta)
        tmp_c.write_text(text)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"metadata value of type {type(obj).__name__} is not JSON serialisable")


# ----------------------------------------------------------------------------------------------------------------
# load


def load_speculator(directory: str | os.PathLike, target_weights: TargetWeights | None = None) -> Speculator:
    """Rebuild the speculator saved in `directory` (CPU, the saved float dtype); frozen target copies that were
    not saved come from `target_weights` and must match the recorded digest."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SpeculatorsError(f"speculator checkpoint not found: {directory} is not a directory")
    config = read_speculator_config(directory)
    family = family_of(config)
    wpath = directory / WEIGHTS_NAME
    if not wpath.is_file():
        raise SpeculatorsError(f"speculator checkpoint {directory} has no {WEIGHTS_NAME}; the save was incomplete")
    try:
        model = SPECULATORS[family].from_config_dict(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpeculatorsError(f"{directory / CONFIG_NAME} is not a valid {family} config ({exc!r})") from None
    try:
        saved = load_file(str(wpath))
    except (SafetensorError, OSError) as exc:
        raise SpeculatorsError(f"cannot read {wpath} ({exc}); the file is corrupt or truncated") from None
    _load_strict(model, saved, target_weights, directory)
    model.eval()
    return model


def _load_strict(model: Speculator, saved: dict[str, torch.Tensor], weights: TargetWeights | None,
                 directory: Path) -> None:
    state = model.state_dict()
    target_names: dict[str, str] = model.TARGET_TENSORS
    derived = model.derived_tensors()
    records: dict[str, dict] = getattr(model, "target_tensors", {}) or {}
    unexpected = sorted(set(saved) - set(state))
    missing = sorted(set(state) - set(saved) - set(target_names) - derived)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        raise SpeculatorsError(f"{directory / WEIGHTS_NAME} does not match its config ({'; '.join(parts)}); the "
                               "checkpoint is from another architecture or was edited")
    out: dict[str, torch.Tensor] = {}
    for name, ref in state.items():
        if name in saved:
            t = saved[name]
        elif name in derived:  # determined by the config: keeps its constructed value
            continue
        else:  # a frozen target copy that was not saved
            source = target_names[name]
            if weights is None:
                raise SpeculatorsError(f"checkpoint {directory} does not store {name} (a frozen copy of the target's "
                                       f"{source}); load it with the target's weights (target_weights=...)")
            t = getattr(weights, source)
            rec = records.get(name)
            if rec is not None and not digests_match(tensor_digest(t), rec):
                raise SpeculatorsError(f"the target's {source} differs from the one {directory} was trained with "
                                       "(digest mismatch); pair the speculator with its own target")
        if tuple(t.shape) != tuple(ref.shape):
            raise SpeculatorsError(f"{name} has shape {list(t.shape)} in {directory}, the config implies "
                                   f"{list(ref.shape)}; the checkpoint is inconsistent")
        if ref.is_floating_point() != t.is_floating_point() or (not ref.is_floating_point() and t.dtype != ref.dtype):
            raise SpeculatorsError(f"{name} has dtype {t.dtype} in {directory}, expected {ref.dtype}")
        out[name] = t
    float_dtypes = {t.dtype for n, t in saved.items() if t.is_floating_point()}
    if len(float_dtypes) == 1:
        model.to(float_dtypes.pop())
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.to(dtypes[k]) for k, v in out.items()}, strict=not (derived - set(saved)))
