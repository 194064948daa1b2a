"""The speedup oracle checked against measured speed: `speculators bench`'s own code on the same rows.

`check_against_bench` runs the first `rows_per_cohort` rows of every workload cohort (T = 0) through the runtime
with plain decoding and with the speculator drafting fixed-depth chains (adaptive off, no n-gram graft) —
`bench.run_methods`, the code behind `speculators bench --tree chain --depth K --no-adaptive --ngram-graft 0
--no-hf` — and predicts each row's time from the profile's measured costs:
  plain row       = prefill(L - 1) + expected_seconds(plain cycles, N tokens)
  speculative row = prefill with taps(L - 1) + drafter absorbing L - 1 positions + expected_seconds(depth K, N)
(L = prompt tokens; N = the tokens plain decoding generated, which at T = 0 every lossless method generates too).
Each cohort's speedup is predicted twice: with the evaluation's teacher-forced a_k of that cohort (the oracle as
a user runs it) and with the a_k the runtime measured live in this very run (isolating the cost model). Bench
times are wall clock including prefill, like `speculators bench`.

Not here: the costs (costs.py), the model (oracle.py).
"""

from __future__ import annotations

from typing import Any

from speculators.config import TreeConfig
from speculators.errors import SpeculatorsError
from speculators.serving.adaptive import CostModel
from speculators.serving.oracle import Acceptance, Costs, cost_model, expected_seconds


def _row_seconds(costs: Costs, family: str, prefill: dict, acc: list[float], depth: int, prompt: int,
                 tokens: int) -> float:
    """Predicted wall seconds of one request (depth 0 = plain decoding)."""
    body = max(prompt - 1, 0)
    if depth == 0:
        cm = cost_model(costs, 1, None, "chain", acc)
        return CostModel.from_measurements(prefill["plain"]).cycle(body) + expected_seconds(cm, acc, 0, tokens)
    drafter = costs.drafters[family]
    cm = cost_model(costs, 1, drafter, "chain", acc)
    absorb = CostModel.from_measurements(drafter.absorb).cycle(body) if body else 0.0
    return (CostModel.from_measurements(prefill["tapped"]).cycle(body) + absorb
            + expected_seconds(cm, acc, depth, tokens))


def _predicted(costs: Costs, family: str, prefill: dict, rows: list[tuple[str, list[int], int]],
               plain_out: list[list[int]], depth: int, acc_of: dict[str, list[float]]) -> dict[str, float]:
    """cohort (and "all") -> predicted speedup of depth-`depth` chains over plain decoding."""
    plain: dict[str, float] = {}
    spec: dict[str, float] = {}
    for (cohort, ids, _), out in zip(rows, plain_out, strict=True):
        acc = acc_of[cohort]
        for key in (cohort, "all"):
            plain[key] = plain.get(key, 0.0) + _row_seconds(costs, family, prefill, acc, 0, len(ids), len(out))
            spec[key] = spec.get(key, 0.0) + _row_seconds(costs, family, prefill, acc, depth, len(ids), len(out))
    return {k: plain[k] / spec[k] for k in plain}


def check_against_bench(loaded: Any, speculator: str, acceptance: Acceptance, costs: Costs, family: str,
                        prefill: dict, depths: list[int], rows_per_cohort: int, workloads: str, seed: int = 0
                        ) -> dict:
    """Predicted vs measured speedup per cohort and chain depth (see the module docstring)."""
    from speculators.serving.bench import Method, bench_rows, run_methods
    from speculators.serving.engine import Engine

    if not depths or any(d < 1 for d in depths):
        raise SpeculatorsError(f"--check-depths must be positive chain depths, got {depths}")
    plain = Method("plain", "runtime", Engine.from_pretrained(loaded, None))
    methods = [plain] + [Method(f"chain{d}", "runtime", Engine.from_pretrained(
        loaded, speculator, ngram_graft=0, tree=TreeConfig(kind="chain", depth=d, topk=1, budget=d, adaptive=False)))
        for d in depths]
    rows = bench_rows(plain.engine, workloads, rows_per_cohort)
    outputs = run_methods(methods, rows, 0.0, seed, loaded.model)
    cohorts = sorted({c for c, _, _ in rows})
    table = []
    for depth, method, outs in zip(depths, methods[1:], outputs[1:], strict=True):
        mismatched = sum(a != b for a, b in zip(outs, outputs[0], strict=True))
        tf = {c: acceptance.cohorts.get(c, acceptance.chain) for c in cohorts}
        live = {c: method.cells[c].acceptance.per_position_acceptance or [0.0] for c in cohorts}
        pred_tf = _predicted(costs, family, prefill, rows, outputs[0], depth, tf)
        pred_live = _predicted(costs, family, prefill, rows, outputs[0], depth, live)
        for c in [*cohorts, "all"]:
            measured = method.cells[c].tokens_per_second / plain.cells[c].tokens_per_second
            table.append({"depth": depth, "cohort": c, "rows": method.cells[c].rows,
                          "tokens": method.cells[c].tokens, "live_tau": round(method.cells[c].acceptance.tau, 3),
                          "predicted": round(pred_tf[c], 3), "predicted_live_acceptance": round(pred_live[c], 3),
                          "measured": round(measured, 3), "error": round(pred_tf[c] / measured - 1.0, 4),
                          "error_live_acceptance": round(pred_live[c] / measured - 1.0, 4),
                          "plain_tokens_per_s": round(plain.cells[c].tokens_per_second, 2),
                          "tokens_per_s": round(method.cells[c].tokens_per_second, 2)})
        if mismatched:
            table[-1]["mismatched_rows"] = mismatched
    return {"rows_per_cohort": rows_per_cohort, "workloads": workloads, "depths": depths, "table": table,
            "bench_command": (f"speculators bench --target {loaded.cfg.name_or_path} --speculator {speculator} "
                              f"--workloads '{workloads}' --rows-per-cohort {rows_per_cohort} --temperatures 0 "
                              f"--tree chain --depth {{K}} --no-adaptive --ngram-graft 0 --no-hf")}
