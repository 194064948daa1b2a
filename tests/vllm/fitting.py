"""Fitting a speculator to a target's own greedy continuations, so that vLLM accepts many of its drafts (an untrained
draft would only ever exercise rejection): a few Adam steps of the real training loss
(`train.loss.speculator_loss`, every step weighted 1) against the target's law sharpened to ~its greedy token."""

from __future__ import annotations

import torch

from speculators.models.base import step_rows
from speculators.target import forward_with_taps
from speculators.train.loss import TeacherShape, VocabMap, dense_teacher, speculator_loss


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
    out = forward_with_taps(loaded.model, ids, mask, list(spec.layer_ids))
    vocab = VocabMap.build(spec.draft_to_target, loaded.vocab_size)
    teacher = dense_teacher(out.logits, vocab, TeacherShape(temperature=0.01))
    rows = step_rows(loss_mask, mask, spec.num_steps)
    batch = {"input_ids": ids, "attention_mask": mask, "taps": out.taps, "head_rows": rows}
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
