"""The one atomic writer: a reader (or a crash) sees the old complete file or the new one, never a half-written one.

Every `os.replace` of the package lives here.

- `atomic_path(final)`: a context manager yielding a temp path next to `final` (`.<name>.tmp<pid>`) for any writer
  (safetensors, torch, text); on success the temp file is fsynced and replaces `final`, on error it is removed and
  `final` is untouched.
- `write_text_atomic(path, text)` / `write_json_atomic(path, data)`: text / JSON through `atomic_path`.
- `atomic_dir(dest)`: a context manager yielding a fresh temp directory next to `dest`; on success the temp dir
  replaces `dest` (`replace_dir`), on error the temp dir is removed and `dest` is untouched.
- `replace_dir(tmp, final)`: move a finished temp directory into place; an existing `final` is first moved aside
  and removed only once the new one is in place (a crash leaves the old one, or the new one, plus a stray aside).
- `remove_dir(path, trash)`: rename a directory out of the way first, then delete it, so a half-deleted directory
  never keeps a valid-looking name.

This module knows nothing about formats, nor about which temp / aside names a caller's crash cleanup looks for (the
callers pass those names when they have such a cleanup).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def temp_path_for(final: str | Path) -> Path:
    """The temp name `atomic_path` / `write_text_atomic` write through: `.<name>.tmp<pid>` next to `final`."""
    p = Path(final)
    return p.with_name(f".{p.name}.tmp{os.getpid()}")


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temp path next to `final` for the block to write; on success fsync it and `os.replace` it onto
    `final`; on any error (in the block, the fsync or the replace) remove the temp and leave `final` as it was."""
    p = Path(final)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(p)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a fsynced temp file in the same directory and `os.replace`."""
    p = Path(path)
    with atomic_path(p) as tmp:
        tmp.write_text(text)
    return p


def write_json_atomic(path: str | Path, data: object) -> Path:
    """JSON (indent 2, non-JSON values as str, trailing newline) written with `write_text_atomic`."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def replace_dir(tmp: str | Path, final: str | Path, aside: str | Path | None = None) -> Path:
    """Move the finished directory `tmp` into place as `final`. An existing `final` is renamed to `aside` (default
    `.<name>.old<pid>`) first and deleted only after `tmp` took its name; if that rename fails the old one is put
    back. Returns `final`."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        return final
    old = Path(aside) if aside is not None else final.with_name(f".{final.name}.old{os.getpid()}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def remove_dir(path: str | Path, trash: str | Path | None = None) -> None:
    """Rename `path` to `trash` (default `.<name>.trash<pid>`) first, then delete it: a half-deleted directory never
    keeps a valid-looking name. Nothing to do when `path` does not exist."""
    p = Path(path)
    if not p.exists():
        return
    t = Path(trash) if trash is not None else p.with_name(f".{p.name}.trash{os.getpid()}")
    os.replace(p, t)
    shutil.rmtree(t, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Build a directory under a temp name and move it into place (`replace_dir`) only if the block succeeds; on
    any error (in the block or the move) the temp dir is removed and `dest` is left as it was."""
    d = Path(dest)
    d.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = d.with_name(f".{d.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, d, aside=d.with_name(f".{d.name}.old-{tag}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
