"""Builders shared by the evaluate/export unit tests: a tiny run dir with real (untrained or briefly fitted)
speculator checkpoints of any family on a tiny random target, and small held-out workloads.

Nothing here stands in for product code: checkpoints are written with `models.io.save_speculator` and
`core.pairing`, exactly as the train stage writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from speculators.core.config import Recipe
from speculators.core.pairing import pairing_record, write_pairing
from speculators.core.recipes import load_recipe, to_dict
from speculators.core.target import fingerprint_target, load_target
from speculators.models import SPECULATORS
from speculators.models.io import save_speculator, target_weights

REPO = Path(__file__).resolve().parents[3]


def small_workloads(path: Path, rows_per_cohort: int = 1, max_new_tokens: int = 12,
                    cohorts: tuple[str, ...] = ("code-completion", "copy-heavy", "short-output")) -> Path:
    """A copy of the first rows of a few real workload cohorts with short outputs."""
    rows = []
    for c in cohorts:
        lines = (REPO / "data" / "workloads" / f"{c}.jsonl").read_text().splitlines()[:rows_per_cohort]
        for line in lines:
            r = json.loads(line)
            r["max_new_tokens"] = min(int(r["max_new_tokens"]), max_new_tokens)
            rows.append(r)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def make_recipe(tmp_path: Path, target: Path, family: str, *, num_steps: int = 3,
                draft_vocab_size: int | None = None, temperatures: tuple[float, ...] = (0.0,),
                live: bool = False, workloads: Path | None = None, extra: tuple[str, ...] = ()) -> Recipe:
    wl = workloads or small_workloads(tmp_path / "workloads.jsonl")
    over = [f"run_dir={tmp_path / 'run'}", f"target.name_or_path={target}", "target.device=cpu",
            "target.dtype=float32", f"evaluate.workloads=['{wl}']", f"evaluate.live={str(live).lower()}",
            f"evaluate.temperatures={list(temperatures)}", "evaluate.depth=3", f"speculator.family={family}",
            f"speculator.num_steps={num_steps}",
            f"speculator.draft_vocab_size={'null' if draft_vocab_size is None else draft_vocab_size}", *extra]
    return load_recipe(None, over)


def draft_vocab(vocab: int, size: int, seed: int = 0) -> torch.Tensor:
    """d2t offsets [size] for a sorted random subset of the target vocab."""
    ids = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size]).values
    return ids - torch.arange(size)


def build_speculator(recipe: Recipe, loaded: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    vocab = int(loaded.model.config.vocab_size)
    d2t = None
    if recipe.speculator.draft_vocab_size not in (None, vocab):
        d2t = draft_vocab(vocab, int(recipe.speculator.draft_vocab_size))
    return SPECULATORS[recipe.speculator.family].from_target(loaded.model.config, recipe.speculator,
                                                             target_weights(loaded.model), d2t=d2t)


def save_checkpoint(recipe: Recipe, spec: Any, step: int, fingerprint: dict, **metadata: Any) -> Path:
    d = recipe.paths.checkpoints / f"step-{step:07d}"
    save_speculator(spec, d, {"step": step, **metadata})
    ids = spec.required_features().tap_layer_ids
    write_pairing(d, pairing_record(target=fingerprint, family=recipe.speculator.family,
                                    layer_ids=list(ids) if ids else None, draft_dir=d, recipe=to_dict(recipe)))
    return d


def make_run(tmp_path: Path, target: Path, family: str, steps: tuple[int, ...] = (10,), **kw: Any) -> Recipe:
    """A recipe whose run dir holds untrained checkpoints (different seeds) of `family`."""
    recipe = make_recipe(tmp_path, target, family, **kw)
    loaded = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    for i, step in enumerate(steps):
        save_checkpoint(recipe, build_speculator(recipe, loaded, seed=i), step, fp)
    return recipe
