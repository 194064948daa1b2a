"""What the bundled runtime costs on this device, measured for the speedup oracle (`cost_model.py`).

Every figure is the runtime's own code timed on the current device (`timed`: CUDA wall clock, synchronised before
each reading; on a CPU the process's CPU time, as `export/launch_plan.py` measures, so that other processes sharing the
cores do not inflate it), the minimum over repeats after a warm-up (the least disturbed run), with the sizes
interleaved within a repeat so that drifting load hits every size alike (whole steps: the mean over steps):
- `measure_forward`: ONE target forward (`TargetRunner.forward_batch`, without the output head, as in a cycle) of
  B sequences x n new chain tokens on top of a `context_len`-token KV cache, for a grid of B and n.
- `measure_prefill`: the forward of one prompt of L tokens (with and without the drafter's feature taps).
- `measure_drafter`: a drafter's proposing seconds and draft nodes per depth (chains and its tree kind), and the
  seconds it takes to absorb n committed tokens.
- `measure_steps`: one whole runtime step (`batching.BatchRunner.step`: every request verifies, commits, absorbs
  and drafts, then one shared forward) of B requests at a fixed depth. The oracle's per-cycle overhead is this
  minus the parts above (verification, commits, feature slicing, the loop itself).
Every measurement stops at `deadline` (time.perf_counter() seconds) and says what it skipped; a size that does not
fit in device memory is recorded as skipped, never an error.

Not here: the model that combines them (cost_model.py), building shapes (shapes.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators.core.config import TreeConfig
from speculators.core.sampling import SamplingParams
from speculators.runtime.batching import BatchRunner
from speculators.runtime.drafters.load import depth_tree
from speculators.runtime.forward.row_products import tune_row_products
from speculators.runtime.forward.target_runner import RunnerBase, Segment

_NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class Budget:
    """A wall-clock deadline and the list of what was skipped because of it (or of device memory)."""

    deadline: float
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def seconds(cls, seconds: float) -> Budget:
        return cls(time.perf_counter() + seconds)

    @property
    def over(self) -> bool:
        return time.perf_counter() > self.deadline


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _free(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def clock_name(device: torch.device | str) -> str:
    return "wall clock" if torch.device(device).type == "cuda" else "process CPU time"


def timed(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds of fn(): CUDA: wall clock, synchronised before and after; CPU: this process's CPU time, which other
    processes sharing the cores do not inflate (with one torch thread it is the wall time of an idle machine)."""
    cuda = torch.device(device).type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return clock() - t0


def _interleaved(fns: dict[Any, Callable[[], Any]], device: torch.device | str, repeats: int,
                 budget: Budget) -> dict[Any, float]:
    """min over `repeats` timed rounds (after one warm-up round) of every fn, round-robin; fewer rounds when the
    budget runs out (at least one timed round)."""
    runs: dict[Any, list[float]] = {k: [] for k in fns}
    for r in range(1 + repeats):
        for key, fn in fns.items():
            t = timed(fn, device)
            if r > 0:
                runs[key].append(t)
        if r >= 1 and budget.over:
            break
    return {k: min(v) for k, v in runs.items() if v}


