"""Two feature captures of the same rows side by side (the HF and the vLLM capture backends, two machines, two
versions): how far each stored tap, the last hidden state and the top-k teacher of one are from the other's.

`compare_features(a, b)` -> {"rows", "tokens", "taps": [per tap: max / mean per-token relative L2 error], "last_hidden":
{...}, "teacher": {top-1 agreement, max |log-prob difference| on ids both keep}, "storage_rmse": each capture's own
quantisation error (manifest)}. Rows are matched by id; both captures must hold the same rows and token ids. It reads
only (FeatureStore) and decides nothing: the test that uses it sets the tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators.core.errors import SpeculatorsError
from speculators.data.shards import FeatureStore


def _relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error of a against b: [T]."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)


def _error_stats(errors: list[torch.Tensor]) -> dict[str, float]:
    flat = torch.cat(errors)
    return {"max_relative_error": round(float(flat.max()), 6), "mean_relative_error": round(float(flat.mean()), 6)}


def _teacher(sa: dict, sb: dict, acc: dict[str, Any]) -> None:
    pos = sa["teacher_mask"].bool() & sb["teacher_mask"].bool()  # [T]
    ia, ib = sa["teacher_topk_ids"][pos], sb["teacher_topk_ids"][pos]  # [M, k]
    la, lb = sa["teacher_topk_logprobs"][pos], sb["teacher_topk_logprobs"][pos]  # [M, k]
    acc["positions"] += int(pos.sum())
    acc["top1_equal"] += int((ia[:, 0] == ib[:, 0]).sum())
    both = ia[:, :, None] == ib[:, None, :]  # [M, k, k]: id j of a is id l of b
    if both.any():
        diff = (la[:, :, None] - lb[:, None, :]).abs()[both]
        acc["max_logprob_diff"] = max(acc["max_logprob_diff"], float(diff.max()))


def compare_features(a_dir: str | Path, b_dir: str | Path) -> dict[str, Any]:
    """Per-tap, last-hidden and teacher differences between two captures of the same rows (see module doc)."""
    a, b = FeatureStore(a_dir), FeatureStore(b_dir)
    ids_a, ids_b = a.row_ids(), b.row_ids()
    if sorted(ids_a) != sorted(ids_b):
        raise SpeculatorsError(f"{a_dir} and {b_dir} hold different rows; compare captures of the same data")
    if a.layer_ids != b.layer_ids:
        raise SpeculatorsError(f"{a_dir} taps layers {a.layer_ids}, {b_dir} taps {b.layer_ids}")
    where_b = {rid: i for i, rid in enumerate(ids_b)}
    n_taps = len(a.layer_ids or [])
    taps: list[list[torch.Tensor]] = [[] for _ in range(n_taps)]
    last: list[torch.Tensor] = []
    teacher = {"positions": 0, "top1_equal": 0, "max_logprob_diff": 0.0}
    tokens = 0
    for i, rid in enumerate(ids_a):
        sa, sb = a.sequence(i), b.sequence(where_b[rid])
        if not torch.equal(sa["input_ids"], sb["input_ids"]):
            raise SpeculatorsError(f"row {rid!r} has other token ids in {a_dir} than in {b_dir}")
        tokens += int(sa["input_ids"].numel())
        if n_taps and "taps" in sa and "taps" in sb:
            for j, (ta, tb) in enumerate(zip(sa["taps"].chunk(n_taps, -1), sb["taps"].chunk(n_taps, -1),
                                             strict=True)):
                taps[j].append(_relative(ta, tb))
        if "last_hidden" in sa and "last_hidden" in sb:
            last.append(_relative(sa["last_hidden"], sb["last_hidden"]))
        if "teacher_topk_ids" in sa and "teacher_topk_ids" in sb:
            _teacher(sa, sb, teacher)
    out: dict[str, Any] = {"rows": len(ids_a), "tokens": tokens,
                           "taps": [{"layer": layer, **_error_stats(errs)} for layer, errs in
                                    zip(a.layer_ids or [], taps, strict=True) if errs],
                           "storage_rmse": [{k: v for k, v in s.manifest.get("quality", {}).items()
                                             if k.endswith("relative_rmse")} for s in (a, b)]}
    if last:
        out["last_hidden"] = _error_stats(last)
    if teacher["positions"]:
        out["teacher"] = {"positions": teacher["positions"],
                          "top1_agreement": round(teacher["top1_equal"] / teacher["positions"], 6),
                          "max_logprob_diff": round(teacher["max_logprob_diff"], 6)}
    return out
