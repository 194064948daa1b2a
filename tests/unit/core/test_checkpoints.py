"""The checkpoint folder (core/checkpoints.py): one rule for a complete checkpoint, pointers that fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.core.checkpoints import (
    CHECKPOINT_FILES,
    is_resumable,
    list_checkpoints,
    read_pointer,
    step_name,
    step_number,
    write_pointer,
)
from speculators.core.errors import SpeculatorsError


def _step(root: Path, step: int, files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    d = root / step_name(step)
    d.mkdir()
    for f in files:
        (d / f).write_text("{}")
    return d


def test_complete_checkpoints_and_pointers(tmp_path: Path) -> None:
    _step(tmp_path, 100)
    _step(tmp_path, 20)
    _step(tmp_path, 30, ("config.json",))  # no weights / pairing: not a checkpoint
    (tmp_path / "step-x").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000020", "step-0000100"]
    assert step_number(tmp_path / "step-0000100") == 100 and step_number("best") == -1
    assert read_pointer(tmp_path, "best") is None  # absent: no choice yet
    write_pointer(tmp_path, "best", tmp_path / "step-0000100")
    assert (tmp_path / "best").read_text() == "step-0000100\n"
    assert read_pointer(tmp_path, "best").name == "step-0000100"
    assert not is_resumable(tmp_path / "step-0000100")  # no training_state/trainer_state.json


@pytest.mark.parametrize("content, match", [("step-0000999\n", "not a complete checkpoint"),
                                            ("step-0000030\n", "not a complete checkpoint"), ("\n", "is empty")])
def test_a_broken_pointer_is_one_clear_error(tmp_path: Path, content: str, match: str) -> None:
    _step(tmp_path, 30, ("config.json",))
    (tmp_path / "latest").write_text(content)
    with pytest.raises(SpeculatorsError, match=match):
        read_pointer(tmp_path, "latest")
