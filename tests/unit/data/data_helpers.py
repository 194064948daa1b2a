"""Helpers for the data-stage tests: small recipes over a few stdlib-chat rows and a tiny target."""

from __future__ import annotations

import json
from pathlib import Path

from speculators.core.config import Recipe
from speculators.core.recipes import recipe_from_dict

REPO = Path(__file__).resolve().parents[3]
CHAT = REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl"


def write_rows(path: Path, n: int, start: int = 0) -> Path:
    """The first n rows of the house chat data (after `start`) as a jsonl file."""
    lines = CHAT.read_text().splitlines()[start:start + n]
    path.write_text("\n".join(lines) + "\n")
    return path


def recipe(run_dir: Path, target_path: Path, rows: Path | list[dict], /, **sections) -> Recipe:
    """A recipe dict with small defaults; `sections` are merged per section (e.g. capture={...})."""
    sources = rows if isinstance(rows, list) else [{"path": str(rows)}]
    d: dict = {"name": "test", "run_dir": str(run_dir), "target": {"name_or_path": str(target_path)},
               "data": {"sources": sources, "max_length": 256},
               "capture": {"shard_tokens": 256, "batch_size": 4},
               "speculator": {"family": "eagle3", "draft_vocab_size": 256},
               "evaluate": {"workloads": [str(REPO / "data" / "workloads" / "*.jsonl")], "max_rows_per_cohort": 2}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            merged = dict(d[key])
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            d[key] = merged
        else:
            d[key] = value
    return recipe_from_dict(json.loads(json.dumps(d)))
