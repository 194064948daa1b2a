"""Helpers for the training tests: tiny recipes over a few stdlib-chat rows, prepared data, and the real CLI.

Shared by tests/unit/train, tests/distributed/test_train_*.py and tests/integration/test_train_families.py
(imported as `tests.unit.train.train_helpers`; the repo root is on pytest's pythonpath).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
CHAT = REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl"
SPECULATORS_BIN = Path(sys.executable).parent / "speculators"


def write_rows(path: Path, n: int, start: int = 0) -> Path:
    lines = CHAT.read_text().splitlines()[start:start + n]
    path.write_text("\n".join(lines) + "\n")
    return path


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_dict(run_dir: Path, target: Path, rows: Path, **sections) -> dict:
    """A tiny online-mode recipe: 2-step EAGLE-3 over a reduced draft vocab, a few optimizer steps, jsonl only."""
    d = {
        "name": "train-test", "run_dir": str(run_dir), "seed": 0,
        "target": {"name_or_path": str(target)},
        "data": {"sources": [{"path": str(rows)}], "max_length": 96, "val_fraction": 0.2},
        "capture": {"mode": "online", "shard_tokens": 512, "batch_size": 8},
        "speculator": {"family": "eagle3", "num_steps": 2, "draft_vocab_size": 512},
        "train": {"max_steps": 6, "batch_size": 4, "lr": 3.0e-3, "warmup_ratio": 0.2, "eval_every": 3,
                  "save_every": 3, "log_every": 1, "keep_last": 2, "trackers": ["jsonl"]},
    }
    return merge(d, sections)


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load(data: dict):
    from speculators.core.recipes import recipe_from_dict

    return recipe_from_dict(json.loads(json.dumps(data)))


def prepare(data: dict) -> None:
    """Run the real prepare stage for a recipe dict (tokenize + assistant masks)."""
    from speculators.data import prepare as prepare_stage

    prepare_stage.run(load(data))


def capture(data: dict) -> None:
    from speculators.data import capture as capture_stage

    capture_stage.run(load(data))


def cli_env(threads: int = 1) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
                "PYTHONPATH": str(REPO)})
    env.pop("WANDB_API_KEY", None)
    return env


def run_cli(args: list[str], *, cwd: Path | None = None, timeout: float = 300, threads: int = 1,
            env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPECULATORS_BIN), *args], cwd=cwd or REPO, env=env or cli_env(threads),
                          capture_output=True, text=True, timeout=timeout, check=False)


def jsonl(run_dir: Path, kind: str = "train") -> list[dict]:
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in jsonl(run_dir)}
