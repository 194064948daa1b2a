"""The checkpoint-folder format: what `train` writes and `evaluate` / `export` / resume read, with one rule for
"complete".

    checkpoints/
      step-0000400/            one checkpoint: config.json, model.safetensors, pairing.json (complete = all three)
        training_state/        optimizer / schedule / RNG / data position for an exact resume (trainer_state.json)
      latest, best             pointer files: one line naming a step dir (best is evaluate's choice)

A step directory is written under a temp name and renamed into place, so a crash leaves no half checkpoint under a
`step-*` name. This module reads and writes names and pointers only; it loads no weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from speculators.core.atomic import write_text_atomic
from speculators.core.errors import SpeculatorsError

STEP_RE = re.compile(r"^step-(\d+)$")
CHECKPOINT_FILES = ("config.json", "model.safetensors", "pairing.json")
STATE_DIR = "training_state"
TRAINER_STATE = "trainer_state.json"


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def step_number(path: str | Path) -> int:
    """The step of a `step-*` name (-1 for any other name)."""
    m = STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else -1


def is_complete_checkpoint(path: str | Path) -> bool:
    """A `step-*` directory holding every file a reader needs (the one rule every stage uses)."""
    p = Path(path)
    return bool(STEP_RE.match(p.name)) and p.is_dir() and all((p / f).is_file() for f in CHECKPOINT_FILES)


def is_resumable(path: str | Path) -> bool:
    """A complete checkpoint that also carries the trainer state an exact resume needs."""
    return is_complete_checkpoint(path) and (Path(path) / STATE_DIR / TRAINER_STATE).is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """The complete step directories under `root`, oldest first."""
    d = Path(root)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if is_complete_checkpoint(p)), key=step_number)


def incomplete_checkpoints(root: str | Path) -> dict[str, list[str]]:
    """`step-*` directories under `root` that are not complete: name -> the checkpoint files they lack."""
    d = Path(root)
    if not d.is_dir():
        return {}
    return {p.name: [f for f in CHECKPOINT_FILES if not (p / f).is_file()] for p in sorted(d.iterdir(), key=step_number)
            if STEP_RE.match(p.name) and p.is_dir() and not is_complete_checkpoint(p)}


def describe_incomplete(root: str | Path) -> str:
    """'' or one clause naming the incomplete step dirs and what they lack (for a 'no checkpoints' error)."""
    bad = incomplete_checkpoints(root)
    if not bad:
        return ""
    return "; " + ", ".join(f"{name} is missing {', '.join(missing)}" for name, missing in bad.items()) + \
        " (incomplete: re-run train)"


def write_pointer(root: str | Path, name: str, step_dir: str | Path) -> Path:
    """`root/name` (latest | best) := the step dir's name, written atomically."""
    return write_text_atomic(Path(root) / name, Path(step_dir).name + "\n")


def read_pointer(root: str | Path, name: str) -> Path | None:
    """The complete checkpoint `root/name` names; None when the pointer file is absent. A pointer that is empty or
    names no complete checkpoint is an error (one line saying how to repair it)."""
    d = Path(root)
    f = d / name
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not text:
        raise SpeculatorsError(f"{f} is empty; re-run the stage that writes it (`train` for latest, `evaluate` for "
                               f"best)")
    p = Path(text)
    target = p if p.is_absolute() else d / p
    if not is_complete_checkpoint(target):
        raise SpeculatorsError(f"{f} names {text}, which is not a complete checkpoint (needs "
                               f"{', '.join(CHECKPOINT_FILES)}); re-run `speculators train` or `evaluate`")
    return target
