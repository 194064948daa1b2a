"""The one atomic writer (core/atomic.py): a failure midway leaves the old file / directory intact and no temp
behind; success puts the new one in place whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from speculators.core.atomic import (
    atomic_dir,
    atomic_path,
    remove_dir,
    replace_dir,
    temp_path_for,
    write_json_atomic,
    write_text_atomic,
)


class Boom(RuntimeError):
    pass


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_atomic_path_replaces_on_success(tmp_path: Path) -> None:
    final = tmp_path / "sub" / "w.bin"
    with atomic_path(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".w.bin.tmp") and not final.exists()
        tmp.write_bytes(b"new")
    assert final.read_bytes() == b"new"
    assert _names(final.parent) == ["w.bin"]


def test_atomic_path_failure_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    final = tmp_path / "w.bin"
    final.write_bytes(b"old")
    with pytest.raises(Boom), atomic_path(final) as tmp:
        tmp.write_bytes(b"half")
        raise Boom
    assert final.read_bytes() == b"old"
    assert _names(tmp_path) == ["w.bin"]


def test_atomic_path_failed_replace_removes_the_temp(tmp_path: Path) -> None:
    final = tmp_path / "taken"
    final.mkdir()
    (final / "x").write_text("keep")  # a non-empty directory cannot be replaced by a file
    with pytest.raises(OSError), atomic_path(final) as tmp:
        tmp.write_text("new")
    assert (final / "x").read_text() == "keep"
    assert _names(tmp_path) == ["taken"]


def test_atomic_path_block_that_writes_nothing_fails_cleanly(tmp_path: Path) -> None:
    final = tmp_path / "w.bin"
    final.write_bytes(b"old")
    with pytest.raises(FileNotFoundError), atomic_path(final):
        pass
    assert final.read_bytes() == b"old" and _names(tmp_path) == ["w.bin"]


def test_write_text_and_json(tmp_path: Path) -> None:
    p = write_text_atomic(tmp_path / "a" / "t.txt", "hi\n")
    assert p.read_text() == "hi\n"
    j = write_json_atomic(tmp_path / "j.json", {"x": Path("/p")})
    assert j.read_text() == '{\n  "x": "/p"\n}\n'
    assert temp_path_for(j) == tmp_path / f".j.json.tmp{os.getpid()}"
    assert _names(tmp_path) == ["a", "j.json"]


def test_write_text_failure_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "t.txt"
    final.write_text("old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        write_text_atomic(final, "new")
    assert final.read_text() == "old" and _names(tmp_path) == ["t.txt"]


def test_atomic_dir_success_replaces_and_failure_keeps(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with atomic_dir(dest) as tmp:
        (tmp / "f").write_text("v1")
    assert (dest / "f").read_text() == "v1"
    with pytest.raises(Boom), atomic_dir(dest) as tmp:
        (tmp / "f").write_text("half")
        raise Boom
    assert (dest / "f").read_text() == "v1" and _names(tmp_path) == ["out"]
    with atomic_dir(dest) as tmp:
        (tmp / "g").write_text("v2")
    assert _names(dest) == ["g"] and _names(tmp_path) == ["out"]


def test_replace_dir_moves_old_aside_and_removes_it(tmp_path: Path) -> None:
    final, new = tmp_path / "final", tmp_path / ".final.tmp"
    final.mkdir()
    (final / "old").write_text("o")
    new.mkdir()
    (new / "new").write_text("n")
    assert replace_dir(new, final) == final
    assert _names(final) == ["new"] and _names(tmp_path) == ["final"]
    fresh = tmp_path / ".other.tmp"
    fresh.mkdir()
    replace_dir(fresh, tmp_path / "deep" / "other")  # parents made; nothing to move aside
    assert (tmp_path / "deep" / "other").is_dir() and not fresh.exists()


def test_replace_dir_failure_puts_the_old_one_back(tmp_path: Path) -> None:
    final = tmp_path / "final"
    final.mkdir()
    (final / "old").write_text("o")
    with pytest.raises(OSError):
        replace_dir(tmp_path / "missing", final)
    assert _names(final) == ["old"] and _names(tmp_path) == ["final"]


def test_remove_dir_goes_through_the_trash_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_text("x")
    seen = []
    monkeypatch.setattr("shutil.rmtree", lambda p, ignore_errors=False: seen.append(Path(p).name))
    remove_dir(d, trash=tmp_path / ".trash-d")
    assert seen == [".trash-d"] and not d.exists() and (tmp_path / ".trash-d" / "f").exists()
    monkeypatch.undo()
    remove_dir(tmp_path / ".trash-d")
    remove_dir(tmp_path / "never-there")
    assert _names(tmp_path) == []
