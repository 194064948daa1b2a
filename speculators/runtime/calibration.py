"""Measure what a cycle costs on this machine before the first request's depth choices (docs/architecture.md §7).

- `calibrate_verification`: verify forwards of 1, 2, 4, 8, ... and budget + 1 nodes (forward + verification).
- `calibrate_drafting`: proposals of every tree kind a request may draft at every depth.

Both feed the engine's `CostModel` (runtime/adaptive.py); nothing here chooses a depth or commits a token.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from speculators.core.sampling import SamplingParams
from speculators.core.trees import SAMPLED_KINDS, DraftTree
from speculators.runtime.cycle_host import CycleHost
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.requests import NO_LOGIT_ROWS


def calibrate_verification(engine: CycleHost, token: int, cache: StaticKVCache) -> None:
    """Time cycles of 1, 2, 4, 8, ... and budget + 1 nodes (best of 3 after a warm-up) in the scratch slots past
    the committed ones of `cache`, each through the cycle's own forward and verification (`engine.accept`) on a
    greedy chain, so the first request's depth choices already rest on this machine's costs."""
    top = min(engine.tree.budget + 1, cache.free)
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s < top} | {top})
    if top < 2:
        return
    params = SamplingParams(max_new_tokens=1)
    best: dict[int, float] = {}
    for rep in range(4):
        for size in sizes:
            chain = DraftTree.chain(int(token), [int(token)] * (size - 1), mode="greedy")
            t = time.perf_counter()
            fwd = engine.runner.forward(cache, chain.tokens, logit_rows=NO_LOGIT_ROWS, capture=engine.speculative)
            engine.accept(chain, fwd, params, None)
            if rep > 0:  # rep 0 warms up
                best[size] = min(best.get(size, float("inf")), time.perf_counter() - t)
    for size, seconds in best.items():
        engine.cost.set_cycle(size, seconds)


def calibrate_drafting(engine: CycleHost, drafter: Any, state: Any, root: int) -> None:
    """Time proposals of every kind a request may draft (`engine.kinds_for` at T = 1) at every depth (best of 3
    after a warm-up) on the request's real drafter state: proposing writes only scratch slots, so the state is left
    as it was; sampled kinds draw from a generator of their own (the request's random stream is untouched)."""
    if getattr(state, "last_token", root) != root:
        return
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    warm = SamplingParams(max_new_tokens=1, temperature=1.0)
    for kind in engine.kinds_for(warm, adaptive=True):
        params = warm if kind in SAMPLED_KINDS else greedy
        generator = torch.Generator(device=engine.device).manual_seed(0) if kind in SAMPLED_KINDS else None
        for depth in range(1, engine.tree.depth + 1):
            times, nodes = [], 0
            for _ in range(4):
                t = time.perf_counter()
                nodes = drafter.propose(state, root, engine.tree_for(depth, kind), params, generator).size - 1
                times.append(time.perf_counter() - t)
            if nodes > 0:
                engine.cost.set_draft(depth, nodes, min(times[1:]), kind)
