"""The steps around one request's draft -> verify -> commit cycles (engine.py runs the loop and calls them).

- `open_request(engine, prompt_ids, params, stats, slot) -> RequestState`: prefill the slot, queue the prompt's
  positions for the drafter, calibrate the cost model on the first adaptive request, set up the depth controller
  (a seeded sampled request gets fixed depths: reproducible).
- `draft_tree(engine, req, kind, depth, remaining, params, cache)`: the drafter absorbs what is pending, then
  proposes this cycle's tree (the root alone at depth 0), pruned to what the request and the cache can take.
- `observe_cycle` / `close_request`: one cycle's timings to the stats, the controller and the cost model; a
  finished request's acceptance to the engine's memory.
- `absorb_pending`, `is_chain`: small helpers of the loop.

Each step takes the `Engine` (runtime/engine.py) as its first argument, typed `Any` (this module is imported by
engine.py, not the other way round).

Not here: the cycle loop, verification and the target forward (engine.py), the depth policy (adaptive.py).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from speculators.core.metrics import AcceptanceStats
from speculators.core.sampling import SamplingParams
from speculators.core.trees import DraftTree
from speculators.runtime.adaptive import AdaptiveDepth
from speculators.runtime.calibration import calibrate_drafting, calibrate_verification
from speculators.runtime.drafters.load import prune_tree
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.requests import GenerationStats, Slot


def is_chain(parents: torch.Tensor) -> bool:
    return parents.tolist() == list(range(-1, parents.shape[0] - 1))


def absorb_pending(drafter: Any, state: Any, pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
    """Hand the drafter every pending committed position at once (consecutive positions concatenate)."""
    if len(pending) == 1:
        features, next_tokens = pending[0]
    else:
        keys = pending[0][0].keys()
        features = {k: torch.cat([f[k] for f, _ in pending]) for k in keys}
        next_tokens = torch.cat([n for _, n in pending])
    drafter.absorb(state, features, next_tokens)
    pending.clear()


@dataclass
class RequestState:
    """What one request's cycle loop carries from one cycle to the next."""

    generator: torch.Generator  # the request's random stream (drafting and verification)
    draft_state: Any  # the drafter's per-request state (its KV cache)
    pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]]  # committed positions the drafter has not absorbed
    ctrl: AdaptiveDepth
    root: int  # the last committed token (not yet in the target's cache)
    wants_ids: bool  # the drafter absorbs token ids with the features
    enders: set[int]  # EOS ids + the request's stop_token_ids
    temperature: float  # 0 = greedy: the key of the engine's acceptance memory


def open_request(engine: Any, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats, slot: Slot
                  ) -> RequestState:
    """Prefill the slot, hand the prompt's positions to the drafter, calibrate costs on the first request, and
    set up the depth controller (a seeded sampled request gets fixed depths: reproducible)."""
    t0 = time.perf_counter()
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    drafter, t = engine.drafter, engine.tree
    # the drafter's own cache also holds its speculative nodes past the committed positions
    state = drafter.new_state(engine.max_len + t.budget + t.depth * t.topk * (t.topk + 1) + 8, engine.device)
    wants_ids = getattr(drafter, "needs_token_ids", False)
    features, stats.reused_prefix_tokens = slot.prefill(engine.runner, prompt_ids, reuse_prefix=engine.prefix_caching,
                                                        capture=engine.speculative)
    # committed positions the drafter has not absorbed yet: absorbed in one batch right before the next
    # proposal, so plain cycles (speculation off) cost what plain decoding costs
    pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
    if len(prompt_ids) > 1 and engine.speculative:
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        pending.append(({**features, "input_ids": ids[:-1]} if wants_ids else features, ids[1:].to(engine.device)))
    if engine.speculative and engine.adaptive and not engine.cost.calibrated:
        calibrate_verification(engine, prompt_ids[-1], slot.cache)
        if pending:  # the drafter absorbs the prompt now (it would before its first proposal anyway)
            absorb_pending(drafter, state, pending)
        calibrate_drafting(engine, drafter, state, prompt_ids[-1])
    stats.prefill_seconds = time.perf_counter() - t0
    seeded = params.seed is not None and not params.greedy
    adaptive = engine.adaptive and not seeded
    kinds, depth = engine.kinds_for(params, adaptive), engine.tree.depth if engine.speculative else 0
    temperature = 0.0 if params.greedy else params.temperature
    prior = {kind: engine.acceptance_memory.estimates(temperature, kind, depth) for kind in kinds}
    ctrl = AdaptiveDepth(cost=engine.cost, max_depth=depth, max_new_tokens=params.max_new_tokens, enabled=adaptive,
                         prior=prior, kinds=kinds)
    if seeded and engine.adaptive and ctrl.mode.startswith("fixed"):
        ctrl.mode += " (seeded sampled request: reproducible)"
    return RequestState(generator, state, pending, ctrl, prompt_ids[-1], wants_ids,
                         engine.eos_ids | set(params.stop_token_ids or ()), temperature)


def draft_tree(engine: Any, req: RequestState, kind: str, depth: int, remaining: int, params: SamplingParams,
           cache: StaticKVCache) -> tuple[DraftTree, float]:
    """This cycle's tree (the root alone at depth 0: plain decoding) and when its proposal started."""
    if depth == 0:
        return DraftTree.root_only(req.root, "greedy" if params.greedy else "deterministic"), time.perf_counter()
    if req.pending:
        t = time.perf_counter()
        one_cycle = len(req.pending) == 1  # the last cycle's tokens only (not a plain streak's backlog)
        absorb_pending(engine.drafter, req.draft_state, req.pending)
        if one_cycle:
            engine.cost.observe_absorb(time.perf_counter() - t)
    t_propose = time.perf_counter()
    tree = engine.drafter.propose(req.draft_state, req.root, engine.tree_for(depth, kind), params, req.generator)
    # drafts past the last token the request can take are never verified (a graft may reach past `depth`)
    return prune_tree(tree, max_depth=remaining - 1, max_nodes=cache.free), t_propose


def observe_cycle(engine: Any, req: RequestState, acc: AcceptanceStats, tree: DraftTree, plan: tuple[str, int],
             accepted: int, shared: bool, times: tuple[float, float, float, float, float]) -> None:
    """Feed one cycle's timings to the request's stats, its depth controller and the engine's cost model."""
    (kind, depth), (t_draft, t_propose, t_verify, t_accept, t_done) = plan, times
    acc.draft_seconds += t_verify - t_draft
    acc.verify_seconds += t_accept - t_verify
    acc.accept_seconds += t_done - t_accept
    if tree.max_depth > 0:  # the controller models the drafter's own depths (not a graft beyond them)
        req.ctrl.observe(min(tree.max_depth, depth), min(accepted, depth), kind)
        engine.cost.observe_draft(depth, tree.size - 1, t_verify - t_propose, kind)
    if not shared:  # a forward shared with other requests says little about this tree's cost
        engine.cost.observe_cycle(tree.size, t_done - t_verify, kind if tree.max_depth > 0 else "")


def close_request(engine: Any, req: RequestState, stats: GenerationStats) -> None:
    stats.adaptive = req.ctrl.report()
    cycles = sum(req.ctrl.kind_histogram.values())  # the next requests start from this one's acceptance too
    for kind, counts in req.ctrl.counts.items():
        engine.acceptance_memory.add(req.temperature, kind, counts, cycles)
