"""`speculators profile`: the speedup oracle — what speculation buys on this device, for this model shape.

1. The target: a real checkpoint (`target`, e.g. the house target) or a named shape built from config with random
   weights (`shape`: data/shapes/*.json, e.g. llama-3.1-8b, qwen3-8b; shapes.py), in the requested dtype.
2. The drafters: a real speculator directory (`speculator`, pairing checked), else each family's head of that shape
   with random weights (EAGLE-3, Medusa, MTP; shapes.random_drafter).
3. Costs on the current device (costs.py), inside a time budget split between the phases: the target forward over
   B x n tokens (batch sizes x verified tree/chain tokens), each drafter's proposing per depth (chains and its tree
   kind) and absorbing, and whole runtime steps, from which the per-cycle overhead follows.
4. With a per-position acceptance (`acceptance`: an evaluation report, an export dir, an eval dir or a list), the
   oracle (cost_model.py) predicts tokens/s and speedup per batch size for every chain depth and tree depth, picks the
   best per batch size, and derives the vLLM batch-size schedule (`export/launch_plan.py`'s format; a family
   with a fixed vLLM k, DFlash or Medusa, gets that k or plain).
5. With `check_rows` (real target + real speculator only), the same rows run through `speculators bench`'s own
   code (plain decoding and fixed-depth chains, adaptive off) and the predicted speedup is printed next to the
   measured one (check.py).
Writes `profile.json` and `profile.md` to `out` (atomically) and returns the Markdown (cli.py prints it).

Not here: option parsing and printing (cli.py), the model (cost_model.py), the timing (costs.py), the formatting
(profile_report.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from speculators.core.config import TargetConfig, TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.machine import device_name
from speculators.core.options import DTYPES, ProfileOptions, choices, ints
from speculators.core.target import load_target, resolve_device, resolve_dtype, text_config
from speculators.models import FAMILIES
from speculators.models.base import vllm_fixed_k
from speculators.oracle import costs as measure
from speculators.oracle.check import check_against_bench
from speculators.oracle.cost_model import Acceptance, Costs, load_acceptance, predict, predicted_schedule
from speculators.oracle.profile_report import build_report, write_report
from speculators.oracle.shapes import DEFAULT_DRAFT_VOCAB, random_drafter, random_target, shape_model_config
from speculators.oracle.slicing import (
    base_layers,
    drafter_bytes,
    keep_layers,
    model_bytes,
    plan_slice,
    scale_table,
    slice_taps,
)
from speculators.runtime.cycle_costs import CostModel
from speculators.runtime.drafters.load import default_tree, draft_dtype_on, load_drafter
from speculators.runtime.drafters.model_free import NoDrafter
from speculators.runtime.engine import Engine
from speculators.runtime.forward.module_runner import make_runner

PROFILE_FORMAT = "speculators.profile/v1"
GRIDS = {  # (batch sizes, verified tokens per sequence) by device type
    "cpu": ([1, 2, 4], [1, 2, 3, 4, 5, 6, 8, 11, 16]),
    "cuda": ([1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128]),
}
# shares of the time budget: target forward grid, prefill, drafters, whole steps (the check runs outside it)
PHASES = {"forward": 0.45, "prefill": 0.05, "drafters": 0.2, "steps": 0.3}
PREFILL_LENGTHS = (16, 64, 256)
STEP_COUNT = 6


def _check_args(target: str | None, shape: str | None, batch_sizes: list[int], nodes: list[int],
                context_len: int, budget_s: float, max_depth: int, check_rows: int, speculator: str | None,
                acceptance: str | None) -> None:
    if (target is None) == (shape is None):
        raise SpeculatorsError("give exactly one of --target (a checkpoint) or --shape (a named shape with random "
                               "weights, e.g. llama-3.1-8b)")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise SpeculatorsError(f"--batch-sizes must be positive integers, got {batch_sizes}")
    if not nodes or any(n < 1 for n in nodes) or 1 not in nodes:
        raise SpeculatorsError(f"--nodes must be positive integers including 1 (plain decoding), got {nodes}")
    if context_len < 1 or budget_s <= 0 or max_depth < 1:
        raise SpeculatorsError(f"--context-len ({context_len}), --budget-s ({budget_s}) and --max-depth "
                               f"({max_depth}) must be positive")
    if check_rows < 0:
        raise SpeculatorsError(f"--check-rows must be >= 0, got {check_rows}")
    if check_rows and (target is None or speculator is None or acceptance is None):
        raise SpeculatorsError("--check-rows compares with measured generation: it needs --target (a real "
                               "checkpoint), --speculator and --acceptance")


def _load_target(target: str | None, shape: str | None, device: str, dtype: str, layers: int | None) -> Any:
    if target is not None:
        return load_target(TargetConfig(name_or_path=target, device=device, dtype=dtype))
    dev = resolve_device(device)
    return random_target(str(shape), dev, resolve_dtype(dtype, dev), layers=layers)


def _slice_plan(shape: str | None, device: str, dtype: str, families: list[str], mode: str, depth: int,
                speculator: str | None, draft_dtype: str = "auto") -> dict | None:
    """{"layers": L, "num_layers": N, "parameters": P} when the shape is profiled through a slice of L layers."""
    if mode not in ("auto", "always", "never"):
        raise SpeculatorsError(f"--slice must be auto, always or never, got {mode!r}")
    if shape is None:
        return None
    _, config = shape_model_config(shape)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    heads = 0 if speculator else drafter_bytes(config, families, depth, DEFAULT_DRAFT_VOCAB,
                                               draft_dtype_on(str(dev), dt, draft_dtype))
    layers = plan_slice(config, dt, str(dev), families, mode, heads)
    if layers is None:
        return None
    size = torch.empty((), dtype=dt).element_size()
    n = int(text_config(config).num_hidden_layers)
    return {"layers": layers, "base_layers": base_layers(families, n), "num_layers": n,
            "parameters": model_bytes(config, dt) // size}


def _scaled_by_layers(loaded: Any, drafter: Any, plan: dict, costs: Costs, extras: dict, batch_sizes: list[int],
                      nodes: list[int], context_len: int, budget_s: float) -> None:
    """The slice cut to its first `base_layers`, its forward and prefill timed again on those, and both tables
    extrapolated to the shape's layer count (slicing.py)."""
    big, small_layers, n = plan["layers"], plan["base_layers"], plan["num_layers"]
    keep_layers(loaded.model, small_layers)
    budget = measure.Budget(time.perf_counter() + PHASES["forward"] * budget_s, extras["skipped"])
    small = measure.measure_forward(make_runner(loaded.model), sorted(set(batch_sizes)), sorted(set(nodes)),
                                    context_len, budget)
    budget = measure.Budget(time.perf_counter() + PHASES["prefill"] * budget_s, extras["skipped"])
    small_prefill = measure.measure_prefill(make_runner(loaded.model, drafter.required_features()),
                                            list(PREFILL_LENGTHS), budget)
    costs.forward = scale_table(costs.forward, small, big, small_layers, n)
    extras["prefill"] = scale_table(extras["prefill"], small_prefill, big, small_layers, n)
    extras["slice"] = {**plan, "layers_timed": [small_layers, big],
                       "rule": f"f({n}) = f({big}) + {n - big} x (f({big}) - f({small_layers})) / {big - small_layers}"}


