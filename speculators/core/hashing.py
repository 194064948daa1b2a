"""Content hashes of files: `sha256_file(path)` reads a file in 4 MiB chunks and returns its hex sha256.

Used by the data stages' manifests, the target fingerprint and the packaged-target checks. Not here: what a hash is
compared with, or any cache of hashes (speculators.core.target keeps one keyed by file stat).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
