"""The acceptance a chain of k drafts will get at T=0, predicted per row from the teacher-forced evaluation and
counted the way an engine counts it — the number to hold vLLM's counters and the runtime's live chain against.

For one workload row:
  1. the target's own greedy tokens after the prompt, k past the row's end and through EOS (`teacher.greedy_tokens`),
     because an engine's last verification step still judges all k drafts there;
  2. one teacher-forced pass (`teacher.teacher_pass` + the speculator's `forward_train`) scored by
     `alpha.speculator_alpha`: reach[i] = how many leading drafts from output token i equal the target's tokens;
  3. `metrics.walk_chain(reach, k, total)`: the positions an engine visits (first token from the prefill, then
     accepted + 1 per step) until the row's output ends (max_new_tokens, or the first EOS).

At T > 0 (`predict_sampled_rows`): vLLM drafts the drafter's argmax (its default `draft_sample_method`) and
accepts a draft x with the target's p_T(x) (with "probabilistic" drafting: drafts drawn from the draft law and
accepted with min(1, p/q), `draft="sampled"`). One continuation per row sampled from the target at T, k tokens past
the row's cap, is scored by `replay.chain_weights` (an argmax draft is accepted iff the target's draw equals it, a
sampled one gets its importance weight: unbiased per position) and walked by `replay.replay_chain(as_vllm=True)`
(vLLM's steps: the first from the prefill's token, all k drafts judged, none after the cap): expected counters,
not a count of one sample path. `sequence_chain_cycles` is that score + walk for one sequence, shared with the
evaluation's runtime-chain prediction (`agreement.predict_chain`).

`live_chain_counts` runs the bundled runtime on the same rows with a fixed chain of k (adaptive off, no n-gram
graft, float32 drafts) and converts its counters. `comparison` lays out predicted / live / vLLM side by side;
`sampled_agreement` tests a T > 0 measurement against its prediction (row-paired interval).
This module does not start vLLM (`evaluate.vllm_consumer`) and never branches on a speculator family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speculators.core.config import TreeConfig
from speculators.core.metrics import ChainCounts, walk_chain
from speculators.core.sampling import SamplingParams
from speculators.core.workloads import WorkloadRow
from speculators.evaluate.alpha import speculator_alpha
from speculators.evaluate.drafts import draft_logits
from speculators.evaluate.replay import Z95, CycleCounts, chain_weights, replay_chain
from speculators.evaluate.teacher import EvalSequence, continuations, encode_row, greedy_tokens, teacher_pass
from speculators.models.base import speculator_depth

GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0)


@dataclass
class RowPrediction:
    row: WorkloadRow
    prompt_ids: list[int]
    output_ids: list[int]  # what a lossless engine emits at T=0 (through EOS, at most max_new_tokens)
    counts: ChainCounts


def leading_accepts(alpha: torch.Tensor) -> list[int]:
    """Per position: how many leading depths were accepted (greedy alpha is 0/1).  [N, k] -> N ints"""
    ok = torch.cumprod((alpha > 0.5).long(), dim=1)  # [N, k]
    return ok.sum(1).tolist()


def predict_row(spec: Any, model: Any, tokenizer: Any, row: WorkloadRow, k: int, eos_ids: set[int]) -> RowPrediction:
    prompt = encode_row(tokenizer, row)
    tokens = greedy_tokens(model, prompt, row.max_new_tokens + k)
    eos_at = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    total = row.max_new_tokens if eos_at is None else min(row.max_new_tokens, eos_at + 1)
    req = spec.required_features()
    passed = teacher_pass(model, prompt + tokens, list(req.tap_layer_ids or []))
    steps = draft_logits(spec, prompt + tokens, passed.features(req.tap_layer_ids, req.last_hidden), len(prompt),
                         speculator_depth(k, spec.num_steps))  # k' x [T, Vd]
    alpha, _ = speculator_alpha(steps, passed.logits, spec.draft_to_target.cpu(), len(prompt), GREEDY, k)
    return RowPrediction(row, prompt, tokens[:total], walk_chain(leading_accepts(alpha), k, total))


def predict_rows(spec: Any, model: Any, tokenizer: Any, rows: Sequence[WorkloadRow], k: int,
                 eos_ids: set[int]) -> list[RowPrediction]:
    """Predicted chain-k counters of every row (spec and model in float32 on the CPU give the reference)."""
    spec = spec.float().eval()
    return [predict_row(spec, model, tokenizer, r, k, eos_ids) for r in rows]


def sequence_chain_cycles(spec: Any, target_model: Any, seq: EvalSequence, depth: int, draft: str,
                          max_new_tokens: int, as_vllm: bool = False) -> CycleCounts:
    """Expected cycles of a depth-`depth` chain (`draft` "sampled" or "argmax", `replay.chain_weights`) over one
    prompt + continuation at the sequence's temperature (`spec` in float32, eval mode)."""
    req = spec.required_features()
    tp = teacher_pass(target_model, seq.token_ids, list(req.tap_layer_ids or ()))
    steps = draft_logits(spec, seq.token_ids, tp.features(req.tap_layer_ids, req.last_hidden), seq.prompt_len,
                         depth)  # K x [T, Vd]
    w = chain_weights(steps, tp.logits.cpu(), seq.token_ids, seq.prompt_len, spec.draft_to_target.cpu(),
                      SamplingParams(temperature=seq.temperature), depth, draft)  # [N, K]
    return replay_chain(w, seq.prompt_len, len(seq.token_ids), max_new_tokens, depth, as_vllm)


