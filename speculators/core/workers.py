"""Re-running a stage as several processes under `accelerate launch` (capture and training share this).

- `accelerate_command`: `python -m accelerate.commands.launch ... -m speculators.cli <worker> ...`, either from an
  accelerate config file (DeepSpeed, FSDP, several machines) or, without one, N local processes (CPU: gloo;
  GPUs: one each) on a free port.
- `run_workers`: run that command with one OpenMP thread share per process unless the caller set
  OMP_NUM_THREADS, and the stage's own environment variables.

Nothing here knows what a worker does (the hidden `speculators worker-*` commands in cli.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_command(worker: list[str], num_processes: int, *, config_file: str | None = None,
                       deepspeed_config_file: str | None = None, num_machines: int = 1) -> list[str]:
    """The launcher command for `speculators <worker...>` on `num_processes` processes (see the module doc)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        cmd += ["--config_file", config_file]
        if deepspeed_config_file:
            cmd += ["--deepspeed_config_file", deepspeed_config_file]
    if num_processes > 1:
        cmd += ["--num_processes", str(num_processes)]
        if config_file is None:
            cmd += ["--multi_gpu"]
    if config_file is None:
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_machines == 1:  # several machines agree on the port through their config
        cmd += ["--main_process_port", str(free_port())]
    return cmd + ["-m", "speculators.cli", *worker]


def run_workers(cmd: list[str], num_processes: int, env: dict[str, str] | None = None) -> int:
    """Run the launcher (output passes through) and return its exit status."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_processes))))
    return subprocess.run(cmd, env=full, check=False).returncode
