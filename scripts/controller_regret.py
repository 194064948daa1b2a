#!/usr/bin/env python
"""The plan controller against its parts on counted work: for each workload (the model drafter's and the prompt
lookup's per-position acceptance, how often the lookup finds a continuation), `--requests` requests of `--cycles`
cycles each run through the controller with the model alone, the lookup alone and both
(tests/unit/runtime/controller_sim.py: SmolLM2's one-thread cycle costs in plain steps, the engine's acceptance
memory across requests), over `--seeds` seeds. Prints per workload the combination's tokens per second over its best
part's (or plain decoding's), mean and worst seed, and the cycles the first request drafted with the model.

usage: python scripts/controller_regret.py [--cycles 40,150] [--seeds 12] [--requests 4]
Not here: wall-clock speed (`speculators bench`), the costs of a real machine (cycle_costs.py, cost_cache.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.runtime.controller_sim import STEP, Workload, simulate  # noqa: E402

WORKLOADS = {
    "decoy model + good lookup": Workload(model=[0.02] * 8, lookup=[0.8, 0.75, 0.7, 0.65, 0.6, 0.6], lookup_share=0.5),
    "decoy model alone": Workload(model=[0.0] * 8),
    "weak model + fair lookup": Workload(model=[0.25, 0.15, 0.1, 0.1], lookup=[0.6, 0.6, 0.55, 0.5, 0.5, 0.5],
                                         lookup_share=0.4),
    "good model + poor lookup": Workload(model=[0.85, 0.75, 0.7, 0.65], lookup=[0.3] * 6, lookup_share=0.3),
    "marginal model alone": Workload(model=[0.2, 0.1, 0.1, 0.1]),
    "both moderate": Workload(model=[0.6, 0.5, 0.4, 0.3], lookup=[0.7, 0.7, 0.6, 0.6, 0.5, 0.5], lookup_share=0.5),
    "copy-heavy": Workload(model=[0.3, 0.2, 0.15, 0.1], lookup=[0.9, 0.9, 0.85, 0.85, 0.8, 0.8], lookup_share=0.8),
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", default="40,150", help="cycles per request, comma-separated")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args(argv)
    print("| workload | cycles / request | combination / best part: mean | worst seed | model cycles, 1st request |")
    print("|---|---:|---:|---:|---:|")
    for name, work in WORKLOADS.items():
        for cycles in (int(c) for c in args.cycles.split(",")):
            ratios, first = [], []
            for seed in range(args.seeds):
                rates = {parts: simulate([work] * args.requests, parts, cycles, seed=seed)
                         for parts in ("model", "lookup", "both")}
                best = max(rates["model"].rate, rates["lookup"].rate, 1 / STEP)
                ratios.append(rates["both"].rate / best)
                first.append(rates["both"].model_cycles_by_request[0])
            print(f"| {name} | {cycles} | {statistics.mean(ratios):.3f} | {min(ratios):.3f} | "
                  f"{statistics.mean(first):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
