"""Levers side by side at equal cost (`train/curve_compare.py`): interpolation on the chosen axis, the default
budget (the smallest last point), and one error line for a run without a curve or without the axis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.cli import main
from speculators.core.errors import SpeculatorsError
from speculators.train.curve_compare import compare_table, read_curve, value_at


def _point(step: int, cpu: float, t0: float, t1: float, a1: float) -> dict:
    return {"step": step, "train_seconds": 2 * cpu, "train_cpu_seconds": cpu, "tokens": 100 * step,
            "tau_cycle_starts_t0": t0, "tau_cycle_starts_t1": t1, "per_position_t0": [a1, 0.1]}


def _write(run: Path, points: list[dict]) -> Path:
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "learning-curve.json").write_text(json.dumps({"points": points}))
    return run


def test_values_are_read_at_equal_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = [_point(0, 0, 1.0, 1.0, 0.0), _point(10, 100, 1.4, 1.3, 0.3), _point(20, 200, 1.6, 1.5, 0.4)]
    fast = [_point(0, 0, 1.0, 1.0, 0.0), _point(20, 100, 1.5, 1.4, 0.35), _point(40, 200, 1.9, 1.7, 0.5),
            _point(60, 300, 2.0, 1.8, 0.55)]
    assert value_at(slow, "train_cpu_seconds", 150, "tau_cycle_starts_t0") == pytest.approx(1.5)
    assert value_at(fast, "train_cpu_seconds", 250, "step") == pytest.approx(50)
    assert value_at(slow, "train_cpu_seconds", 250, "tau_cycle_starts_t0") is None  # past its last point
    curves = {"slow": read_curve(_write(tmp_path / "slow", slow)), "fast": read_curve(_write(tmp_path / "fast", fast))}
    table = compare_table(curves)
    assert table.startswith("At 200 CPU s")  # the smallest last point: both runs reached it
    assert "| slow | 20 | 10.00 | 1.600 | 1.500 | 0.400 | 20 | 1.600 | 1.500 |" in table
    assert "| fast | 40 | 5.00 | 1.900 | 1.700 | 0.500 | 60 | 2.000 | 1.800 |" in table
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        main(["curves", str(tmp_path / "slow"), str(tmp_path / "fast"), "--axis", "tokens"])
    assert exit_code.value.code == 0
    by_tokens = capsys.readouterr().out  # at equal tokens the slow run is not behind
    assert "| slow | 20 | 10.00 | 1.600 |" in by_tokens and "| fast | 20 | 5.00 | 1.500 |" in by_tokens


def test_bad_inputs_give_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_code:
        main(["curves", str(tmp_path / "nowhere")])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.strip().endswith("no learning curve (train with train.curve_points > 0)")
    old = [{k: v for k, v in _point(5, 50, 1.2, 1.1, 0.2).items() if k != "train_cpu_seconds"}]
    _write(tmp_path / "old", old)
    with pytest.raises(SystemExit) as exit_code:
        main(["curves", str(tmp_path / "old")])
    assert exit_code.value.code == 2
    assert "has no 'train_cpu_seconds'" in capsys.readouterr().err
    with pytest.raises(SpeculatorsError, match="axis must be one of"):
        compare_table({"old": {"points": old}}, axis="loss")
