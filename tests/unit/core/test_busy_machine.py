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
