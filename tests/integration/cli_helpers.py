"""Running the real `speculators` CLI in a subprocess for the runtime's integration tests."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m speculators.cli ARGS` with captured text output."""
    return subprocess.run([sys.executable, "-m", "speculators.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**REPO_ENV, **(env or {})})


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `error: ...` line a failed command printed (asserting there is exactly one and no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]
