"""The steps around one request's draft -> verify -> commit cycles (engine.py runs the loop and calls them).

- `open_request(engine, prompt_ids, params, stats, slot) -> RequestState`: prefill the slot, queue the prompt's
  positions for the drafter, calibrate the cost model on the first adaptive request, set up the plan controller
  (a seeded sampled request gets fixed depths: reproducible).
- `choose_plan(engine, req, remaining)`: find the prompt lookup's continuation of the context (when the engine has a
  lookup source), then ask the controller for this cycle's `Plan`.
- `draft_tree(engine, req, plan, remaining, params, cache)`: the tree of the plan: the root alone, the lookup's chain,
  or the model drafter's tree (after it absorbs what is pending, from a fresh state when positions were skipped)
  with the lookup grafted on; pruned to what the request and the cache can take.
- `commit_cycle`: after verification, the committed positions to the drafter's queue (when the forward captured
  them; else the queue is dropped and the drafter must restart) and to the lookup's context, and the lookup's
  earlier continuation scored against what was committed.
- `observe_cycle` / `close_request`: one cycle's timings to the stats, the controller and the cost model, each
  accepted token credited to the source that proposed it; a finished request's acceptance to the engine's memory.
- `absorb_pending`, `is_chain`: small helpers of the loop.

Each step takes the engine as its first argument, typed by the `cycle_host.CycleHost` protocol (this module is
imported by engine.py, not the other way round).

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
from speculators.core.trees import SAMPLED_MODES, DraftTree, tree_verify_mode, verify_mode
from speculators.runtime.acceptance_memory import AcceptanceMemory
from speculators.runtime.adaptive import LOOKUP, AdaptiveDepth, Plan
from speculators.runtime.calibration import calibrate_drafting, calibrate_verification, loaded_costs_hold
from speculators.runtime.cost_cache import SAVE_EVERY, load_costs, save_costs
from speculators.runtime.cycle_costs import CostModel
from speculators.runtime.cycle_host import CycleHost
from speculators.runtime.drafters.graft import graft_chain
from speculators.runtime.drafters.load import prune_tree
from speculators.runtime.drafters.ngram import TokenBuffer, ngram_continuations
from speculators.runtime.forward.row_products import tune_row_products
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.recording import RequestRecord
from speculators.runtime.requests import DraftWork, GenerationStats, Slot
from speculators.runtime.revisions import revision_name


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
    work: DraftWork  # the request's counted work (stats.work)
    synced: bool = True  # the drafter state holds every committed position before the queue
    lookup: TokenBuffer | None = None  # the committed context ending with the root (None: no lookup source)
    continuation: list[int] | None = None  # this cycle's lookup continuation of the context
    watch: tuple[int, list[int]] | None = None  # (output length, continuation) not yet scored
    # the previous cycle: (plan, start, its parts' predicted seconds, the prediction the controller rated it by)
    last: tuple[Plan, float, float, float] | None = None
    record: RequestRecord | None = None  # the request's training row, while the engine records traffic
    drafter: Any = None  # the draft revision `draft_state` belongs to (the engine may swap in another)
    revision: str = ""  # its name: the cycles it drafts are counted under it (`revisions.DraftRevisions.record`)


def open_request(engine: CycleHost, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats, slot: Slot
                  ) -> RequestState:
    """Prefill the slot, hand the prompt's positions to the drafter, calibrate costs on the first request, and
    set up the plan controller (a seeded sampled request gets fixed depths: reproducible)."""
    t0 = time.perf_counter()
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    drafter = engine.drafter
    state = new_draft_state(engine)
    wants_ids = getattr(drafter, "needs_token_ids", False)
    features, stats.reused_prefix_tokens = slot.prefill(engine.runner, prompt_ids, reuse_prefix=engine.prefix_caching,
                                                        capture=engine.captures)
    # committed positions the drafter has not absorbed yet: absorbed in one batch right before the next
    # proposal, so plain cycles (speculation off) cost what plain decoding costs
    pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
    if len(prompt_ids) > 1 and engine.speculative:
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        pending.append(({**features, "input_ids": ids[:-1]} if wants_ids else features, ids[1:].to(engine.device)))
    if not engine.runner.products.tuned:  # before any cost is measured; plain decoding may run 1 row as 2
        rows = (max(engine.tree.budget, engine.tree.depth, engine.lookup_depth) + engine.graft_nodes + 1
                if engine.speculative else 2)
        engine.runner.products = tune_row_products(engine.runner, slot.cache, prompt_ids[-1], rows,
                                                   engine.runner.product_forms)
    if engine.speculative and engine.adaptive and not engine.cost.calibrated:
        price_cycles(engine, prompt_ids[-1], slot, state, pending)
    stats.prefill_seconds = time.perf_counter() - t0
    seeded = params.seed is not None and not params.greedy
    adaptive = engine.adaptive and not seeded
    kinds, depth = engine.kinds_for(params, adaptive), engine.tree.depth if engine.speculative else 0
    temperature = 0.0 if params.greedy else params.temperature
    lookup_depth, graft = (engine.lookup_depth, engine.graft_nodes) if engine.lookup is not None else (0, 0)
    memory = engine.acceptance_memory
    prior = {kind: memory.estimates(temperature, kind, depth) for kind in kinds}
    prior[LOOKUP] = memory.estimates(temperature, LOOKUP, max(lookup_depth, depth + graft))
    evidence = {kind: memory.evidence(temperature, kind, len(values)) for kind, values in prior.items()}
    for kind in kinds[1:]:  # a kind never drafted starts where the configured one is (for a chain: an upper bound)
        prior[kind] = prior[kind] if any(evidence[kind]) else prior[kinds[0]]
    graftable = tuple(k for k in kinds if tree_verify_mode(k, params, engine.tree.verify) not in SAMPLED_MODES)
    ctrl = AdaptiveDepth(cost=engine.cost, max_depth=depth, max_new_tokens=params.max_new_tokens, enabled=adaptive,
                         prior=prior, prior_evidence=evidence, kinds=kinds, lookup_depth=lookup_depth,
                         graft_nodes=graft, graftable=graftable, prior_share={
                             k: share for k in kinds if (share := memory.share(temperature, k)) is not None},
                         probe_interval=memory.probe_interval(temperature), off_streak=memory.off_streak(temperature))
    if seeded and engine.adaptive and ctrl.mode.startswith("fixed"):
        ctrl.mode += " (seeded sampled request: reproducible)"
    record = engine.recorder.start(prompt_ids, temperature, features.get("taps")) if engine.recorder else None
    return RequestState(generator, state, pending, ctrl, prompt_ids[-1], wants_ids,
                        engine.eos_ids | set(params.stop_token_ids or ()), temperature, stats.work,
                        lookup=TokenBuffer(prompt_ids) if engine.lookup is not None else None, record=record,
                        drafter=drafter, revision=revision_name(engine.info))


def price_cycles(engine: CycleHost, root: int, slot: Slot, state: Any,
                 pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
    """Costs for the first request's plans: those an engine like this one left on this machine (`cost_cache`) while
    two cycles timed now agree with them (`calibration.loaded_costs_hold`), else measured now on the request's slot
    and drafter state (and kept for the next engine)."""
    if pending:  # the drafter absorbs the prompt now (it would before its first proposal anyway)
        absorb_pending(engine.drafter, state, pending)
    if engine.cost_cache and load_costs(engine):
        why = loaded_costs_hold(engine, root, slot.cache, engine.drafter, state)
        if why is None:
            return
        engine.cost = CostModel(origin=f"measured (cached costs dropped: {why})")
    calibrate_verification(engine, root, slot.cache)
    calibrate_drafting(engine, engine.drafter, state, root)
    if engine.cost_cache:
        save_costs(engine)


def choose_plan(engine: CycleHost, req: RequestState, remaining: int) -> Plan:
    """This cycle's plan, after finding the lookup's continuation of the context (scored once committed)."""
    req.continuation = None
    if req.lookup is not None and req.ctrl.lookup_span:
        found = ngram_continuations(req.lookup.view(), req.ctrl.lookup_span, engine.lookup.max_ngram,
                                    engine.lookup.min_ngram, num=1)
        req.continuation = found[0] if found else None
    plan = req.ctrl.choose_plan(remaining, len(req.continuation or ()), model_ready=req.synced or bool(req.pending))
    predicted = req.ctrl.plan_seconds(plan)
    req.last = (plan, time.perf_counter(), predicted, predicted * engine.cost.scale_of(plan.source))
    return plan


def time_last_cycle(engine: CycleHost, req: RequestState, shared: bool) -> None:
    """The previous cycle, start to now (this cycle's start), against what its plan predicted (a forward shared
    with other requests says little about one request's cycle)."""
    if req.last is not None and not shared and req.ctrl.mode == "adaptive":
        plan, start, predicted, rated = req.last
        measured = time.perf_counter() - start
        engine.cost.observe_total(plan.source, predicted, measured)
        req.ctrl.observe_seconds(plan.source, rated, measured)
    req.last = None


def draft_tree(engine: CycleHost, req: RequestState, plan: Plan, remaining: int, params: SamplingParams,
               cache: StaticKVCache) -> tuple[DraftTree, float, int]:
    """This cycle's tree (the root alone for plain decoding), when its proposal started, and how many of its nodes
    (root included) the model drafter proposed (the rest: the lookup's)."""
    mode = verify_mode(params)  # a lookup chain is a deterministic draft
    if plan.depth == 0:
        drafts = (req.continuation or [])[:plan.lookup]
        tree = DraftTree.chain(req.root, drafts, mode) if drafts else DraftTree.root_only(req.root, mode)
        return prune_tree(tree, max_depth=remaining - 1, max_nodes=cache.free), time.perf_counter(), 1
    sync_drafter(engine, req)
    t_propose = time.perf_counter()
    tree = engine.drafter.propose(req.draft_state, req.root, engine.tree_for(plan.depth, plan.kind), params,
                                  req.generator)
    req.work.proposals += 1
    model_nodes = tree.size
    if plan.lookup and req.continuation and tree.mode not in SAMPLED_MODES:
        tree = graft_chain(tree, req.continuation, plan.lookup)
    # drafts past the last token the request can take are never verified (a graft may reach past `depth`)
    return prune_tree(tree, max_depth=remaining - 1, max_nodes=cache.free), t_propose, model_nodes


def new_draft_state(engine: CycleHost) -> Any:
    """A fresh state of the engine's drafter: its own cache also holds its speculative nodes past the committed
    positions."""
    t = engine.tree
    return engine.drafter.new_state(engine.max_len + t.budget + t.depth * t.topk * (t.topk + 1) + 8, engine.device)


def rebind_request(engine: CycleHost, req: RequestState) -> None:
    """The engine swapped in another draft revision: this request's drafter restarts (`sync_drafter`) from the
    positions not yet absorbed, as after skipped positions; until some are queued it drafts nothing (the plan's
    `model_ready`), and verification keeps the output lossless whatever drafts."""
    req.drafter, req.revision = engine.drafter, revision_name(engine.info)
    req.synced = False


def sync_drafter(engine: CycleHost, req: RequestState) -> None:
    """The drafter absorbs the queued positions; when earlier ones were skipped (no features captured while it was
    out), it restarts from a fresh state holding the queued ones alone (its positions are relative: RoPE)."""
    if not req.pending:
        return
    if not req.synced:
        req.draft_state = new_draft_state(engine)
        req.work.restarts += 1
    t0 = time.perf_counter()
    one_cycle = len(req.pending) == 1 and req.synced  # the last cycle's tokens only (not a backlog)
    req.work.absorbed_positions += sum(int(n.shape[0]) for _, n in req.pending)
    absorb_pending(engine.drafter, req.draft_state, req.pending)
    req.synced = True
    if one_cycle:
        engine.cost.observe_absorb(time.perf_counter() - t0)


def commit_cycle(engine: CycleHost, req: RequestState, captured: bool, features: dict[str, torch.Tensor] | None,
                 committed: list[int], out: list[int], start: int) -> None:
    """Queue the committed positions for the drafter (`features` of the root + accepted path, when the forward
    captured them; else drop the queue: the drafter restarts before it next drafts), extend the lookup's context
    with the committed tokens and score the lookup's pending continuation against the output so far (`start`: the
    output's length before this cycle, where this cycle's continuation begins)."""
    if engine.speculative:
        if captured and features is not None:
            req.pending.append((features, torch.tensor(committed, dtype=torch.long, device=engine.device)))
        else:
            req.pending.clear()
            req.synced = False
    if req.lookup is None:
        return
    req.lookup.extend(committed)
    if req.watch is None and req.continuation:
        req.watch = (start, req.continuation)
    if req.watch is not None:
        start, cont = req.watch
        seen = out[start:start + len(cont)]
        matched = next((i for i, (a, b) in enumerate(zip(seen, cont, strict=False)) if a != b), len(seen))
        if matched < len(seen) or len(seen) == len(cont):
            req.ctrl.observe_lookup(len(cont), matched)
            req.watch = None


def observe_cycle(engine: CycleHost, req: RequestState, acc: AcceptanceStats, tree: DraftTree, plan: Plan,
                  accepted: list[int], model_nodes: int, shared: bool,
                  times: tuple[float, float, float, float, float]) -> None:
    """Feed one cycle's timings to the request's stats, its plan controller and the engine's cost model; the
    accepted nodes are credited to the model (its own nodes) and the lookup (the chain or the grafted nodes)."""
    t_draft, t_propose, t_verify, t_accept, t_done = times
    acc.draft_seconds += t_verify - t_draft
    acc.verify_seconds += t_accept - t_verify
    acc.accept_seconds += t_done - t_accept
    req.work.target_forwards += 1
    req.work.target_nodes += tree.size
    by_model = sum(1 for i in accepted if i < model_nodes)
    req.ctrl.accepted_by_source[LOOKUP] += len(accepted) - by_model
    if plan.depth > 0:  # the controller models the drafter's own depths (not a graft); 0: it proposed nothing
        model_depth = int(tree.depths[:model_nodes].max()) if model_nodes > 1 else 0
        req.ctrl.observe(min(model_depth, plan.depth), min(by_model, plan.depth), plan.kind)
        if model_nodes > 1:  # the tables hold drafted cycles; the controller weighs in those that proposed nothing
            engine.cost.observe_draft(plan.depth, model_nodes - 1, t_verify - t_propose, plan.kind)
    if not shared:  # a forward shared with other requests says little about this tree's cost
        key = plan.kind if model_nodes > 1 else (LOOKUP if tree.size > 1 else "")
        engine.cost.observe_cycle(tree.size, t_done - t_verify, key)


def close_request(engine: CycleHost, req: RequestState, stats: GenerationStats) -> None:
    stats.adaptive = req.ctrl.report()
    cycles = sum(req.ctrl.kind_histogram.values())  # the next requests start from this one's acceptance too
    for kind, counts in req.ctrl.counts.items():
        engine.acceptance_memory.add(req.temperature, kind, counts, cycles)
    for kind, (drafted, proposals) in req.ctrl.share_counts.items():
        engine.acceptance_memory.add_share(req.temperature, kind, drafted, proposals)
    engine.acceptance_memory.add(req.temperature, LOOKUP, req.ctrl.lookup_counts,
                                 sum(req.ctrl.source_histogram.values()))
    if req.ctrl.mode == "adaptive":  # a drafter still losing its probes is probed as rarely by the next request
        bucket = AcceptanceMemory.bucket(req.temperature)
        engine.acceptance_memory.probes[bucket] = req.ctrl.next_probe_interval
        engine.acceptance_memory.off_streaks[bucket] = req.ctrl.cycles_without_model
        engine.adaptive_requests += 1
        if engine.cost_cache and engine.adaptive_requests % SAVE_EVERY == 0:  # what observed cycles corrected
            save_costs(engine)