def _drafters(loaded: Any, speculator: str | None, families: list[str], max_depth: int, draft_dtype: str,
              plan: dict | None = None) -> dict[str, tuple[Any, str]]:
    """family -> (drafter, how it computes): the given speculator, else a random head of each family (on a slice,
    tapping its first layers)."""
    if speculator is not None:
        drafter, info = load_drafter(speculator, loaded, draft_dtype=draft_dtype)
        return {info.family: (drafter, info.precision)}

    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise SpeculatorsError(f"--families must name some of {', '.join(FAMILIES)}, got {families}")
    return {f: random_drafter(loaded, f, max_depth, draft_dtype=draft_dtype,
                              layer_ids=slice_taps(f, plan["num_layers"], plan["layers"]) if plan else None)
            for f in families}


def _tree_kinds(drafter: Any, device: str, max_depth: int) -> dict[str, TreeConfig]:
    """The chain and the drafter's own tree kind (the runtime's default on this device), fixed depth."""
    tree = default_tree(drafter, device)
    kinds = {"chain": TreeConfig(kind="chain", depth=max_depth, topk=1, budget=max_depth, adaptive=False)}
    if tree.kind != "chain":
        kinds["tree"] = TreeConfig(kind=tree.kind, depth=min(tree.depth, max_depth), topk=tree.topk,
                                   budget=tree.budget, choices=tree.choices, adaptive=False)
    return kinds