def measure_forward(runner: RunnerBase, batch_sizes: list[int], nodes: list[int], context_len: int,
                    budget: Budget, repeats: int = 5, capture: bool = False) -> dict[int, dict[int, float]]:
    """seconds[B][n] of one target forward over B sequences x n new tokens (see the module docstring)."""
    table: dict[int, dict[int, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        if budget.over:
            budget.skipped.append(f"target forward at batch {b}: time budget")
            continue
        try:
            caches = [runner.new_cache(context_len + max(nodes) + 1) for _ in range(b)]
        except Exception as exc:
            if not _is_oom(exc):
                raise
            budget.skipped.append(f"target forward at batch {b}: its KV caches do not fit")
            _free(runner.device)
            break
        for cache in caches:
            cache.reset(context_len)  # attention over context_len slots costs the same whatever they hold
        if not runner.products.tuned:  # few-row forwards as the runtime runs them (row_products.py)
            runner.products = tune_row_products(runner, caches[0], 0, max(nodes), runner.product_forms)
        fns = {}
        for n in nodes:
            ids = torch.randint(0, runner.vocab_size, (b, n), generator=gen)  # [B, n]
            segs = [Segment(c, ids[i], logit_rows=_NO_ROWS) for i, c in enumerate(caches)]
            fns[n] = (lambda s=segs: runner.forward_batch(s, capture=capture))
        try:
            table[b] = _interleaved(fns, runner.device, repeats, budget)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            fitting = _largest_fitting(fns, runner.device, budget)
            budget.skipped.append(f"target forward at batch {b}: more than {max(fitting, default=0)} tokens per "
                                  f"sequence do not fit")
            if fitting:
                table[b] = _interleaved({n: fns[n] for n in fitting}, runner.device, repeats, budget)
        del caches, fns
        _free(runner.device)
    return table


def _largest_fitting(fns: dict[int, Callable[[], Any]], device: torch.device | str, budget: Budget) -> list[int]:
    """The node counts whose forward runs without running out of memory (smallest first)."""
    ok = []
    for n in sorted(fns):
        try:
            timed(fns[n], device)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            _free(device)
            break
        ok.append(n)
    return ok


def measure_prefill(runner: RunnerBase, lengths: list[int], budget: Budget, repeats: int = 5
                    ) -> dict[str, dict[int, float]]:
    """{"plain": seconds by prompt length, "tapped": the same with the drafter's features captured}."""
    cache = runner.new_cache(max(lengths) + 1)
    gen = torch.Generator().manual_seed(1)
    fns = {}
    for n in lengths:
        ids = torch.randint(0, runner.vocab_size, (n,), generator=gen)
        for capture in (False, True):
            fns[(capture, n)] = (lambda i=ids, c=capture: runner.forward(cache, i, logit_rows=_NO_ROWS, capture=c))
    times = _interleaved(fns, runner.device, repeats, budget)
    return {"plain": {n: t for (c, n), t in times.items() if not c},
            "tapped": {n: t for (c, n), t in times.items() if c}}


def _random_features(runner: RunnerBase, drafter: Any, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Features of n positions shaped as the target hands them to `drafter` (random values)."""
    request = drafter.required_features()
    hidden = int(runner.embed.weight.shape[1])
    out = {}
    if request.tap_layer_ids:
        out["taps"] = torch.randn(n, hidden * len(request.tap_layer_ids), generator=gen)  # [n, taps*H]
    if request.last_hidden:
        out["last_hidden"] = torch.randn(n, hidden, generator=gen)  # [n, H]
    out = {k: v.to(runner.device, runner.dtype) for k, v in out.items()}
    if getattr(drafter, "needs_token_ids", False):
        out["input_ids"] = torch.randint(0, runner.vocab_size, (n,), generator=gen).to(runner.device)
    return out


@dataclass
class DrafterCosts:
    """seconds and draft nodes of proposing per (tree kind, depth); seconds of absorbing n committed tokens."""

    propose: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # kind -> depth -> (s, nodes)
    absorb: dict[int, float] = field(default_factory=dict)  # committed tokens -> seconds
    tree: dict = field(default_factory=dict)  # the tree kind's settings (TreeConfig fields)


def measure_drafter(drafter: Any, runner: RunnerBase, kinds: dict[str, TreeConfig], context_len: int,
                    budget: Budget, repeats: int = 5, absorb_sizes: tuple[int, ...] = (1, 2, 4, 8)
                    ) -> DrafterCosts:
    """Proposing at every depth 1..tree.depth of each tree kind (greedy, on a state that absorbed `context_len`
    random positions) and absorbing 1, 2, 4, 8 tokens (see the module docstring)."""
    gen = torch.Generator().manual_seed(2)
    deepest = max(t.depth for t in kinds.values())
    room = context_len + (2 + repeats) * sum(absorb_sizes) + 16 * deepest * max(t.budget for t in kinds.values())
    state = drafter.new_state(room, runner.device)
    next_tokens = torch.randint(0, runner.vocab_size, (context_len,), generator=gen)  # [context_len]
    drafter.absorb(state, _random_features(runner, drafter, context_len, gen), next_tokens.to(runner.device))
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    costs = DrafterCosts(tree=dataclasses.asdict(kinds.get("tree", next(iter(kinds.values())))))
    root = int(next_tokens[-1])  # proposals continue from the last absorbed token
    nodes: dict[tuple[str, int], int] = {}

    def propose(kind: str, depth: int) -> None:
        tree = drafter.propose(state, root, depth_tree(kinds[kind], depth), greedy, None)
        nodes[(kind, depth)] = tree.size - 1

    fns = {(k, d): (lambda k=k, d=d: propose(k, d)) for k, t in kinds.items() for d in range(1, t.depth + 1)}
    for key, t in _interleaved(fns, runner.device, repeats, budget).items():
        costs.propose.setdefault(key[0], {})[key[1]] = (t, float(nodes[key]))
    feats = {n: (_random_features(runner, drafter, n, gen),
                 torch.randint(0, runner.vocab_size, (n,), generator=gen).to(runner.device)) for n in absorb_sizes}
    absorb_fns = {n: (lambda f=f: drafter.absorb(state, *f)) for n, f in feats.items()}
    costs.absorb = _interleaved(absorb_fns, runner.device, repeats, budget)
    return costs


def measure_steps(engine: Any, batch: int, depth: int, context_len: int, budget: Budget, steps: int = 8
                  ) -> float | None:
    """Mean seconds of one runtime step (see the module docstring) with `batch` requests of random
    `context_len`-token prompts drafting to `depth` (the engine's tree, adaptive off); None if it does not fit."""
    gen = torch.Generator().manual_seed(3)
    runner = BatchRunner(engine, max_batch=batch)
    params = SamplingParams(max_new_tokens=(steps + 4) * (depth + 1) + 2, temperature=0.0)
    for _ in range(batch):
        runner.add(torch.randint(0, engine.runner.vocab_size, (context_len,), generator=gen).tolist(), params,
                   text_deltas=False)
    times = []
    try:
        for i in range(steps + 2):  # step 0 prefills every request; step 1 is the first plain-sized step
            t = timed(runner.step, engine.device)
            if i >= 2:
                times.append(t)
            if budget.over and len(times) >= 2:
                break
    except Exception as exc:
        if not _is_oom(exc):
            raise
        _free(engine.device)
        return None
    finally:
        runner.fail_all(RuntimeError("profiling done"))
    return sum(times) / len(times) if times else None
