"""The speedup oracle checked against measured speed: `speculators bench`'s own code on the same rows.

`check_against_bench` runs the first `rows_per_cohort` rows of every workload cohort (T = 0) through the runtime
with plain decoding and with the speculator drafting fixed-depth chains (adaptive off, no n-gram graft) —
`bench.run_methods`, the code behind `speculators bench --tree chain --depth K --no-adaptive --ngram-graft 0
--no-hf` — and predicts each row's time from the profile's measured costs:
  plain row       = prefill(P) + expected_seconds(plain cycles, N tokens)
  speculative row = prefill with taps(P) + drafter absorbing L - 1 positions + expected_seconds(depth K, N)
(L = prompt tokens; P = those of the first L - 1 that the engine did not cache from its previous request, as its
prefix cache does; N = the tokens plain decoding generated, which at T = 0 every lossless method generates too).
Each cohort's speedup is predicted twice: with the evaluation's teacher-forced a_k of that cohort (the oracle as
a user runs it) and with the a_k the runtime measured live in this very run (isolating the cost model). Measured
speedups are in the costs' clock (`costs.timed`: CUDA wall clock; on a CPU this process's CPU time, which the other
processes of a shared machine do not inflate), with the wall-clock ratio beside them; both include the prefill,
like `speculators bench`.

Not here: the costs (costs.py), the model (cost_model.py).
"""

from __future__ import annotations

from typing import Any

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.oracle.cost_model import Acceptance, Costs, cost_model, expected_seconds
from speculators.oracle.costs import clock_name
from speculators.runtime.cycle_costs import CostModel
from speculators.runtime.engine import Engine
from speculators.runtime.requests import common_prefix_length
from speculators.serving.bench import Method, bench_rows, run_methods


def _row_seconds(costs: Costs, family: str, prefill: dict, acc: list[float], depth: int, row: dict) -> float:
    """Predicted wall seconds of one request (depth 0 = plain decoding): the prefill of the prompt tokens its
    engine has not cached from the previous request, the drafter absorbing the whole prompt, the cycles."""
    new, body = row["new_prompt_tokens"], row["prompt_tokens"] - 1
    kind = "plain" if depth == 0 else "tapped"
    seconds = CostModel.from_measurements(prefill[kind]).cycle(new) if new else 0.0
    drafter = costs.drafters[family] if depth else None
    if drafter is not None and body:
        seconds += CostModel.from_measurements(drafter.absorb).cycle(body)
    cm = cost_model(costs, 1, drafter, "chain", acc)
    return seconds + expected_seconds(cm, acc, depth, row["tokens"], row["max_new_tokens"])


def _requests(rows: list[tuple[str, list[int], int]], plain_out: list[list[int]]) -> list[dict]:
    """What each bench row asks of an engine: prompt tokens, the part of it not cached from the previous request
    (the bench warms every engine up on the first row), tokens generated, max_new_tokens."""
    out = []
    for i, ((cohort, ids, max_new), gen) in enumerate(zip(rows, plain_out, strict=True)):
        prev = rows[i - 1][1] if i else ids
        out.append({"cohort": cohort, "prompt_tokens": len(ids), "tokens": len(gen), "max_new_tokens": max_new,
                    "new_prompt_tokens": len(ids) - 1 - common_prefix_length(prev[:-1], ids[:-1])})
    return out


def _predicted(costs: Costs, family: str, prefill: dict, requests: list[dict], depth: int,
               acc_of: dict[str, list[float]]) -> dict[str, float]:
    """cohort (and "all") -> predicted speedup of depth-`depth` chains over plain decoding."""
    plain: dict[str, float] = {}
    spec: dict[str, float] = {}
    for row in requests:
        acc = acc_of[row["cohort"]]
        for key in (row["cohort"], "all"):
            plain[key] = plain.get(key, 0.0) + _row_seconds(costs, family, prefill, acc, 0, row)
            spec[key] = spec.get(key, 0.0) + _row_seconds(costs, family, prefill, acc, depth, row)
    return {k: plain[k] / spec[k] for k in plain}


def check_against_bench(loaded: Any, speculator: str, acceptance: Acceptance, costs: Costs, family: str,
                        prefill: dict, depths: list[int], rows_per_cohort: int, workloads: str, seed: int = 0
                        ) -> dict:
    """Predicted vs measured speedup per cohort and chain depth (see the module docstring)."""
    if not depths or any(d < 1 for d in depths):
        raise SpeculatorsError(f"--check-depths must be positive chain depths, got {depths}")
    plain = Method("plain", "runtime", Engine.from_pretrained(loaded, None))
    methods = [plain] + [Method(f"chain{d}", "runtime", Engine.from_pretrained(
        loaded, speculator, ngram_graft=0, tree=TreeConfig(kind="chain", depth=d, topk=1, budget=d, adaptive=False)))
        for d in depths]
    rows = bench_rows(plain.engine, workloads, rows_per_cohort)
    outputs = run_methods(methods, rows, 0.0, seed, loaded.model)
    cuda = str(loaded.device).startswith("cuda")
    cohorts = sorted({c for c, _, _ in rows})
    requests = _requests(rows, outputs[0])
    table = []
    for depth, method, outs in zip(depths, methods[1:], outputs[1:], strict=True):
        mismatched = sum(a != b for a, b in zip(outs, outputs[0], strict=True))
        tf = {c: acceptance.cohorts.get(c, acceptance.chain) for c in cohorts}
        live = {c: method.cells[c].acceptance.per_position_acceptance or [0.0] for c in cohorts}
        pred_tf = _predicted(costs, family, prefill, requests, depth, tf)
        pred_live = _predicted(costs, family, prefill, requests, depth, live)
        for c in [*cohorts, "all"]:
            wall = method.cells[c].tokens_per_second / plain.cells[c].tokens_per_second
            measured = (wall if cuda else
                        method.cells[c].tokens_per_cpu_second / plain.cells[c].tokens_per_cpu_second)
            table.append({"depth": depth, "cohort": c, "rows": method.cells[c].rows,
                          "tokens": method.cells[c].tokens, "live_tau": round(method.cells[c].acceptance.tau, 3),
                          "predicted": round(pred_tf[c], 3), "predicted_live_acceptance": round(pred_live[c], 3),
                          "measured": round(measured, 3), "measured_wall": round(wall, 3),
                          "error": round(pred_tf[c] / measured - 1.0, 4),
                          "error_live_acceptance": round(pred_live[c] / measured - 1.0, 4),
                          "plain_tokens_per_s": round(plain.cells[c].tokens_per_second, 2),
                          "tokens_per_s": round(method.cells[c].tokens_per_second, 2)})
        if mismatched:
            table[-1]["mismatched_rows"] = mismatched
    return {"rows_per_cohort": rows_per_cohort, "workloads": workloads, "depths": depths, "table": table,
            "clock": clock_name(loaded.device),
            "bench_command": (f"speculators bench --target {loaded.cfg.name_or_path} --speculator {speculator} "
                              f"--workloads '{workloads}' --rows-per-cohort {rows_per_cohort} --temperatures 0 "
                              f"--tree chain --depth {{K}} --no-adaptive --ngram-graft 0 --no-hf")}
