"""Held-out validation during training: teacher-forced per-step accuracy, chain reach, per-position acceptance and
simulated tau of the speculator on the split the loop never trains on (`speculators.core.metrics` formulas), gathered
over every rank, and the table rows the tracker logs. It neither trains nor writes checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from speculators.core.metrics import chain_reach, per_position_from_reach, simulated_tau
from speculators.models.base import step_rows
from speculators.train.batches import load_batch
from speculators.train.loss import TOPK, speculator_loss
from speculators.train.setup import Setup


def evaluate_heldout(acc: Any, model: Any, setup: Setup, features: Any, weights: list[float], vocab: Any,
                     batch_size: int, pad_id: int) -> dict:
    """Held-out teacher-forced metrics: per-step top-1 / top-k accuracy, chain reach, per-position acceptance,
    simulated tau, KL. Every rank runs the same number of forwards (ZeRO-3 gathers parameters in forward)."""
    val = setup.val_idx
    if not val:
        return {}
    world, rank = acc.num_processes, acc.process_index
    mine = val[rank::world]
    per_rank = -(-len(val) // world)
    n_batches = -(-per_rank // batch_size)
    k_steps = len(weights)
    kl_sum = torch.zeros(k_steps, dtype=torch.float64)
    correct = torch.zeros(k_steps, dtype=torch.long)
    counted = torch.zeros(k_steps, dtype=torch.long)
    topk = torch.zeros(k_steps, TOPK, dtype=torch.long)
    alphas, valids = [], []
    model.eval()
    with torch.no_grad():
        for b in range(n_batches):
            idx = mine[b * batch_size:(b + 1) * batch_size]
            dummy = not idx
            batch = load_batch(setup.source, idx or [val[0]], pad_id)
            inputs, teacher = features(batch, acc.device)
            loss_mask, attention_mask = batch["loss_mask"].to(acc.device), batch["attention_mask"].to(acc.device)
            inputs["head_rows"] = rows = step_rows(loss_mask, attention_mask, k_steps)
            logits = model(inputs)
            if dummy:
                continue
            out = speculator_loss(logits, teacher, loss_mask, attention_mask, weights, vocab, with_alpha=True,
                                  rows=rows)
            kl_sum += torch.tensor(out.step_kl, dtype=torch.float64) * out.counted.double()
            correct += out.correct
            counted += out.counted
            topk += out.topk_correct
            rows = out.valid[..., 0]  # [B, T]
            alphas.append(out.alpha[rows])  # [n, K]
            valids.append(out.valid[rows])
    model.train()
    dev = acc.device
    alpha = torch.cat(alphas) if alphas else torch.zeros(0, k_steps)
    valid = torch.cat(valids) if valids else torch.zeros(0, k_steps, dtype=torch.bool)
    alpha = acc.gather(acc.pad_across_processes(alpha.to(dev), dim=0)).cpu()
    valid = acc.gather(acc.pad_across_processes(valid.to(torch.uint8).to(dev), dim=0)).cpu().bool()
    sums = acc.reduce(torch.cat([kl_sum, correct.double(), counted.double(), topk.double().flatten()]).to(dev),
                      reduction="sum").cpu()
    kl_sum, correct, counted = sums[:k_steps], sums[k_steps:2 * k_steps], sums[2 * k_steps:3 * k_steps]
    topk = sums[3 * k_steps:].view(k_steps, TOPK)
    reach = chain_reach(alpha, valid)
    per_pos = per_position_from_reach(reach)
    denom = counted.clamp_min(1)
    top1 = (correct / denom).tolist()
    kl = (kl_sum / denom).tolist()
    return {
        "val_loss": float(sum(w * v for w, v in zip(weights, kl, strict=False))),
        "val_kl": [round(v, 5) for v in kl],
        "val_top1_accuracy": [round(v, 5) for v in top1],
        "val_topk_accuracy": (topk / denom[:, None]).tolist(),
        "chain_reach": [round(v, 5) for v in reach],
        "per_position_acceptance": [round(v, 5) for v in per_pos],
        "simulated_tau": round(simulated_tau(per_pos), 5),
        "val_positions": int(counted[0]),
    }


def acceptance_rows(ev: dict) -> list[dict]:
    return [{"k": k + 1, "acceptance": a, "chain_reach": e, "top1_accuracy": t}
            for k, (a, e, t) in enumerate(zip(ev["per_position_acceptance"], ev["chain_reach"],
                                              ev["val_top1_accuracy"], strict=False))]
