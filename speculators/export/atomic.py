"""Atomic writes for evaluation and export outputs: a reader sees the old complete output or the new one, never
a half-written one.

- `write_text_atomic(path, text)`: temp file in the same directory + `os.replace`.
- `atomic_dir(dest)`: a context manager yielding a fresh temp directory next to `dest`; on success the temp dir
  replaces `dest` (the old one is moved aside first and removed after), on error the temp dir is removed and
  `dest` is untouched.

This module knows nothing about formats.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(p)
    return p


def write_json_atomic(path: str | Path, data: object) -> Path:
    import json

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
