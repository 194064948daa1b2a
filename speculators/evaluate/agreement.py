"""One definition, three measurements: the PREDICTED acceptance of a chain / tree (`replay.py`), the LIVE
acceptance of the bundled runtime drafting that same chain / tree on the same rows (`live.py`), side by side per
cohort and position. vLLM's measurement of the exported chain is the `vllm-check` stage (export/vllm_check.py), which
compares it with the same prediction.

What is compared, per temperature (the runtime's `metrics.AcceptanceStats` definition everywhere: a_k = P(depth k
accepted | depths < k accepted) over target calls, tau = committed tokens / target calls):
- "chain": a chain of depth K (`evaluate.serving_chain_depth`, default `export.speculative_tokens`: what vLLM is
  told to run). Greedy at T = 0; at T > 0 the runtime samples the chain from the draft law and verifies it token by
  token with min(1, p/q) (`TreeConfig.verify="token"`, not the runtime's default block verification; the prediction
  is the unbiased importance-weighted estimate of `replay.chain_weights`).
- "tree": the runtime's default tree for this device (EAGLE-2 dynamic top-k), verified greedily at T = 0 and
  "deterministically" at T > 0 (the replay is exact in distribution).
- "ngram": the prompt-lookup baseline's default chain (deterministic drafts: the replay is exact).
Adaptive depth is off in the live runs, so each cycle drafts the depth the prediction assumes.

Agreement: at T = 0 the predicted tau is within `TOLERANCE` (2%) of the live tau; at T > 0 it is inside the 95%
interval of the live tau (normal interval of the mean committed tokens per call; positions: Wilson intervals).
The record names the positions that differ and why (at T = 0 the live output is compared with the evaluated
continuation row by row: a differing row means a near-tie flipped between HF `generate` and the runtime, which
moves every later cycle; equal outputs leave drafting numerics — live drafts in the runtime's precision from its
cached forward, the prediction in float32 from one full-sequence forward).

`predict_chain(...)` is the chain-K prediction for any K and rows.

This module does not train, export or choose checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from speculators.core import metrics
from speculators.core.config import TreeConfig
from speculators.core.sampling import SamplingParams
from speculators.evaluate.chain_prediction import sequence_chain_cycles
from speculators.evaluate.live import LiveRun, load_engine, run_live
from speculators.evaluate.replay import CycleCounts, replay_drafter, tau_interval, wilson
from speculators.evaluate.teacher import EvalSequence, teacher_pass
from speculators.models.base import speculator_depth
from speculators.runtime.drafters.model_free import NgramDrafter

TOLERANCE = 0.02  # T = 0: |predicted tau - live tau| <= 2% of live tau


# ----------------------------------------------------------------------------------------------------------------
# predictions


def by_cohort(per_row: dict[str, CycleCounts], sequences: Sequence[EvalSequence]) -> dict[str, CycleCounts]:
    """Per-row counts merged per cohort, plus "overall" (last)."""
    out: dict[str, CycleCounts] = {}
    for seq in sequences:
        counts = per_row[seq.row.id]
        for key in (seq.row.cohort, "overall"):
            out.setdefault(key, CycleCounts(counts.depth)).merge(counts)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == "overall", kv[0])))


def predict_chain(spec: Any, target_model: Any, sequences: Sequence[EvalSequence], k: int, draft: str = "sampled",
                  progress: bool = False) -> dict[str, CycleCounts]:
    """Predicted acceptance of a depth-k chain (`draft` "sampled" = the runtime's chain at T > 0, "argmax" =
    vLLM-style argmax drafts; both greedy at T = 0) PER ROW (row id -> counts; `by_cohort` merges them) on
    sequences produced by `teacher.continuations` (prompt + the target's continuation at the sequence's
    temperature). `spec` is a loaded speculator (float32, eval mode) and `target_model` the target."""
    depth = speculator_depth(k, spec.num_steps)
    return {seq.row.id: sequence_chain_cycles(spec, target_model, seq, depth, draft, seq.row.max_new_tokens)
            for seq in tqdm(sequences, desc=f"predict chain k={depth}", unit="seq", disable=not progress)}


def predict_drafter(drafter: Any, target_model: Any, sequences: Sequence[EvalSequence], engine: Any,
                    progress: bool = False) -> dict[str, CycleCounts]:
    """Predicted acceptance of a deterministic drafter with `engine`'s fixed tree (`replay.replay_drafter`) PER
    ROW. The drafter gets the teacher pass's features; the tree settings per depth are the engine's own
    (`Engine.tree_for`)."""
    req = drafter.required_features()
    taps = list(req.tap_layer_ids or ())
    depth = int(engine.tree.depth)
    out: dict[str, CycleCounts] = {}
    for seq in tqdm(sequences, desc="predict tree", unit="seq", disable=not progress):
        tp = teacher_pass(target_model, seq.token_ids, taps)
        param = next(drafter.parameters(), None) if hasattr(drafter, "parameters") else None
        feats = {k: v[0] if param is None else v[0].to(device=param.device, dtype=param.dtype)
                 for k, v in tp.features(req.tap_layer_ids, req.last_hidden).items()}
        out[seq.row.id] = replay_drafter(drafter, feats, seq.token_ids, seq.prompt_len, seq.row.max_new_tokens,
                                         engine.tree_for, SamplingParams(temperature=seq.temperature), depth)
    return out


# ----------------------------------------------------------------------------------------------------------------
# comparison


def _live_entry(stats: metrics.AcceptanceStats, depth: int) -> dict:
    lo, hi = tau_interval(stats, depth)
    intervals = [list(map(lambda x: round(x, 4), wilson(stats.accepts[k], stats.attempts[k])))
                 for k in range(min(depth, len(stats.attempts))) if stats.attempts[k] > 0]
    return {"tau": round(stats.tau, 4), "tau_interval": [round(lo, 4), round(hi, 4)],
            "per_position_acceptance": [round(a, 4) for a in stats.per_position_acceptance[:depth]],
            "per_position_interval": intervals, "target_calls": stats.target_calls,
            "committed_tokens": stats.committed_tokens}


def paired_gap_interval(pred_rows: Sequence[CycleCounts], live_rows: Sequence[metrics.AcceptanceStats],
                        resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of the relative tau gap (predicted / live - 1) from a bootstrap over rows, each row keeping its
    predicted and live counts together: rows differ in difficulty and the two sides draw different continuations
    at T > 0, which an interval over cycles (binomial) ignores."""
    n = len(pred_rows)
    if n < 2:
        return None  # one row: no spread to resample
    table = torch.tensor([[p.committed, p.calls, float(s.committed_tokens), float(s.target_calls)]
                          for p, s in zip(pred_rows, live_rows, strict=True)], dtype=torch.float64)  # [n, 4]
    idx = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))  # [B, n]
    sums = table[idx].sum(1)  # [B, 4]
    gap = (sums[:, 0] / sums[:, 1].clamp_min(1e-9)) / (sums[:, 2] / sums[:, 3].clamp_min(1e-9)) - 1.0
    lo, hi = torch.quantile(gap, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (lo, hi)


def compare(pred: CycleCounts, live: metrics.AcceptanceStats, temperature: float, why_greedy: str,
            pairs: tuple[Sequence[CycleCounts], Sequence[metrics.AcceptanceStats]] | None = None) -> dict:
    """Predicted vs live for one cohort (see the module docstring); `pairs`: the cohort's rows, predicted and live,
    for the paired interval of the gap."""
    depth = pred.depth
    lv = _live_entry(live, depth)
    p_pos = pred.per_position()
    differing = []
    for k, a in enumerate(p_pos):
        if k >= len(lv["per_position_acceptance"]):
            break
        b = lv["per_position_acceptance"][k]
        lo, hi = lv["per_position_interval"][k]
        off = abs(a - b) > TOLERANCE if temperature == 0 else not lo <= a <= hi
        if off:
            differing.append(k + 1)
    if temperature == 0:
        agree = abs(pred.tau - live.tau) <= TOLERANCE * max(live.tau, 1e-9)
        why = "" if agree and not differing else why_greedy
    gap = (pred.tau - live.tau) / max(live.tau, 1e-9)
    band = paired_gap_interval(*pairs) if pairs else None
    gap_lo, gap_hi = band if band is not None else (-float("inf"), float("inf"))
    paired = gap_lo <= 0.0 <= gap_hi
    if temperature != 0:
        agree = lv["tau_interval"][0] <= pred.tau <= lv["tau_interval"][1]
        why = "" if agree and not differing else (
            f"the live run draws its own continuations (a different sample than the evaluated one); the paired row "
            f"bootstrap of the gap [{100 * gap_lo:+.1f}%, {100 * gap_hi:+.1f}%] "
            + ("contains 0: rows differ in difficulty more than a binomial interval over cycles allows" if paired
               else "excludes 0 too: a real difference, or 1 chance in 20"))
    return {"predicted": {**pred.to_dict(), "per_position_acceptance": [round(a, 4) for a in p_pos]},
            "live": lv, "agree": bool(agree), "tau_gap": round(gap, 4),
            "tau_gap_interval_paired_rows": [round(gap_lo, 4), round(gap_hi, 4)] if band else None,
            "agree_paired_rows": bool(paired),
            "differing_positions": differing, "why": why}


def _why_greedy(run: LiveRun, sequences: Sequence[EvalSequence]) -> str:
    changed = sum(run.outputs.get(s.row.id) != s.continuation for s in sequences)
    if changed:
        return (f"{changed} of {len(sequences)} live outputs differ from the evaluated continuation (a near-tie "
                f"between HF generate and the runtime's forward), which moves every later cycle of those rows")
    return (f"outputs are identical, so drafting numerics: live drafts with {run.precision or 'its'} weights from the "
            f"runtime's cached forward, the prediction in float32 from one full-sequence forward")


def _block(pred_rows: dict[str, CycleCounts], run: LiveRun, temperature: float, sequences: Sequence[EvalSequence],
           settings: dict) -> dict:
    why = _why_greedy(run, sequences) if temperature == 0 else ""
    members: dict[str, list[str]] = {"overall": []}
    for s in sequences:
        members.setdefault(s.row.cohort, []).append(s.row.id)
        members["overall"].append(s.row.id)
    cohorts = {}
    for c, p in by_cohort(pred_rows, sequences).items():
        if c in run.stats:
            pairs = ([pred_rows[i] for i in members[c]], [run.rows[i] for i in members[c]])
            cohorts[c] = compare(p, run.stats[c], temperature, why, pairs)
    return {**settings, "tree": run.tree, "live_precision": run.precision, "cohorts": cohorts,
            "agree": all(v["agree"] for v in cohorts.values())}


def serving_agreement(target: Any, spec: Any, spec_dir: str, sequences: dict[float, list[EvalSequence]],
                      chain_depth: int, seed: int, allow_revision_mismatch: bool = False,
                      progress: bool = True) -> dict[str, dict]:
    """{str(T): {"chain", "tree", "ngram": comparison blocks, "speculator" / "ngram_live" / "chain_live": the
    live per-cohort stats}} on the rows of `sequences` (the evaluated continuations of the live rows)."""
    rows = [s.row for s in next(iter(sequences.values()))]
    k = speculator_depth(chain_depth, spec.num_steps)
    # token-wise at T > 0, as `predict_chain` assumes (the runtime's default for sampled chains is block verification,
    # which accepts more: a live block chain read ~6-9% above this prediction; block's gain is predicted as "block tau")
    chain_tree = TreeConfig(kind="chain", depth=k, topk=1, budget=k, adaptive=False, verify="token")
    engines = {"chain": load_engine(target, spec_dir, chain_tree, allow_revision_mismatch),
               "tree": load_engine(target, spec_dir, None, allow_revision_mismatch),
               "ngram": load_engine(target, "ngram", None)}
    out: dict[str, dict] = {}
    for t, seqs in sequences.items():
        runs = {name: run_live(e, rows, t, seed, f"live {name} T={t}", progress) for name, e in engines.items()}
        draft = "sampled" if t > 0 else "argmax"
        tree_pred = predict_drafter(spec, target.model, seqs, engines["tree"], progress)  # its configured tree
        preds = {"chain": predict_chain(spec, target.model, seqs, k, draft, progress), "tree": tree_pred,
                 "ngram": predict_drafter(NgramDrafter(), target.model, seqs, engines["ngram"], progress)}
        settings = {"chain": {"k": k, "draft": draft}, "tree": {}, "ngram": {}}
        entry = {name: _block(preds[name], runs[name], t, seqs, settings[name]) for name in preds}
        entry["speculator"] = runs["tree"].to_dict()  # the runtime's default tree, live (earlier reports' field)
        entry["ngram_live"] = runs["ngram"].to_dict()
        entry["chain_live"] = runs["chain"].to_dict()
        out[metrics.temperature_key(t)] = entry
    return out
