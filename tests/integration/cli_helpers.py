"""Running the real `speculators` CLI for the integration tests: in a subprocess (`cli`: the console entry point as
a user runs it), or in this process (`cli_here`: `speculators.cli.main` with its output captured, for the many
bad-input cases of one command, each ~5 s cheaper than a process that imports torch and transformers anew; every test
file that uses it also runs at least one case through `cli`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from speculators.cli import main as cli_main
from speculators.core.logs import configure

REPO_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m speculators.cli ARGS` with captured text output."""
    return subprocess.run([sys.executable, "-m", "speculators.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**REPO_ENV, **(env or {})})


def cli_here(*args: str, cwd: str | Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`speculators ARGS` through `speculators.cli.main` in this process: its exit status, stdout and stderr (the
    package's log lines included) as `cli` returns them; an exception that escapes the CLI is a traceback on stderr
    and status 1, as in a process. `env` is set for the call only; torch's thread count is restored after."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    configure()
    console = [h for h in logging.getLogger("speculators").handlers if getattr(h, "speculators_console", False)]
    streams = [h.setStream(err) for h in console]
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd or os.getcwd()):
            try:
                cli_main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except Exception:  # noqa: BLE001 - a traceback, as the process would print it
                traceback.print_exc()
                code = 1
    finally:
        for handler, stream in zip(console, streams, strict=True):
            handler.setStream(stream)
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(["speculators", *args], code, out.getvalue(), err.getvalue())


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
