"""The target model: load it (revision, optional PEFT adapter), fingerprint it, and tap its hidden states.

- `load_tokenizer` / `load_target`: Hugging Face causal LMs from a local dir or a hub id, on the chosen device and
  dtype, with clear one-line errors for missing paths, corrupt configs and missing chat templates.
- `fingerprint_target`: the pairing identity of a target (resolved revision, content hash of config + tokenizer +
  weights, tokenizer hash, adapter); cached by file size and mtime so it is cheap to recompute.
- `TapRecorder` / `forward_with_taps`: the residual stream ENTERING decoder layer k (vLLM's EAGLE-3 semantics, HF
  `hidden_states[k]`) via forward pre-hooks on the decoder layers, plus the final post-norm hidden state.

This module does not write features or train anything.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from speculators.core.atomic import write_text_atomic
from speculators.core.errors import SpeculatorsError
from speculators.core.hashing import sha256_file

if TYPE_CHECKING:
    from speculators.core.config import TargetConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


# ----------------------------------------------------------------------------------------------------------------
# device / dtype


def resolve_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpeculatorsError(f"device {device!r} requested but CUDA is not available; use device: cpu")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


# ----------------------------------------------------------------------------------------------------------------
# locating and loading


def is_local(name_or_path: str) -> bool:
    return Path(name_or_path).exists()


def check_target_location(name_or_path: str, what: str = "target") -> None:
    """Fail early, in one line, for a local-looking path that does not exist or has no usable config."""
    p = Path(name_or_path)
    if p.exists():
        if not p.is_dir():
            raise SpeculatorsError(f"{what} {name_or_path} is a file; pass the checkpoint directory")
        cfg = p / "config.json"
        if (p / "adapter_config.json").exists() and not cfg.exists():
            return
        if not cfg.is_file():
            raise SpeculatorsError(f"{what} {name_or_path} has no config.json; is it a Hugging Face checkpoint dir?")
        try:
            json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpeculatorsError(f"{what} config {cfg} is not valid JSON ({exc}); restore or re-download it") \
                from None
        return
    if not _HUB_ID.match(name_or_path) or name_or_path.startswith((".", "/", "~")):
        raise SpeculatorsError(f"{what} not found: {name_or_path} (no such directory, and not a hub id 'org/name')")


def _apply_chat_template_override(tokenizer: Any, chat_template: str | None) -> None:
    if chat_template is None:
        return
    p = Path(chat_template)
    if len(chat_template) < 4096 and p.suffix in (".jinja", ".j2", ".txt") or p.is_file():
        if not p.is_file():
            raise SpeculatorsError(f"chat template file not found: {chat_template}")
        tokenizer.chat_template = p.read_text()
    else:
        tokenizer.chat_template = chat_template


def load_tokenizer(cfg: TargetConfig) -> Any:
    check_target_location(cfg.name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, revision=cfg.revision,
                                            trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"cannot load the tokenizer of {cfg.name_or_path}: {str(exc).splitlines()[0]}") \
            from None
    _apply_chat_template_override(tok, cfg.chat_template)
    return tok


@dataclass
class LoadedTarget:
    model: Any  # transformers PreTrainedModel (or PeftModel wrapping one), eval mode, no grad
    tokenizer: Any
    device: str
    dtype: Any
    cfg: TargetConfig

    @property
    def config(self) -> Any:
        return text_config(self.model.config)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def text_config(config: Any) -> Any:
    """The text (decoder) config of a possibly multimodal config."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def eos_token_ids(*sources: Any) -> list[int]:
    """The EOS ids of a target: the union of `eos_token_id` over `sources` (generation config, model config,
    tokenizer; each holds an int, a list or None; a None source is skipped), sorted. The one EOS lookup: the caller
    names the sources it trusts (the runtime: generation config + tokenizer, as HF `generate` stops)."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return sorted(ids)


def saved_eos_token_ids(cfg: TargetConfig) -> list[int]:
    """`eos_token_ids` of a target on disk without loading its weights: its generation_config.json, else its
    config.json; [] for a tokenizer-only dir (the house target before its weights land)."""
    for load in (GenerationConfig.from_pretrained, AutoConfig.from_pretrained):
        try:
            return eos_token_ids(load(cfg.name_or_path, revision=cfg.revision))
        except Exception:  # noqa: BLE001 - no such file here: try the next source
            continue
    return []


def load_target(cfg: TargetConfig, device: str | None = None, dtype: str | None = None) -> LoadedTarget:
    """Load the target (+ PEFT adapter) for inference: eval mode, gradients off."""
    dev = resolve_device(device or cfg.device)
    dt = resolve_dtype(dtype or cfg.dtype, dev)
    tokenizer = load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, revision=cfg.revision, dtype=dt,
                                                     trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, json.JSONDecodeError, KeyError) as exc:
        raise SpeculatorsError(f"cannot load target {cfg.name_or_path}: {str(exc).splitlines()[0]}") from None
    if cfg.adapter:
        from peft import PeftModel

        check_target_location(cfg.adapter, what="adapter")
        try:
            model = PeftModel.from_pretrained(model, cfg.adapter, revision=cfg.adapter_revision)
        except (OSError, ValueError) as exc:
            raise SpeculatorsError(f"cannot load adapter {cfg.adapter}: {str(exc).splitlines()[0]}") from None
    model.to(dev)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, device=dev, dtype=dt, cfg=cfg)


def base_model(model: Any) -> Any:
    """The underlying transformers model of a PeftModel (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def decoder(model: Any) -> Any:
    """The decoder stack (the module holding `.layers`): `get_decoder()`, or the `.model` below it where
    `get_decoder()` returns the causal LM itself (Llama 4 text models in transformers 5.25)."""
    dec = base_model(model).get_decoder()
    inner = getattr(dec, "model", None)
    if getattr(dec, "layers", None) is None and inner is not None and getattr(inner, "layers", None) is not None:
        return inner
    return dec


def decoder_layers(model: Any) -> Any:
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise SpeculatorsError(f"cannot find decoder layers in {type(base_model(model)).__name__}")
    return layers


def final_norm(model: Any) -> Any:
    dec = decoder(model)
    for name in ("norm", "final_layernorm", "ln_f"):
        if hasattr(dec, name):
            return getattr(dec, name)
    raise SpeculatorsError(f"cannot find the final norm of {type(base_model(model)).__name__}")


def output_head(model: Any) -> Any:
    return base_model(model).get_output_embeddings()


def input_embeddings(model: Any) -> Any:
    return base_model(model).get_input_embeddings()


# ----------------------------------------------------------------------------------------------------------------
# taps


def default_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default taps: the residual stream entering layers 2, N//2 and N-3 (vLLM / EAGLE / SpecForge)."""
    return [2, num_layers // 2, num_layers - 3]


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    if not layer_ids:
        raise SpeculatorsError("capture.layer_ids is empty; give layer ids in [0, num_hidden_layers)")
    bad = [i for i in layer_ids if not isinstance(i, int) or i < 0 or i >= num_layers]
    if bad:
        raise SpeculatorsError(f"layer ids {bad} are out of range for a target with {num_layers} decoder layers "
                               f"(valid: 0..{num_layers - 1}; default {default_tap_layers(num_layers)})")
    if len(set(layer_ids)) != len(layer_ids):
        raise SpeculatorsError(f"layer ids {layer_ids} contain duplicates")
    if list(layer_ids) != sorted(layer_ids):
        raise SpeculatorsError(f"layer ids {layer_ids} must be increasing ({sorted(layer_ids)}): vLLM sorts the tap "
                               f"layers and concatenates them in layer order, so features captured in another "
                               f"order would reach the served draft shuffled")
    return list(layer_ids)


class TapRecorder:
    """Context manager recording the hidden state ENTERING each chosen decoder layer (forward pre-hooks)."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        self.layers = decoder_layers(model)
        self.layer_ids = validate_layer_ids(layer_ids, len(self.layers))
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def _hook(self, layer_id: int):
        def pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[layer_id] = hidden  # [B, T, H]

        return pre_hook

    def __enter__(self) -> TapRecorder:
        self.captured.clear()
        for i in self.layer_ids:
            self._handles.append(self.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def taps(self) -> torch.Tensor:
        """Concatenated taps in layer-id order: [B, T, n_taps * H]."""
        return torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)


@dataclass
class TapOutput:
    taps: torch.Tensor | None  # [B, T, n_taps * H] residual stream entering the tap layers
    last_hidden: torch.Tensor  # [B, T, H] final hidden state after the final norm (what lm_head reads)
    logits: torch.Tensor  # [B, T, V]


def forward_with_taps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      layer_ids: list[int] | None) -> TapOutput:
    """One target forward returning taps, the post-norm last hidden state and the logits."""
    norm_out: dict[str, torch.Tensor] = {}
    handle = final_norm(model).register_forward_hook(lambda m, a, out: norm_out.__setitem__("h", out))
    try:
        if layer_ids:
            with TapRecorder(model, layer_ids) as rec, torch.no_grad():
                out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            taps = rec.taps()
        else:
            with torch.no_grad():
                out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            taps = None
    finally:
        handle.remove()
    return TapOutput(taps=taps, last_hidden=norm_out["h"], logits=out.logits)


# ----------------------------------------------------------------------------------------------------------------
# fingerprints (pairing identity)


@dataclass
class TargetFingerprint:
    name_or_path: str
    revision: str  # hub commit sha, or "local:<content hash prefix>" for a local checkpoint
    content_hash: str  # sha256 over config, tokenizer files and weight files
    tokenizer_hash: str  # sha256 of the tokenizer's vocabulary, merges, special tokens and chat template
    adapter: str | None
    adapter_revision: str | None
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def _cache_file() -> Path:
    root = Path(os.environ.get("SPECULATORS_CACHE", Path.home() / ".cache" / "speculators"))
    return root / "file-hashes.json"


def cache_kwarg(model: Any) -> str:
    """Name of the KV-cache argument of `model.forward` (transformers >= 5.2x renamed `past_key_values` to
    `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def file_stat_key(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime, ctime, inode) of a file: a same-size edit with the old mtime put back still changes the
    ctime (which only the kernel sets), and replacing the file changes the inode."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _file_sha256(path: Path, cache: dict) -> str:
    real = path.resolve()
    key = f"{real}:" + ":".join(str(v) for v in file_stat_key(real))
    if key in cache:
        return cache[key]
    # Hugging Face hub blobs are named by their sha256: reuse it instead of rereading gigabytes.
    if real.parent.name == "blobs" and len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
        digest = real.name
    else:
        digest = sha256_file(real)
    cache[key] = digest
    return digest


def dir_content_hash(directory: Path) -> str:
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}
    h = hashlib.sha256()
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and (
        p.name == "config.json" or p.name in _TOKENIZER_FILES or p.suffix in _WEIGHT_SUFFIXES
        or p.name.endswith(".index.json") or p.name.startswith("adapter_")))
    for name in names:
        h.update(name.encode())
        h.update(_file_sha256(directory / name, cache).encode())
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache_path, json.dumps(cache))
    except OSError:
        pass
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """Identity of what the tokenizer does: vocab/merges/normalization, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode() if isinstance(
        getattr(tokenizer, "chat_template", None), (str, type(None))) else json.dumps(tokenizer.chat_template).encode())
    return h.hexdigest()


def _resolve_dir(name_or_path: str, revision: str | None) -> tuple[Path, str | None]:
    """Local dir for a checkpoint and its hub commit (None for plain local dirs)."""
    if is_local(name_or_path):
        return Path(name_or_path), None
    from huggingface_hub import snapshot_download

    try:
        snap = Path(snapshot_download(name_or_path, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # noqa: BLE001 - hub errors come in many types; report one line
        raise SpeculatorsError(f"cannot resolve {name_or_path}@{revision or 'main'} on the hub: "
                               f"{str(exc).splitlines()[0]}") from None
    return snap, snap.name


def fingerprint_target(cfg: TargetConfig, tokenizer: Any | None = None, model_config: Any | None = None) -> \
        TargetFingerprint:
    """The pairing identity of the target described by `cfg` (cheap: file hashes are cached)."""
    check_target_location(cfg.name_or_path)
    directory, commit = _resolve_dir(cfg.name_or_path, cfg.revision)
    base_hash = dir_content_hash(directory)
    content = base_hash
    adapter_rev = None
    if cfg.adapter:
        check_target_location(cfg.adapter, what="adapter")
        adir, acommit = _resolve_dir(cfg.adapter, cfg.adapter_revision)
        a_hash = dir_content_hash(adir)
        adapter_rev = acommit or f"local:{a_hash[:16]}"
        content = hashlib.sha256((content + a_hash).encode()).hexdigest()
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg)
    if model_config is None:
        model_config = AutoConfig.from_pretrained(str(directory), trust_remote_code=cfg.trust_remote_code)
    tc = text_config(model_config)
    return TargetFingerprint(
        name_or_path=cfg.name_or_path, revision=commit or f"local:{base_hash[:16]}",
        content_hash=content, tokenizer_hash=tokenizer_hash(tokenizer), adapter=cfg.adapter,
        adapter_revision=adapter_rev, architectures=list(getattr(model_config, "architectures", None) or []),
        num_layers=int(tc.num_hidden_layers), hidden_size=int(tc.hidden_size), vocab_size=int(tc.vocab_size),
    )
