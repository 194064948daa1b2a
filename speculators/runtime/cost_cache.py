"""What cycles cost on this machine, kept across processes: an engine's `CostModel` (cycle_costs.py) saved in the
cache root and loaded by the next engine of the same kind, so a server's first request already drafts at this
machine's prices (the calibration of calibration.py runs only where nothing is cached) and the tables keep the
corrections that observed cycles made (per-kind excess, measured over predicted per plan).

The key is everything a cycle's seconds depend on that a process can see: the processor (CPU model, or the GPU's
name), torch's thread count and version, the target (its folder and revision, architecture, layer count, width,
vocabulary, dtype), the draft revision and how it computes, and the tree settings (kind, depth, top-k, budget, the
lookup's depth and graft), and whether it records traffic. Another machine, thread count or draft revision starts
from its own calibration.

Saved after a calibration and then every `SAVE_EVERY` requests (atomically: a reader sees the old file or the new).
Not here: measuring (calibration.py), the tables themselves (cycle_costs.py), the choice of plans (adaptive.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from speculators.core.atomic import write_json_atomic
from speculators.core.machine import device_name
from speculators.core.target_sources import cache_root
from speculators.runtime.cycle_costs import CostModel

SAVE_EVERY = 16  # requests between saves of a cached engine's costs
FORMAT = "speculators.costs/v1"


def cost_key(engine: Any) -> dict:
    """What the engine's cycle costs depend on (see the module docstring)."""
    target, tree, config = engine.target, engine.tree, engine.target.config
    return {"processor": device_name(engine.device), "device": engine.device.type,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "target": {"name_or_path": str(target.cfg.name_or_path), "revision": target.cfg.revision,
                       "model_type": getattr(config, "model_type", None),
                       "layers": int(config.num_hidden_layers), "hidden": int(config.hidden_size),
                       "vocab": int(config.vocab_size), "dtype": str(target.dtype)},
            "drafter": {"name": engine.info.name, "family": engine.info.family, "revision": engine.info.revision,
                        "precision": engine.info.precision},
            "tree": {"kind": tree.kind, "depth": tree.depth, "topk": tree.topk, "budget": tree.budget,
                     "verify": tree.verify, "lookup_depth": engine.lookup_depth, "graft_nodes": engine.graft_nodes},
            "recording": engine.recorder is not None}


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "costs" / f"{digest}.json"


def load_costs(engine: Any) -> bool:
    """Install the cached costs of an engine like this one on this machine; False when none are cached (or the file
    is unreadable: it is then measured anew and overwritten)."""
    key = cost_key(engine)
    try:
        saved = json.loads(cost_path(key).read_text())
        cost = CostModel.from_state(saved["cost"]) if saved.get("format") == FORMAT and saved["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if cost is None or not cost.calibrated:
        return False
    cost.origin = f"cached: {cost_path(key)}"
    engine.cost = cost
    return True


def save_costs(engine: Any) -> Path | None:
    """Write the engine's current costs under its key (None when it has none to save or the cache is read-only)."""
    if not engine.cost.calibrated:
        return None
    key = cost_key(engine)
    try:
        return write_json_atomic(cost_path(key), {"format": FORMAT, "key": key, "cost": engine.cost.state()})
    except OSError:
        return None
