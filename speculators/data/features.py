"""What capture stores per token for a speculator family, and the one target forward that computes it.

- `feature_request`: the family's `FeatureRequest` (its class says which taps / hidden states it needs).
- `stored_features`: the feature names a capture with that request and teacher writes ("taps", "last_hidden").
- `compute_features`: one target forward -> float32 features (+ the top-k or full-logits teacher). Capture calls
  it offline (capture.py); the training loop calls it online (`capture.mode: online`, train/batches.py).
- `HfFeatures`: capture's Hugging Face backend: rows in padded batches (longest first) -> per-row features, the
  interface vllm_capture.VllmFeatures shares (`rows(ids_list)` yields (row index, features), `seconds`).

Nothing here writes files or knows shard formats (shards.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from speculators.core.config import Recipe
from speculators.core.target import forward_with_taps
from speculators.models import SPECULATORS

TOPK_CHUNK_ELEMENTS = 1 << 26  # logits converted to float32 at a time for the top-k teacher (256 MiB)


def feature_request(recipe: Recipe, num_layers: int) -> Any:
    """The FeatureRequest of the recipe's speculator family (its class says what it needs; unknown: one error)."""
    return SPECULATORS[recipe.speculator.family].capture_request(recipe.capture.layer_ids, num_layers)


def stored_features(request: Any, teacher: str) -> list[str]:
    out = []
    if request.tap_layer_ids:
        out.append("taps")
    if request.last_hidden or teacher == "hidden":
        out.append("last_hidden")
    return out


def compute_features(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, request: Any, *,
                     teacher: str = "none", topk: int = 20, need_last_hidden: bool | None = None) -> dict:
    """One target forward -> float32 features: "taps" [B, T, n*H], "last_hidden" [B, T, H]; teacher "topk" adds
    "teacher_topk_ids" [B, T, k] long + "teacher_topk_logprobs" [B, T, k]; teacher "logits" adds "logits"
    [B, T, V]. Used offline by capture and online by the training loop."""
    layer_ids = list(request.tap_layer_ids) if request.tap_layer_ids else None
    out = forward_with_taps(model, input_ids, attention_mask, layer_ids)
    res: dict[str, torch.Tensor] = {}
    if out.taps is not None:
        res["taps"] = out.taps.float()
    if need_last_hidden if need_last_hidden is not None else request.last_hidden:
        res["last_hidden"] = out.last_hidden.float()
    if teacher == "topk":
        logits = out.logits  # [B, T, V]
        b, t, v = logits.shape
        flat = logits.reshape(b * t, v)
        values, ids = [], []
        for chunk in flat.split(max(1, TOPK_CHUNK_ELEMENTS // v)):  # bounded float32 log-softmax
            top = torch.log_softmax(chunk.float(), dim=-1).topk(topk, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
        res["teacher_topk_ids"] = torch.cat(ids).reshape(b, t, topk)  # [B, T, k]
        res["teacher_topk_logprobs"] = torch.cat(values).reshape(b, t, topk).clamp_min(-1e4)  # [B, T, k]
    elif teacher == "logits":
        res["logits"] = out.logits.float()
    return res


class HfFeatures:
    """Per-row float32 features from Hugging Face forwards of `target` (batches of `batch_size` rows)."""

    def __init__(self, target: Any, request: Any, *, teacher: str, topk: int, batch_size: int,
                 need_last_hidden: bool) -> None:
        self.target, self.request, self.teacher, self.topk = target, request, teacher, topk
        self.batch_size, self.need_last_hidden = batch_size, need_last_hidden
        self.seconds = 0.0

    def rows(self, ids_list: list[list[int]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        tok = self.target.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        order = sorted(range(len(ids_list)), key=lambda r: (-len(ids_list[r]), r))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(ids_list[r]) for r in batch)
            inp = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, T]
            att = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            for j, r in enumerate(batch):
                inp[j, : len(ids_list[r])] = torch.tensor(ids_list[r])
                att[j, : len(ids_list[r])] = 1
            t0 = time.time()
            feats = compute_features(self.target.model, inp.to(self.target.device), att.to(self.target.device),
                                     self.request, teacher=self.teacher, topk=self.topk,
                                     need_last_hidden=self.need_last_hidden)
            feats = {k: v.cpu() for k, v in feats.items()}  # one device->host copy per tensor and batch
            self.seconds += time.time() - t0
            for j, r in enumerate(batch):
                yield r, {k: v[j, : len(ids_list[r])] for k, v in feats.items()}
