"""Measure what a cycle costs on this machine before the first request's depth choices (docs/architecture.md §7).

- `calibrate_verification`: verify forwards of 1, 2, 4, 8, ... and budget + 1 nodes (forward + verification).
- `loaded_costs_hold`: whether cost tables loaded from the cache still match this machine now (two cycles timed).
- `calibrate_drafting`: proposals of every tree kind a request may draft at every depth.

Both feed the engine's `CostModel` (runtime/adaptive.py); nothing here chooses a depth or commits a token.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from speculators.core.config import TreeConfig
from speculators.core.sampling import SamplingParams
from speculators.core.trees import SAMPLED_KINDS, DraftTree
from speculators.runtime.cycle_host import CycleHost
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.requests import NO_LOGIT_ROWS

LOADED_TOLERANCE = 3.0  # cached cycle costs kept while a fresh measurement is within this factor of them


def calibrate_verification(engine: CycleHost, token: int, cache: StaticKVCache) -> None:
    """Time cycles of 1, 2, 4, 8, ... and budget + 1 nodes (`time_cycles`) so the first request's depth choices
    already rest on this machine's costs."""
    top = min(engine.tree.budget + 1, cache.free)
    if top < 2:
        return
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s < top} | {top})
    for size, seconds in time_cycles(engine, token, cache, sizes).items():
        engine.cost.set_cycle(size, seconds)


def time_cycles(engine: CycleHost, token: int, cache: StaticKVCache, sizes: list[int]) -> dict[int, float]:
    """Seconds of a cycle of each node count in `sizes` (best of 3 after a warm-up), in the scratch slots past the
    committed ones of `cache`, each through the cycle's own forward and verification (`engine.accept`) on a greedy
    chain."""
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
    return best


def loaded_costs_hold(engine: CycleHost, token: int, cache: StaticKVCache, drafter: Any = None, state: Any = None,
                      tolerance: float | None = None) -> str | None:
    """Check cost tables loaded from the cache (cost_cache.py) against a short measurement now: a 1-node and the
    largest cycle the tables hold, and (given the request's drafter and its state at `token`) a depth-1 proposal of
    the configured tree kind. None when each is within a factor `tolerance` of the table; else why not (a table saved
    while other work shared the cores rated the house EAGLE-3's drafting at 135 ms against 0.5 ms measured fresh,
    and kept the drafter out). `tolerance`: None = `LOADED_TOLERANCE`."""
    tolerance = tolerance or LOADED_TOLERANCE
    top = max(int(n) for n, _ in engine.cost.points.values())
    measured = [(f"a {size}-node cycle", seconds, engine.cost.cycle(size))
                for size, seconds in time_cycles(engine, token, cache, sorted({1, min(top, cache.free)})).items()]
    kind = engine.tree.kind
    cached_draft = engine.cost.draft.get(kind, {}).get(1)
    if drafter is not None and cached_draft and getattr(state, "last_token", token) == token:
        seconds, _ = time_proposal(drafter, state, token, engine.tree_for(1, kind),
                                   SamplingParams(max_new_tokens=1, temperature=0.0), None)
        measured.append((f"a depth-1 {kind} proposal", seconds, cached_draft))
    for what, seconds, cached in measured:
        if not cached > 0 or not 1 / tolerance <= seconds / cached <= tolerance:
            return f"{what} took {1000 * seconds:.2f} ms, the cached table says {1000 * cached:.2f} ms"
    return None


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
            seconds, nodes = time_proposal(drafter, state, root, engine.tree_for(depth, kind), params, generator)
            if nodes > 0:
                engine.cost.set_draft(depth, nodes, seconds, kind)


def time_proposal(drafter: Any, state: Any, root: int, tree: TreeConfig, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[float, int]:
    """(seconds, draft nodes) of one proposal of `tree` from `root` (best of 3 after a warm-up); proposing writes
    only scratch slots, so `state` is left as it was."""
    times, nodes = [], 0
    for _ in range(4):
        t = time.perf_counter()
        nodes = drafter.propose(state, root, tree, params, generator).size - 1
        times.append(time.perf_counter() - t)
    return min(times[1:]), nodes