def _phase(start: float, budget_s: float, name: str, skipped: list[str]) -> measure.Budget:
    """The budget of one phase: its share of the total after the phases before it."""
    end, share = start, 0.0
    for phase, frac in PHASES.items():
        share += frac
        if phase == name:
            end = start + share * budget_s
            break
    return measure.Budget(end, skipped)


def _steps(loaded: Any, drafter: Any, family_costs: measure.DrafterCosts, kinds: dict[str, TreeConfig],
           forward: dict[int, dict[int, float]], context_len: int, budget: measure.Budget, costs: Costs) -> None:
    """Whole runtime steps (plain, and each kind at depth 1 and at its deepest) -> the per-step overhead."""
    deepest = max(t.depth for t in kinds.values())
    max_len = context_len + (STEP_COUNT + 4) * (deepest + 1) + 8
    configs: list[tuple[str, int]] = [("plain", 0)] + [(k, d) for k, t in kinds.items() for d in sorted({1, t.depth})]
    absorb1 = family_costs.absorb.get(1, 0.0)
    for b in sorted(forward):
        fwd = CostModel.from_measurements(forward[b])
        for kind, depth in configs:
            if budget.over:
                budget.skipped.append(f"runtime step at batch {b}, {kind} depth {depth}: time budget")
                continue
            tree = kinds.get(kind, kinds["chain"])
            engine = (Engine(loaded, NoDrafter(), max_len=max_len) if kind == "plain" else
                      Engine(loaded, drafter, tree=measure.depth_tree(tree, depth), max_len=max_len, adaptive=False))
            step = measure.measure_steps(engine, b, depth, context_len, budget, STEP_COUNT)
            del engine
            if step is None:
                budget.skipped.append(f"runtime step at batch {b}, {kind} depth {depth}: does not fit")
                continue
            if kind == "plain":
                costs.overhead_plain[b] = max(0.0, step - fwd.cycle(1))
                continue
            seconds, nodes = family_costs.propose[kind][depth]
            costs.overhead_spec.setdefault(b, {})[1 + round(nodes)] = max(
                0.0, step - fwd.cycle(1 + nodes) - b * (seconds + absorb1))


def measure_costs(loaded: Any, drafters: dict[str, tuple[Any, str]], primary: str, batch_sizes: list[int],
                  nodes: list[int], context_len: int, budget_s: float, max_depth: int) -> tuple[Costs, dict]:
    """Every measurement of the profile inside the time budget; (costs, extras: prefill, trees, skipped)."""
    start, skipped = time.perf_counter(), []
    runner = make_runner(loaded.model)
    forward = measure.measure_forward(runner, sorted(set(batch_sizes)), sorted(set(nodes)), context_len,
                                      _phase(start, budget_s, "forward", skipped))
    if 1 not in forward:
        raise SpeculatorsError(f"not even one sequence of {max(nodes)} tokens fits on {loaded.device}; lower "
                               f"--nodes / --context-len")
    costs = Costs(forward=forward)
    tapped = make_runner(loaded.model, drafters[primary][0].required_features())
    prefill = measure.measure_prefill(tapped, list(PREFILL_LENGTHS), _phase(start, budget_s, "prefill", skipped))
    trees = {}
    for family, (drafter, _) in drafters.items():
        kinds = _tree_kinds(drafter, str(loaded.device), max_depth)
        trees[family] = kinds
        costs.drafters[family] = measure.measure_drafter(
            drafter, tapped, kinds, context_len, _phase(start, budget_s, "drafters", skipped),
            absorb_sizes=(1, 2, 4, 8, *PREFILL_LENGTHS))
    _steps(loaded, drafters[primary][0], costs.drafters[primary], trees[primary], forward, context_len,
           _phase(start, budget_s, "steps", skipped), costs)
    return costs, {"prefill": prefill, "trees": trees, "skipped": skipped,
                   "seconds": round(time.perf_counter() - start, 1)}


