"""The name of the device a measurement ran on, for every report that states a speed: the GPU's model, or the CPU's
model (from /proc/cpuinfo, as `lscpu` shows it) with torch's thread count. Not here: choosing or loading a device
(core/target.py)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name ('AMD EPYC', 'Intel(R) Xeon(R) Processor', ...), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str | torch.device) -> str:
    """'NVIDIA H100 80GB HBM3' on a GPU; 'AMD EPYC CPU, 2 threads' on a CPU."""
    device = torch.device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} CPU, {torch.get_num_threads()} threads"
