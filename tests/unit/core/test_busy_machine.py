"""A stage that starts while other processes keep the machine busy says so in one line (pipeline.py), with the
threads it will use; a machine with room, or busy with this process's own work, says nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from speculators import pipeline


def test_a_busy_machine_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    line = pipeline.busy_machine_line("capture", use=(2.0, 0.1))  # others keep 1.9 cores busy
    assert line is not None and "\n" not in line
    assert line.startswith("[capture] this machine is already busy (other processes use 1.9 of its 2 cores)")
    assert "2 torch threads" in line
    assert pipeline.busy_machine_line("capture", use=(0.4, 0.0)) is None
    # this process's own work (the pipeline's previous stage, whose load the load average still holds) is not others'
    assert pipeline.busy_machine_line("capture", use=(2.0, 1.9)) is None


def test_cpu_use_tells_other_processes_from_this_one() -> None:
    """Measured, not assumed: a thread of this process spinning counts as its own; a child spinning as others'."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        use = pipeline.cpu_use(1.0)
    finally:
        stop.set()
        worker.join()
    assert use is not None
    machine, own = use
    # a spinning thread gets a share of a core, not a whole one, where the other test worker keeps both cores busy
    # (CI measured 0.49): 0.2 tells "counted as this process's own" from "not counted" (~0.0) under any such load
    assert own >= 0.2 and machine >= own - 0.15, use
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 20\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.5)  # the child's interpreter has started and spins
        machine, own = pipeline.cpu_use(1.0)
    finally:
        child.kill()
        child.wait()
    assert machine - own >= 0.3 and own < 0.3, (machine, own)


def test_the_recipes_threads_set_the_pool_of_the_stage_and_the_processes_it_starts(monkeypatch) -> None:
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