def family_schedule(prediction: list[dict], drafter: Any) -> list[dict]:
    """The vLLM batch-size schedule of one family's prediction: the fastest chain k per bucket, except for a family
    whose vLLM proposer drafts a fixed k (`VLLM_FIXED_K`: DFlash's block, Medusa's heads), which gets its own k or
    plain (k = 0) per bucket, as `export/vllm.plan_launch` writes it."""
    k = vllm_fixed_k(drafter)
    fixed = None if k is None else [k]
    return predicted_schedule(prediction, fixed)


def profile_command(opts: ProfileOptions) -> tuple[dict, str]:
    """Run the profile `opts` describes (see the module docstring); (its report, the Markdown)."""
    if opts.dtype not in DTYPES:
        raise SpeculatorsError(f"--dtype must be auto, float32, bfloat16 or float16, got {opts.dtype!r}")
    families = choices(opts.families, "--families", FAMILIES) if opts.families else []
    target, shape, speculator, acceptance = opts.target, opts.shape, opts.speculator, opts.acceptance
    device, context_len, budget_s, check_rows = opts.device, opts.context_len, opts.budget_s, opts.check_rows
    dev_type = "cuda" if (device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())) else "cpu"
    grid_b, grid_n = GRIDS[dev_type]
    batch_sizes = ints(opts.batch_sizes, "--batch-sizes") or grid_b
    nodes = ints(opts.nodes, "--nodes") or grid_n
    check_depths = ints(opts.check_depths, "--check-depths") or []
    _check_args(target, shape, batch_sizes, nodes, context_len, budget_s, opts.max_depth, check_rows, speculator,
                acceptance)
    acc: Acceptance | None = load_acceptance(acceptance, opts.temperature) if acceptance else None
    depth = max(opts.max_depth, len(acc.chain)) if acc else opts.max_depth
    wanted = families or ([acc.family] if acc and acc.family in FAMILIES else list(FAMILIES))
    plan = _slice_plan(shape, device, opts.dtype, wanted, opts.slice, depth, speculator,  # before any allocation
                       opts.draft_dtype)
    loaded = _load_target(target, shape, device, opts.dtype, plan["layers"] if plan else None)
    drafters = _drafters(loaded, speculator, wanted, depth, opts.draft_dtype, plan)
    primary = acc.family if acc is not None and acc.family in drafters else next(iter(drafters))
    costs, extras = measure_costs(loaded, drafters, primary, batch_sizes, nodes, context_len, budget_s, depth)
    if plan is not None:
        _scaled_by_layers(loaded, drafters[primary][0], plan, costs, extras, batch_sizes, nodes, context_len,
                          budget_s)
    predictions = {}
    if acc is not None:
        fams = [acc.family] if acc.family in drafters else list(drafters)
        predictions = {f: predict(costs, acc, f) for f in fams}
    check = None
    if check_rows:
        check = check_against_bench(loaded, str(speculator), acc, costs, primary, extras["prefill"],
                                    check_depths, check_rows, opts.workloads)
    report = build_report(
        loaded=loaded, name=target or f"shape:{shape}", device=device_name(str(loaded.device)),
        context_len=context_len, drafters=drafters, costs=costs, extras=extras, acceptance=acc,
        predictions=predictions, schedules={f: family_schedule(p, drafters[f][0]) for f, p in predictions.items()},
        check=check,
        budget_s=budget_s)
    report["format"] = PROFILE_FORMAT
    return report, write_report(report, opts.out)
