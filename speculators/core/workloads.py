"""Held-out workloads: the row schema every loader uses (`data/workloads/*.jsonl`).

A row is `{"id": str, "cohort": str, "messages": [...] | "prompt": str, "max_new_tokens": int}` (extra keys such
as `source_module` are allowed and kept). `load_workloads` validates every row and fails with one line naming the
file, the line and the problem. `data/workloads/*.jsonl` outside the clone reads the copy the package ships
(core/package_data.py). This module does not tokenize or run models.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

from speculators.core.errors import SpeculatorsError
from speculators.core.package_data import locate_glob

_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class WorkloadRow:
    id: str
    cohort: str
    max_new_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    extra: dict = field(default_factory=dict)


def validate_row(row: object, where: str) -> WorkloadRow:
    if not isinstance(row, dict):
        raise SpeculatorsError(f"{where}: a workload row must be a JSON object, got {type(row).__name__}")
    for key in ("id", "cohort", "max_new_tokens"):
        if key not in row:
            raise SpeculatorsError(f"{where}: missing required key {key!r}")
    if not isinstance(row["id"], str) or not row["id"]:
        raise SpeculatorsError(f"{where}: 'id' must be a non-empty string")
    if not isinstance(row["cohort"], str) or not row["cohort"]:
        raise SpeculatorsError(f"{where}: 'cohort' must be a non-empty string")
    mnt = row["max_new_tokens"]
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt <= 0:
        raise SpeculatorsError(f"{where}: 'max_new_tokens' must be a positive integer, got {mnt!r}")
    has_messages, has_prompt = "messages" in row, "prompt" in row
    if has_messages == has_prompt:
        raise SpeculatorsError(f"{where}: give exactly one of 'messages' or 'prompt'")
    if has_prompt:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise SpeculatorsError(f"{where}: 'prompt' must be a non-empty string")
    else:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise SpeculatorsError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise SpeculatorsError(f"{where}: messages[{i}] must be {{'role': one of {_ROLES}, "
                                       f"'content': str}}")
        if msgs[-1]["role"] == "assistant":
            raise SpeculatorsError(f"{where}: the last message is the assistant's; a workload ends with a prompt")
    extra = {k: v for k, v in row.items() if k not in ("id", "cohort", "max_new_tokens", "messages", "prompt")}
    return WorkloadRow(id=row["id"], cohort=row["cohort"], max_new_tokens=mnt, messages=row.get("messages"),
                       prompt=row.get("prompt"), extra=extra)


def expand_paths(patterns: list[str]) -> list[Path]:
    """The files the glob patterns match; a shipped pattern (`data/workloads/*.jsonl`) that matches nothing where
    the user runs reads the installed package's copy (`package_data.locate_glob`)."""
    paths: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(locate_glob(pattern)))
        if not matched:
            raise SpeculatorsError(f"workload file not found: {pattern}")
        paths.extend(Path(m) for m in matched)
    return paths


def load_workloads(patterns: list[str] | str, max_rows_per_cohort: int | None = None) -> list[WorkloadRow]:
    """All rows of the given jsonl files (glob patterns allowed), validated; ids must be unique."""
    if isinstance(patterns, str):
        patterns = [patterns]
    rows: list[WorkloadRow] = []
    per_cohort: dict[str, int] = {}
    seen: set[str] = set()
    for path in expand_paths(patterns):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpeculatorsError(f"cannot read workload file {path}: {exc}") from None
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpeculatorsError(f"{where}: not valid JSON ({exc.msg})") from None
            row = validate_row(raw, where)
            if row.id in seen:
                raise SpeculatorsError(f"{where}: duplicate workload id {row.id!r}")
            seen.add(row.id)
            if max_rows_per_cohort is not None and per_cohort.get(row.cohort, 0) >= max_rows_per_cohort:
                continue
            per_cohort[row.cohort] = per_cohort.get(row.cohort, 0) + 1
            rows.append(row)
    if not rows:
        raise SpeculatorsError(f"no workload rows in {', '.join(patterns)}")
    return rows