def as_chain_counts(cycles: CycleCounts, k: int) -> ChainCounts:
    """Expected cycles as vLLM's counters (floats): drafts = cycles that drafted, accepted[j] = cycles whose first
    j+1 drafts were accepted; every draft is counted as k tokens (vLLM pads none)."""
    drafts = cycles.attempts[0] if cycles.attempts else 0.0
    return ChainCounts(k=k, drafts=drafts, draft_tokens=drafts * k,
                       accepted=[float(a) for a in (list(cycles.accepts) + [0.0] * k)[:k]])


def predict_sampled_rows(spec: Any, target: Any, rows: Sequence[WorkloadRow], k: int, temperature: float,
                         seed: int, draft: str = "argmax") -> list[ChainCounts]:
    """vLLM's expected chain-k counters per row at `temperature` > 0 (module docstring); `draft` "sampled" for
    vLLM's probabilistic drafting verified token by token (importance weights, `replay.chain_weights`). `target` is
    the loaded target (`speculators.core.target.LoadedTarget`); `seed` fixes the continuations (`teacher.row_seed`)."""
    spec = spec.float().eval()
    depth = speculator_depth(k, spec.num_steps)
    longer = [dataclasses.replace(r, max_new_tokens=r.max_new_tokens + depth) for r in rows]
    seqs = continuations(target, longer, [temperature], seed, "", None, progress=False)[float(temperature)]  # uncached
    by_id = {s.row.id: s for s in seqs}
    return [as_chain_counts(sequence_chain_cycles(spec, target.model, by_id[r.id], depth, draft, r.max_new_tokens,
                                                  as_vllm=True), k) for r in rows]


def sampled_agreement(predicted: Sequence[ChainCounts], measured: Sequence[ChainCounts],
                      z: float = Z95) -> dict[str, Any]:
    """Whether a measured mean acceptance length at T > 0 agrees with the prediction, row by row paired: both are
    ratios (accepted / drafts pooled over rows) of sampled paths, and a row's acceptance depends on its path (one
    that falls into a repetition accepts far more), so the spread is taken over rows, not over drafts: the
    delta-method variance of the difference of the two ratios with per-row residuals (cluster-robust by row), and
    Student's t for the number of rows."""
    if len(predicted) != len(measured) or len(measured) < 2:
        raise ValueError(f"need the same >= 2 rows on both sides, got {len(predicted)} and {len(measured)}")
    sides = []
    for rows in (predicted, measured):
        drafts = sum(r.drafts for r in rows)
        ratio = sum(sum(r.accepted) for r in rows) / drafts if drafts else 0.0
        sides.append((ratio, [(sum(r.accepted) - ratio * r.drafts) / drafts if drafts else 0.0 for r in rows]))
    (r_pred, e_pred), (r_meas, e_meas) = sides
    n = len(measured)
    var = sum((a - b) ** 2 for a, b in zip(e_meas, e_pred, strict=True)) * n / (n - 1)
    nu = n - 1  # Student's t quantile for n - 1 degrees of freedom (Cornish-Fisher expansion around z)
    t = z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
    half = t * math.sqrt(var)
    return {"predicted": round(1 + r_pred, 4), "measured": round(1 + r_meas, 4), "delta": round(r_meas - r_pred, 4),
            "half_width_95": round(half, 4), "agrees": abs(r_meas - r_pred) <= half, "rows": n}


