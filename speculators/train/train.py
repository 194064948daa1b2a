"""The `train` pipeline stage: `is_complete` and `run`, the one entry `speculators train` and `speculators run` call.

`run` returns the saved summary when the checkpoints are complete for this recipe (same training signature), else
re-launches under `accelerate launch` when the recipe asks for several processes or an accelerate config
(launch.py), else trains in this process (loop.py). It does not train itself.
"""

from __future__ import annotations

import json

from speculators.core.checkpoints import read_pointer
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.train.checkpoint import SUMMARY_FILE
from speculators.train.launch import launch, needs_launch
from speculators.train.loop import train
from speculators.train.setup import train_signature


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: always."""
    return True


def is_complete(recipe: Recipe) -> bool:
    """The recipe's checkpoints hold a complete training with this recipe's signature and a `latest` step."""
    root = recipe.paths.checkpoints
    try:
        summary = json.loads((root / SUMMARY_FILE).read_text())
        latest = read_pointer(root, "latest")
    except (OSError, json.JSONDecodeError, SpeculatorsError):
        return False
    return bool(summary.get("complete")) and summary.get("signature") == train_signature(recipe) and latest is not None


def run(recipe: Recipe, *, force: bool = False) -> dict:
    """Train (or report the complete training) and return the summary."""
    if not force and is_complete(recipe):
        summary = json.loads((recipe.paths.checkpoints / SUMMARY_FILE).read_text())
        summary["status"] = "complete (already trained; --force retrains)"
        return summary
    if needs_launch(recipe):
        return launch(recipe, force=force)
    return train(recipe, force=force)
