"""A stage that starts on a machine already busier than its cores says so in one line (pipeline.py), with the
threads it will use; a machine with room says nothing."""

from __future__ import annotations

import os

import pytest

from speculators import pipeline


def test_a_busy_machine_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 3.0, 2.0))
    line = pipeline.busy_machine_line("capture")
    assert line is not None and "\n" not in line
    assert line.startswith("[capture] this machine is already busy (load 3.4 on 2 cores)") and "2 torch threads" in line
    monkeypatch.setattr(os, "getloadavg", lambda: (0.7, 0.5, 0.2))
    assert pipeline.busy_machine_line("capture") is None


def test_the_recipes_threads_set_the_pool_of_the_stage_and_the_processes_it_starts(monkeypatch) -> None:
    import subprocess
    import sys

    import torch

    from speculators.core.config import Recipe
    from speculators.core.errors import SpeculatorsError

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    try:
        pipeline.use_threads(Recipe(threads=1))
        assert torch.get_num_threads() == 1
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == "1", "a process the stage starts keeps the old pool"
        pipeline.use_threads(Recipe(threads=0))  # 0: as they are
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        with pytest.raises(SpeculatorsError, match="threads must be >= 0"):
            pipeline.use_threads(Recipe(threads=-2))
    finally:
        torch.set_num_threads(before)
