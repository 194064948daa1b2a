"""The house target's corpus: the Python standard library's own source and documentation.

Every Python installation carries this text offline, so the house target can be rebuilt anywhere with no network.
This module finds the stdlib source files, drops tests, GUI code and generated tables, and splits them into a
training part and a held-out part by WHOLE MODULE (the held-out modules feed the evaluation workloads, so no model
in the pipeline ever trains on them). It also exposes the language-reference topics from `pydoc_data` as prose.

It does not tokenize, build chat tasks or train anything (see `tasks.py` and `build.py`).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Whole top-level modules / packages that no model in the pipeline trains on. They feed data/workloads/*.jsonl.
HELD_OUT_MODULES: tuple[str, ...] = (
    "bisect", "calendar", "colorsys", "csv", "difflib", "filecmp", "fnmatch", "fractions", "getopt", "glob",
    "graphlib", "gzip", "heapq", "ipaddress", "json", "netrc", "plistlib", "pprint", "queue", "sched", "secrets",
    "shlex", "statistics", "string", "textwrap", "tomllib", "uuid", "wave",
)

# Directories (first path component under the stdlib root) that are not library code worth learning from.
_SKIPPED_TOP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip",
    "lib-dynload", "__pycache__", "encodings", "pydoc_data", "__phello__",
})
_SKIPPED_FILES = frozenset({"antigravity.py", "this.py", "__hello__.py", "turtle.py"})


@dataclass(frozen=True)
class SourceFile:
    """One stdlib source file with its dotted module name and split."""

    module: str  # dotted name, e.g. "json.decoder"
    top_module: str  # first component, e.g. "json"
    path: Path
    text: str

    @property
    def held_out(self) -> bool:
        return self.top_module in HELD_OUT_MODULES


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def iter_source_files(root: Path | None = None) -> list[SourceFile]:
    """All usable stdlib `.py` files, sorted by module name (deterministic order)."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        parts = rel_dir.parts
        if parts and (parts[0] in _SKIPPED_TOP_DIRS or parts[0].startswith("config-")):
            dirnames[:] = []
            continue
        if any(p in ("test", "tests", "__pycache__") for p in parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py") or name in _SKIPPED_FILES or name.startswith("_sysconfigdata"):
                continue
            if name.startswith("test_"):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(root)
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            module = _module_name(rel)
            out.append(SourceFile(module=module, top_module=module.split(".")[0], path=path, text=text))
    out.sort(key=lambda s: s.module)
    return out


def doc_topics() -> dict[str, str]:
    """The Python Language Reference topics shipped in `pydoc_data.topics` (prose documentation)."""
    from pydoc_data.topics import topics  # type: ignore[import-not-found]

    return dict(sorted(topics.items()))


def topic_held_out(name: str) -> bool:
    """About 1 topic in 8 is held out (stable hash of its name)."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 8 == 0
