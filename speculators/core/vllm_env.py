"""The vLLM environment as seen from ours: where its interpreter is, the environment its processes run under, and
vLLM's own error line in a process log, and stopping one of its process groups. vLLM runs in its own virtual environment (`.venv-vllm`, `make vllm-env`:
it pins other transformers versions), so nothing here imports vLLM; the stages that use it (capture with
`capture.backend: vllm`, vllm-check) start its processes with these.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from speculators.core.config import Recipe

VLLM_PYTHON_ENV = "SPECULATORS_VLLM_PYTHON"


def find_vllm_python(root: Path | None = None) -> Path | None:
    """The vLLM environment's python: $SPECULATORS_VLLM_PYTHON, else `<root or cwd>/.venv-vllm/bin/python`."""
    explicit = os.environ.get(VLLM_PYTHON_ENV)
    if explicit:
        return Path(explicit)
    candidate = (root or Path.cwd()) / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.is_file() else None


def vllm_python(recipe: Recipe) -> Path | None:
    """The vLLM environment's python a recipe runs: its `vllm.python`, else `find_vllm_python()`; None when neither
    names one."""
    return Path(recipe.vllm.python) if recipe.vllm.python else find_vllm_python()


def server_env(python: Path, threads: int = 2) -> dict[str, str]:
    """Environment for a vLLM CPU server: its venv first on PATH (launch.sh runs `python3` / `vllm` from there),
    a small KV cache, no thread pinning (other processes share the cores), no hub access, and the model runner inside
    the engine process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process fewer to start and no inter-process hop per
    step; measured on an AMD EPYC, house target, 2 threads: ready in 17 s instead of 23, 400 tokens in 2.5 s instead
    of 5.1, same tokens)."""
    env = dict(os.environ)
    env.update({"PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}", "PYTHON": str(python),
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
                "VLLM_ENABLE_V1_MULTIPROCESSING": env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("VIRTUAL_ENV", None)
    return env


# "(Worker pid=4886) ERROR 12-01 12:34:30 [multiproc_executor.py:953] " before a line of a vLLM process's log
_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s+(?:[A-Z]+\s+\d\d-\d\d\s+[\d:]+\s+\[[^\]]*\]\s*)?")
# a raised exception's message line: "ValueError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)(:|$)")


def last_error_line(log: Path) -> str:
    """vLLM's own error, without the process / time prefix: the FIRST exception raised (its processes re-raise a
    worker's error as wrappers that only point at it: "See root cause above", "See stack trace for root cause"),
    else the last line that names an error, else the last line."""
    try:
        lines = [_LOG_PREFIX.sub("", ln.strip()) for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    raised = [ln for ln in lines if _EXCEPTION.match(ln) and "root cause" not in ln]
    if raised:
        return raised[0][:400]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln) and not ln.startswith(("File ", "raise "))]
    return (errors or lines or ["empty log"])[-1][:400]


def stop_process_group(proc: subprocess.Popen, waits: tuple[float, float] = (30.0, 10.0)) -> None:
    """SIGTERM a vLLM process's whole group (started with `start_new_session`), then SIGKILL what is left."""
    for sig, wait in zip((signal.SIGTERM, signal.SIGKILL), waits, strict=True):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
