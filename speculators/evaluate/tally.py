"""Per-speculator tallies of one teacher-forced evaluation: every sequence's draft logits are scored once and
accumulated per temperature and cohort in the forms the report shows.

- `SpeculatorTally.add(seq, step_logits, teacher_logits, t)`: every position (`alpha.speculator_alpha`), the
  server's cycle starts (`replay.chain_weights` + `replay.replay_chain`; at T > 0 also with argmax drafts) and, at
  T > 0, the draft's calibration: every-position tau when the draft samples from softmax(z / s) for the scales of
  `DRAFT_SCALES` (verification is lossless for any draft law, so a scale != 1 that wins says the trained draft is
  too sharp or too flat: a cause of low T > 0 acceptance that the report names);
- `CeilingTally.add(...)`: at T > 0, the ceilings a top-k teacher and the draft vocabulary put on a sampled draft
  (`alpha.teacher_ceilings`);
- `summary(t)`: the report entry of one temperature.

This module does not run models; it never branches on a speculator family.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators.core.metrics import temperature_key
from speculators.core.sampling import SamplingParams
from speculators.evaluate.alpha import (
    AlphaAccumulator,
    speculator_alpha,
    speculator_alpha_scaled,
    teacher_ceilings,
    truncate,
)
from speculators.evaluate.replay import CycleCounts, chain_weights, replay_chain
from speculators.evaluate.teacher import EvalSequence

DRAFT_SCALES: tuple[float, ...] = (0.8, 0.9, 1.1, 1.25)  # draft logits / s; 1 (as trained) is the main entry


def cycle_summary(per_cohort: dict[str, CycleCounts]) -> dict:
    """Predicted chain acceptance at cycle starts per cohort (+ pooled "overall" and the mean tau over cohorts)."""
    if not per_cohort:
        return {"cohorts": {}, "overall": None, "mean_tau": None}
    overall = CycleCounts(next(iter(per_cohort.values())).depth)
    for c in per_cohort.values():
        overall.merge(c)
    cohorts = {c: v.to_dict() for c, v in sorted(per_cohort.items())}
    return {"cohorts": cohorts, "overall": overall.to_dict(),
            "mean_tau": round(sum(v["tau"] for v in cohorts.values()) / len(cohorts), 4)}


class SpeculatorTally:
    """Teacher-forced scores of one speculator at chain depth `depth`, per temperature and cohort."""

    def __init__(self, depth: int, draft_to_target: torch.Tensor, temperatures: Sequence[float]) -> None:
        self.depth, self.d2t = depth, draft_to_target.cpu()
        keys, sampled = [temperature_key(t) for t in temperatures], [temperature_key(t) for t in temperatures if t > 0]
        self.alpha = {k: AlphaAccumulator(depth) for k in keys}
        self.cycles: dict[str, dict[str, CycleCounts]] = {k: {} for k in keys}
        self.argmax_cycles: dict[str, dict[str, CycleCounts]] = {k: {} for k in sampled}
        self.scaled = {k: {s: AlphaAccumulator(depth) for s in DRAFT_SCALES} for k in sampled}

    def add(self, seq: EvalSequence, step_logits: list[torch.Tensor], teacher_logits: torch.Tensor,
            t: float) -> None:
        params = SamplingParams(temperature=float(t))
        alpha, valid = speculator_alpha(step_logits, teacher_logits, self.d2t, seq.prompt_len, params, self.depth)
        key = temperature_key(t)
        self.alpha[key].add(seq.row.cohort, alpha, valid)
        drafts = [("sampled", self.cycles[key])] + ([("argmax", self.argmax_cycles[key])] if t > 0 else [])
        for draft, store in drafts:
            w = chain_weights(step_logits, teacher_logits, seq.token_ids, seq.prompt_len, self.d2t, params,
                              self.depth, draft=draft)
            counts = replay_chain(w, seq.prompt_len, len(seq.token_ids), seq.row.max_new_tokens, self.depth)
            store.setdefault(seq.row.cohort, CycleCounts(self.depth)).merge(counts)
        scan = self.scaled.get(key, {})
        if scan:
            by_scale = speculator_alpha_scaled(step_logits, teacher_logits, self.d2t, seq.prompt_len, params,
                                               self.depth, list(scan))
            for scale, acc in scan.items():
                acc.add(seq.row.cohort, *by_scale[scale])

    def summary(self, t: str, ceilings: CeilingTally | None = None) -> dict:
        entry = {**self.alpha[t].summary(), "cycle_starts": cycle_summary(self.cycles[t])}
        if t in self.argmax_cycles:
            entry["cycle_starts_argmax_drafts"] = cycle_summary(self.argmax_cycles[t])
        if t in self.scaled:
            entry["draft_scales"] = {str(s): acc.summary()["mean_tau"] for s, acc in self.scaled[t].items()}
        if ceilings is not None and t in ceilings.tallies:
            entry["ceilings"] = ceilings.summary(t, self.depth)
        return entry


class CeilingTally:
    """At T > 0: the per-position ceilings of `alpha.teacher_ceilings` (top-k teacher, draft vocabulary)."""

    def __init__(self, depth: int, topk: int, draft_to_target: torch.Tensor, temperatures: Sequence[float]) -> None:
        self.depth, self.topk, self.d2t = depth, topk, draft_to_target.cpu()
        self.tallies = {temperature_key(t): (AlphaAccumulator(depth), AlphaAccumulator(depth))
                        for t in temperatures if t > 0}

    def add(self, seq: EvalSequence, teacher_logits: torch.Tensor, t: float) -> None:
        if t <= 0:
            return
        top, voc, valid = teacher_ceilings(teacher_logits, seq.prompt_len, SamplingParams(temperature=float(t)),
                                           self.depth, self.topk, self.d2t)
        acc_top, acc_voc = self.tallies[temperature_key(t)]
        acc_top.add(seq.row.cohort, top, valid)
        acc_voc.add(seq.row.cohort, voc, valid)

    def summary(self, t: str, depth: int) -> dict:
        acc_top, acc_voc = self.tallies[t]
        return {f"top{self.topk}_teacher": truncate(acc_top.summary(), depth),
                "draft_vocab": truncate(acc_voc.summary(), depth)}