def live_chain_counts(engine: Any, prompt_ids: list[int], max_new_tokens: int, k: int) -> tuple[list[int], ChainCounts]:
    """The bundled runtime's own chain of k on one prompt (T=0): (output ids, its counters as ChainCounts).
    The runtime prunes drafts past the request's end, so its last step may draft fewer than k tokens."""
    engine.set_tree(TreeConfig(kind="chain", depth=k, topk=1, budget=k, adaptive=False), adaptive=False)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    s = out.stats.acceptance
    counts = ChainCounts(k=k, drafts=int(s.attempts[0]) if s.attempts else 0, draft_tokens=int(s.drafted_tokens),
                         accepted=[int(a) for a in (list(s.accepts) + [0] * k)[:k]])
    return list(out.token_ids), counts


def pooled(counts: Sequence[ChainCounts], k: int) -> ChainCounts:
    total = ChainCounts(k)
    for c in counts:
        total.merge(c)
    return total


def comparison(cohorts: dict[str, dict[str, ChainCounts]]) -> dict[str, dict[str, Any]]:
    """{cohort: {source: ChainCounts}} -> per cohort and overall: each source's per-position rates and mean
    acceptance length, and for every source the largest |delta| per position and the relative delta of the mean
    acceptance length against "predicted"."""
    sources = sorted({s for per in cohorts.values() for s in per})
    k = next(iter(next(iter(cohorts.values())).values())).k
    table = dict(cohorts)
    table["all"] = {s: pooled([per[s] for per in cohorts.values() if s in per], k) for s in sources}
    out: dict[str, dict[str, Any]] = {}
    for cohort, per in table.items():
        entry: dict[str, Any] = {s: c.to_dict() for s, c in per.items()}
        ref = per.get("predicted")
        if ref is not None:
            for s, c in per.items():
                if s == "predicted":
                    continue
                entry[f"{s}_vs_predicted"] = {
                    "max_abs_delta_per_position": round(max((abs(a - b) for a, b in zip(c.reach, ref.reach,
                                                                                        strict=True)), default=0.0), 4),
                    "mean_acceptance_length_rel_delta": round(
                        (c.mean_acceptance_length - ref.mean_acceptance_length) / ref.mean_acceptance_length, 4)
                    if ref.mean_acceptance_length else None}
        out[cohort] = entry
    return out


def comparison_markdown(table: dict[str, dict[str, Any]], title: str = "Predicted vs measured chain acceptance") -> str:
    """The table as Markdown: per cohort and source, vLLM's per-position rate P(first j drafts accepted) and the
    mean acceptance length."""
    k = next(v["k"] for per in table.values() for s, v in per.items() if "_vs_" not in s)
    lines = [f"### {title}", "",
             "Per-position rate = P(the first j drafts are all accepted) (vLLM's `num_accepted_tokens_per_pos` / "
             "`num_drafts`); mean acceptance length = 1 + accepted / drafts.", "",
             "| cohort | source | drafts | " + " | ".join(f"pos {j + 1}" for j in range(k))
             + " | mean acc. length | max abs delta vs predicted | rel. delta mean length |",
             "|---|---|---|" + "---|" * k + "---|---|---|"]
    for cohort, per in table.items():
        for s, v in per.items():
            if "_vs_" in s:
                continue
            d = per.get(f"{s}_vs_predicted") or {}
            rel = d.get("mean_acceptance_length_rel_delta")
            lines.append(f"| {cohort} | {s} | {v['drafts']} | " + " | ".join(f"{r:.3f}" for r in v["reach"])
                         + f" | {v['mean_acceptance_length']:.3f} | "
                         + (f"{d['max_abs_delta_per_position']:.3f}" if d else "–") + " | "
                         + (f"{100 * rel:+.1f}%" if rel is not None else "–") + " |")
    return "\n".join(lines) + "\n"
