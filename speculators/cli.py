"""`speculators <stage>`: the command line (typer). The only place that parses arguments.

Recipe stages take `RECIPE [section.key=value ...]` (dotted overrides) plus `--force` and `--dry-run`; `run`
runs them all in order and skips complete ones. `generate`, `serve` and `bench` drive the bundled runtime.
User errors (`SpeculatorsError`) print one line, `error: ...`, and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from speculators.config import DEFAULT_NGRAM_GRAFT as DEFAULT_GRAFT
from speculators.errors import SpeculatorsError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train, evaluate, export and serve speculative-decoding speculators.")

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


def _load(recipe: Path, overrides: list[str] | None):
    from speculators.config import load_recipe

    return load_recipe(recipe, overrides or [])


def _print_summary(title: str, summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    for key, value in summary.items():
        table.add_row(str(key), value if isinstance(value, str) else json.dumps(value, default=str))
    Console(stderr=False).print(table)


def _stage_command(name: str, help_text: str) -> None:
    @app.command(name=name, help=help_text)
    @_user_errors
    def command(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False,
                dry_run: DryRunOpt = False) -> None:
        from speculators.config import dump_recipe
        from speculators.pipeline import run_stage

        r = _load(recipe, overrides)
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
):
    _stage_command(_name, _help)


@app.command(help="Run every stage of a recipe in order, skipping stages whose outputs are complete.")
@_user_errors
def run(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        only: Annotated[str | None, typer.Option(help="comma-separated stages to run")] = None) -> None:
    from speculators.config import dump_recipe
    from speculators.pipeline import run_pipeline

    r = _load(recipe, overrides)
    if dry_run:
        typer.echo(dump_recipe(r), nl=False)
        return
    results = run_pipeline(r, only=only.split(",") if only else None, force=force,
                           log=lambda m: typer.echo(m, err=True))
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


@app.command(help="Generate from one prompt (or a workload file) with the bundled runtime and print stats.")
@_user_errors
def generate(
    target: Annotated[str, typer.Option(help="target checkpoint dir or hub id")] = "data/targets/stdlib-lm",
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
    tree: Annotated[str | None, typer.Option(help="dynamic | static | chain | sampled (default: the drafter's own)")] = None,
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
    generate_command(target=target, speculator=speculator, prompt=prompt, chat=chat, workload=workload,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     device=device, dtype=dtype, tree=tree, depth=depth, topk=topk, budget=budget,
                     allow_revision_mismatch=allow_revision_mismatch, as_json=as_json, draft_dtype=draft_dtype,
                     ngram_graft=ngram_graft, batch=batch)


@app.command(help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics).")
@_user_errors
def serve(
    target: Annotated[str, typer.Option()] = "data/targets/stdlib-lm",
    speculator: Annotated[str, typer.Option(help="speculator dir, 'ngram', or 'none'")] = "none",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    api_key_env: Annotated[str | None, typer.Option(help="env var holding the API key (off if unset)")] = None,
    max_prompt_tokens: Annotated[int, typer.Option()] = 2048,
    max_new_tokens: Annotated[int, typer.Option()] = 512,
    max_concurrent_requests: Annotated[int, typer.Option(help="requests running or waiting; more get 429")] = 4,
    max_batch_size: Annotated[int, typer.Option(help="running requests that share each target forward")] = 4,
    device: Annotated[str, typer.Option()] = "auto",
    dtype: Annotated[str, typer.Option()] = "auto",
    allow_revision_mismatch: Annotated[bool, typer.Option()] = False,
    ngram_graft: GraftOpt = DEFAULT_GRAFT,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.serving.commands import serve_command

    _set_threads(threads)
    serve_command(target=target, speculator=speculator, host=host, port=port, api_key_env=api_key_env,
                  max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                  max_concurrent_requests=max_concurrent_requests, device=device, dtype=dtype,
                  allow_revision_mismatch=allow_revision_mismatch, ngram_graft=ngram_graft,
                  max_batch_size=max_batch_size)


@app.command(help="Speculative vs plain decoding vs Hugging Face generate (and assisted decoding), as ratios.")
@_user_errors
def bench(
    target: Annotated[str, typer.Option()] = "data/targets/stdlib-lm",
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
    compare_verify: Annotated[bool, typer.Option(help="at T > 0 also run each speculator at a fixed tree: a sampled "
                                                      "chain verified token-wise vs by block verification, a sampled "
                                                      "tree token-wise vs by traversal verification")] = False,
    threads: ThreadsOpt = 0,
) -> None:
    from speculators.serving.bench import bench_command

    _set_threads(threads)
    bench_command(target=target, speculators=speculator or [], workloads=workloads,
                  rows_per_cohort=rows_per_cohort, temperatures=[float(t) for t in temperatures.split(",")],
                  device=device, dtype=dtype, out=out, seed=seed, ngram_graft=ngram_graft, batch=batch,
                  compare_verify=compare_verify)


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
    from speculators.train.bench import bench_command

    bench_command(target=target, families=[f.strip() for f in families.split(",") if f.strip()], steps=steps,
                  batch_size=batch_size, mode=mode, data=data, out=out, threads=threads)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    try:
        app(args=argv, prog_name="speculators")
    except SpeculatorsError as exc:  # raised outside a command (should not happen, but never a traceback)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
