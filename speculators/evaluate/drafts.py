"""A speculator's teacher-forced draft logits on one evaluated sequence, computed only where evaluation reads them.

Evaluation scores the drafts of cycle roots x[t+1], t = P-2 .. T-3 (`alpha.positions` starts one later,
`replay.chain_weights` at P-2), at depths 1..D. `forward_train` is asked for the head only at those positions and
steps (its "head_rows", as training asks for the positions where the loss counts), so the prompt's positions and
the steps past D cost no head and no later training-time-test step. The rows come back in place: step k is a
[T, Vd] tensor whose rows t in P-2 .. T-3 hold the draft logits (k < D) and whose other rows are 0 and read by
nobody.

The span is `replay.cycle_roots`. This module does not run the target, score drafts or load checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from speculators.evaluate.replay import cycle_roots


def scored_rows(total_len: int, prompt_len: int, num_steps: int, depth: int) -> list[torch.Tensor]:
    """Flat positions (batch row 0) evaluation reads per step: t = max(P-2, 0) .. T-3 for the first `depth` steps,
    none after.  -> `num_steps` long tensors [N_k]"""
    span = cycle_roots(total_len, prompt_len)  # [N]
    return [span if k < depth else span[:0] for k in range(num_steps)]


def draft_logits(spec: Any, token_ids: list[int], features: dict[str, torch.Tensor], prompt_len: int,
                 depth: int) -> list[torch.Tensor]:
    """K tensors [T, Vd] (float32, CPU) of `spec.forward_train` on one sequence, filled at `scored_rows`.

    features: the teacher pass's per-position features ([1, T, ...], any dtype / device); depth: the depths the
    caller scores (D <= K)."""
    param = next(spec.parameters())
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=param.device)  # [1, T]
    total = int(ids.shape[1])
    rows = scored_rows(total, prompt_len, int(spec.num_steps), depth)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             **{k: v.to(device=param.device, dtype=param.dtype) for k, v in features.items()},
             "head_rows": [r.to(param.device) for r in rows]}
    with torch.no_grad():
        steps = spec.forward_train(batch)  # K x [N_k, Vd]
    out = []
    for step, r in zip(steps, rows, strict=True):
        placed = torch.zeros(total, step.shape[-1], dtype=torch.float32)  # [T, Vd]
        placed[r] = step.float().cpu()
        out.append(placed)
    return out
