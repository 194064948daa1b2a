"""The GPU checks (`pytest -m gpu tests/gpu`; run by scripts/gpu_check.sh).

Every test here is marked `gpu` and runs on CUDA when there is one; without CUDA it is skipped — unless
SPECULATORS_GPU_CHECK_DEVICE=cpu, which runs the same tests on the CPU with small sizes (`scripts/gpu_check.sh
--cpu`, itself run by a CI test) so that they cannot rot. SPECULATORS_GPU_CHECK_SPECULATOR may name a trained
speculator directory of the house target (the house EAGLE-3 export): the parity tests then run it too (deep
accepted paths, which random heads rarely reach).
"""

from __future__ import annotations

import os

import pytest
import torch

FORCED = os.environ.get("SPECULATORS_GPU_CHECK_DEVICE", "").strip()
DEVICE = FORCED or ("cuda" if torch.cuda.is_available() else "")


def pytest_collection_modifyitems(config, items) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not DEVICE:
                item.add_marker(pytest.mark.skip(reason="no CUDA device (SPECULATORS_GPU_CHECK_DEVICE=cpu runs the "
                                                        "GPU checks on the CPU)"))


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def small(device) -> bool:
    """CPU mode: the same checks on fewer rows, tokens and samples."""
    return not device.startswith("cuda")
