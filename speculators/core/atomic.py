"""The one atomic writer: a reader (or a crash) sees the old complete file or the new one, never a half-written one.

- `write_text_atomic(path, text)` / `write_json_atomic(path, data)`: temp file in the same directory, flushed and
  fsynced, then `os.replace`.
- `atomic_dir(dest)`: a context manager yielding a fresh temp directory next to `dest`; on success the temp dir
  replaces `dest` (the old one is moved aside first and removed after), on error the temp dir is removed and
  `dest` is untouched.

This module knows nothing about formats.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a fsynced temp file in the same directory and `os.replace`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
    return p


def write_json_atomic(path: str | Path, data: object) -> Path:
    """JSON (indent 2, non-JSON values as str, trailing newline) written with `write_text_atomic`."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(dest: str | Path) -> Iterator[Path]:
    """Build a directory under a temp name and move it into place only if the block succeeds."""
    d = Path(dest)
    d.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = d.with_name(f".{d.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = d.with_name(f".{d.name}.old-{tag}")
    if d.exists():
        d.replace(old)
    tmp.replace(d)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
