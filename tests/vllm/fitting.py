"""Fitting a speculator to a target's own greedy continuations, so that vLLM accepts many of its drafts (an untrained
draft would only ever exercise rejection, and T = 0 identity holds for any draft, so a head-order, offset or
token-mapping bug would pass): a few Adam steps of the real training loss (`train.loss.speculator_loss`, every step
weighted 1) against the target's law sharpened to ~its greedy token.

- `fit_to_greedy(spec, loaded, sequences, ...)`: any family (taps and / or the last hidden state, as it asks).
- `fitted_export(root, target, family, rows, fitted, ...)`: a checkpoint fitted to the first `fitted` rows (the rest
  held out), saved as the train stage saves them, exported by the real export stage, with the offline prediction of
  vLLM's per-row counters (`evaluate.chain_prediction.predict_rows`) for the export as loaded back."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from speculators.core.config import TargetConfig
from speculators.core.target import fingerprint_target, forward_with_taps, load_target, saved_eos_token_ids
from speculators.core.workloads import WorkloadRow
from speculators.evaluate.chain_prediction import RowPrediction, predict_rows
from speculators.evaluate.teacher import encode_row, greedy_tokens
from speculators.export import export as export_stage
from speculators.models import SPECULATORS
from speculators.models.base import step_rows
from speculators.models.io import load_speculator, target_weights
from speculators.train.loss import TeacherShape, VocabMap, dense_teacher, speculator_loss

REPO = Path(__file__).resolve().parents[2]


def fit_to_greedy(spec, loaded, sequences: list[list[int]], starts: list[int] | None = None, *, lr: float,
                  steps: int = 150) -> dict:
    """`steps` Adam steps on `sequences` (token ids), the loss counted from `starts[i]` on (default: everywhere).
    Returns {"accuracy": the last per-step top-1 accuracy}."""
    t = max(map(len, sequences))
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    mask, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        loss_mask[i, (starts[i] if starts else 0):len(s)] = 1
    req = spec.required_features()
    out = forward_with_taps(loaded.model, ids, mask, list(req.tap_layer_ids or []))
    vocab = VocabMap.build(spec.draft_to_target, loaded.vocab_size)
    teacher = dense_teacher(out.logits, vocab, TeacherShape(temperature=0.01))
    rows = step_rows(loss_mask, mask, spec.num_steps)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "head_rows": rows}
    if req.tap_layer_ids:
        batch["taps"] = out.taps
    if req.last_hidden:
        batch["last_hidden"] = out.last_hidden
    opt = torch.optim.Adam([p for p in spec.parameters() if p.requires_grad], lr=lr)
    spec.train()
    for _ in range(steps):
        res = speculator_loss(spec.forward_train(batch), teacher, loss_mask, mask, [1.0] * spec.num_steps, vocab,
                              rows=rows)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    spec.eval()
    return {"accuracy": (res.correct.float() / res.counted.clamp_min(1)).tolist()}


def fitted_export(root: Path, target: Path, family: str, rows: list[WorkloadRow], fitted: int, *, k: int,
                  lr: float, draft_vocab_size: int | None = None, steps: int = 60
                  ) -> tuple[Path, list[RowPrediction]]:
    """A run dir under `root` holding one `family` checkpoint of `target` (k steps / heads, the full vocabulary
    unless `draft_vocab_size`: then the tokens the fitted continuations use first), fitted for `steps` Adam steps
    to the target's greedy continuations of the first `fitted` rows, saved as the train stage saves checkpoints and
    exported by the real export stage. Returns (export dir, per-row predictions for the export as loaded back).

    60 steps suffice for the house target's EAGLE-3 and Medusa drafts of tests/vllm (lr 3e-3, 2 of 4 rows fitted):
    every draft on the fitted rows predicted accepted ([16, 16, 16] each), as after 150 steps, at 0.4x the time;
    after 30, EAGLE-3 still predicted [16, 12, 7] and [19, 12, 10]."""
    sys.path.insert(0, str(REPO / "tests" / "unit" / "evaluate"))
    from evalexport_helpers import make_recipe, save_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    recipe = make_recipe(root, target, family, num_steps=k, draft_vocab_size=draft_vocab_size,
                         extra=("export.checkpoint=latest", f"export.speculative_tokens={k}"))
    loaded = load_target(recipe.target)
    prompts = [encode_row(loaded.tokenizer, r) for r in rows[:fitted]]
    sequences = [p + greedy_tokens(loaded.model, p, r.max_new_tokens + k + 2) for p, r in zip(prompts, rows,
                                                                                              strict=False)]
    d2t = None
    if draft_vocab_size is not None:
        used = sorted({t for s in sequences for t in s})
        assert len(used) <= draft_vocab_size
        others = [t for t in range(loaded.vocab_size) if t not in set(used)][: draft_vocab_size - len(used)]
        d2t = torch.tensor(sorted(used + others)) - torch.arange(draft_vocab_size)  # [Vd]
    torch.manual_seed(0)
    spec = SPECULATORS[family].from_target(loaded.model.config, recipe.speculator, target_weights(loaded.model),
                                           d2t=d2t)
    fit = fit_to_greedy(spec, loaded, sequences, [len(p) for p in prompts], lr=lr, steps=steps)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    save_checkpoint(recipe, spec, steps, fp, fit=fit)
    export_stage.run(recipe)
    export = recipe.paths.export
    exported = load_speculator(export, target_weights(loaded.model))  # the export's weights, as vLLM reads them
    eos = set(saved_eos_token_ids(TargetConfig(name_or_path=str(target))))
    return export, predict_rows(exported, loaded.model, loaded.tokenizer, rows, k, eos)
