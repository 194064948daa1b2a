"""The files the package reads at run time besides its code, and where they are: in a clone or in an installed wheel.

`SHIPPED` lists them by their path in the repository: the model shapes `profile --shape` builds (data/shapes), the
embedded house target that `bench`, `generate` and `serve` fall back to (data/targets/stdlib-lm), its held-out
workloads (data/workloads) and the chat datasets the house recipes train on (data/datasets/stdlib-chat,
data/datasets/stdlib-code), and vLLM's CPU repairs (serving/vllm/cpu-fixes). In a clone (an editable install) they
are the top-level folders beside the package; a wheel carries copies under `speculators/_shipped/`, laid out by the
same paths (setup.py's build step copies them there, and adds them to an sdist). This module is the only place that
knows where they are:

- `shipped_root()`: the folder holding them (`speculators/_shipped` when installed, else the clone's root);
- `shipped(rel)`: one of them by its repository path, e.g. `shipped("data/shapes")`;
- `locate(path)` / `locate_glob(pattern)`: a path given relative to the working directory (recipes and flags say
  `data/targets/stdlib-lm`, `data/workloads/*.jsonl`) that matches nothing there but names a shipped file: the
  package's copy of it; any other path unchanged (a path that exists where the user is always wins).

It does not read the files, and it imports only the standard library: setup.py loads it by path to learn `SHIPPED`.
Not shipped: the trained speculators in data/speculators (test data), recipes/, docs/ and export/ (golden exports).
"""

from __future__ import annotations

import functools
import glob
import os
from importlib.resources import files
from pathlib import Path, PurePosixPath

SHIPPED: tuple[str, ...] = (
    "data/shapes",
    "data/targets/stdlib-lm",
    "data/workloads",
    "data/datasets/stdlib-chat",
    "data/datasets/stdlib-code",
    "serving/vllm/cpu-fixes",
)
INSTALLED_DIR = "_shipped"  # the folder inside the installed package that holds the copies


@functools.cache
def shipped_root() -> Path:
    """The folder that holds the `SHIPPED` paths: the wheel's `speculators/_shipped`, else the clone's root."""
    package = Path(str(files("speculators"))).resolve()
    installed = package / INSTALLED_DIR
    return installed if installed.is_dir() else package.parent


def shipped(rel: str) -> Path:
    """The shipped file or folder `rel` (a repository path inside one of `SHIPPED`, e.g. "data/shapes")."""
    if not is_shipped(rel):
        raise ValueError(f"{rel!r} is not inside a shipped folder ({', '.join(SHIPPED)})")
    return shipped_root() / _normal(rel)


def is_shipped(path: str) -> bool:
    """Whether relative `path` (or glob) names one of the `SHIPPED` folders or something inside one."""
    rel = _normal(path)
    return not PurePosixPath(rel).is_absolute() and any(rel == s or rel.startswith(s + "/") for s in SHIPPED)


def locate(path: str) -> str:
    """`path` as given when it exists (relative to the working directory), is absolute or names nothing shipped;
    else the shipped copy's absolute path when there is one (`data/targets/stdlib-lm` outside the clone)."""
    if not path or os.path.isabs(path) or os.path.exists(path) or not is_shipped(path):
        return path
    copy = shipped_root() / _normal(path)
    return str(copy) if copy.exists() else path


def locate_glob(pattern: str) -> str:
    """`locate` for a glob pattern: unchanged when it matches something where the user is; else the pattern inside
    the shipped folders when that matches (`data/workloads/*.jsonl` outside the clone)."""
    if not pattern or os.path.isabs(pattern) or glob.glob(pattern) or not is_shipped(pattern):
        return pattern
    inside = str(shipped_root() / _normal(pattern))
    return inside if glob.glob(inside) else pattern


def _normal(path: str) -> str:
    """`path` as a normalised POSIX-style relative path ("./data//shapes/" -> "data/shapes")."""
    return PurePosixPath(os.path.normpath(path).replace(os.sep, "/")).as_posix()
