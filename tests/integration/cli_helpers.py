"""Running the real `speculators` CLI in a subprocess for the runtime's integration tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_process(*args: str, env: dict | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`speculators serve ARGS --port P` as a subprocess on 127.0.0.1: (base URL, process) once /health answers;
    terminated on exit."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "speculators.cli", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**REPO_ENV, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {proc.stdout.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise AssertionError("server did not come up in time")
            time.sleep(0.5)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
