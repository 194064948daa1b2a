"""Kernel-probe answers remembered per vLLM environment, so a probe runs once per installation, not once per server.

A probe (`vllm_consumer.expand_kernel_check`, `knorm_kernel_check`) imports vLLM in a subprocess to run one of its
functions on inputs with a known answer: 10-30 s on a 2-core CPU, before every vllm-check or recording replica that
needs it. The answer depends only on what is installed and on the probe, so it is kept in
`<cache root>/vllm-probes.json` (`target_sources.cache_root`: $SPECULATORS_CACHE, else ~/.cache/speculators) under a
key made of: the environment's root and the names and modification times of its vllm / torch distributions (an
upgrade or a reinstall makes a new key), PYTHONPATH and the contents of every sitecustomize.py on it (the CPU
repairs), the VLLM_* variables, and the probe's own source. Only answers are kept, never failures.

Not here: running a probe or judging its answer (vllm_consumer.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from speculators.core.atomic import write_text_atomic
from speculators.core.target_sources import cache_root

CACHE_NAME = "vllm-probes.json"
PACKAGES = ("vllm", "torch")  # distributions whose versions decide a kernel's behaviour


def _installed(python: Path) -> list[str] | None:
    """'<dist-info name>@<mtime_ns>' of the environment's vllm / torch distributions (None: not a venv layout)."""
    root = Path(python).parent.parent
    found = []
    for pattern in (f"lib/python*/site-packages/{name}*.dist-info" for name in PACKAGES):
        found += [f"{p.name}@{p.stat().st_mtime_ns}" for p in sorted(root.glob(pattern))]
    return sorted(found) or None


def _path_repairs(env: dict[str, str]) -> list[str]:
    """SHA-256 of every sitecustomize.py on PYTHONPATH (what a repair changes), in path order."""
    out = []
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        site = Path(entry) / "sitecustomize.py"
        if site.is_file():
            out.append(hashlib.sha256(site.read_bytes()).hexdigest())
    return out


def probe_key(python: Path, env: dict[str, str], script: str) -> str | None:
    """The cache key of running `script` with `python` in `env`, or None when the installation cannot be identified
    (then the probe always runs)."""
    installed = _installed(python)
    if installed is None:
        return None
    parts = {"root": str(Path(python).parent.parent.resolve()), "installed": installed,
             "pythonpath": env.get("PYTHONPATH", ""), "repairs": _path_repairs(env),
             "vllm_env": sorted((k, v) for k, v in env.items() if k.startswith("VLLM_")),
             "script": hashlib.sha256(script.encode()).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads((cache_root() / CACHE_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached_answer(key: str | None) -> tuple[bool, Any]:
    """(found, answer) for `key`."""
    data = _read_cache() if key else {}
    return (key in data, data.get(key)) if key else (False, None)


def remember_answer(key: str | None, answer: Any) -> None:
    """Keep `answer` under `key` (atomically; a cache that cannot be written is left alone)."""
    if not key:
        return
    data = _read_cache()
    data[key] = answer
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache_root() / CACHE_NAME, json.dumps(data, indent=1) + "\n")
    except OSError:
        pass
