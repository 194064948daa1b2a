"""`speculators <stage>`: the command line (typer); the only place that parses arguments and prints results.

Recipe stages take `RECIPE [section.key=value ...]` plus `--force` and `--dry-run`; `run` runs them all in order,
skipping complete ones. Every other command's flags are the fields of its options dataclass (options.py: names,
defaults, help); its body gets the filled object and returns what is printed here. User errors (`SpeculatorsError`)
print one line, `error: ...`, exit status 2, never a traceback. Not here: what a command does, its options.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.table import Table

from speculators.core import options as o
from speculators.core.config import ServeConfig, setting_help
from speculators.core.errors import SpeculatorsError
from speculators.core.logs import configure
from speculators.models import check_family
from speculators.pipeline import STAGES, run_pipeline, run_stage

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train, evaluate, export and serve speculative-decoding speculators.")

LOG_LEVELS = ("debug", "info", "warning", "error")


@app.callback()
def _global_options(log_level: Annotated[str, typer.Option(
        "--log-level", help=f"how much the package logs on stderr: {', '.join(LOG_LEVELS)}")] = "info") -> None:
    if log_level.lower() not in LOG_LEVELS:  # main() prints it as one `error: ...` line, exit 2
        raise SpeculatorsError(f"--log-level: unknown {log_level!r}; choose from {', '.join(LOG_LEVELS)}")
    configure(getattr(logging, log_level.upper()))


RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML, e.g. recipes/house-eagle3.yaml")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="dotted overrides, e.g. train.lr=3e-4")]
ForceOpt = Annotated[bool, typer.Option("--force", help="redo the stage even if its outputs are complete")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the resolved recipe and exit")]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch CPU threads of the stage and the processes it starts "
                                                     "(the recipe's threads:, 0: one a core)")]


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


def _target(name: str) -> str:
    """A command's `--target`: a `package:NAME` or `.gguf` target as its converted local folder (made on first use);
    others unchanged (recipes' targets: `load_recipe`, the same function)."""
    from speculators.core.target_sources import resolve_target_source
    return resolve_target_source(name)


def _load(recipe: Path | None, overrides: list[str] | None, resolve_target: bool = True):
    """The recipe with its overrides; `load_recipe` makes a packaged / GGUF target local unless `resolve_target` is
    off (dry run); its speculator family is one of the registry's. Imported here: recipes.py imports torch (target
    sources)."""
    from speculators.core.recipes import load_recipe
    loaded = load_recipe(recipe, overrides or [], resolve_target=resolve_target)
    check_family(loaded.speculator.family, " (speculator.family)")
    return loaded


def _with_threads(overrides: list[str] | None, threads: int | None) -> list[str]:
    """The overrides with --threads as the recipe's `threads:` (when given)."""
    return [*(overrides or []), *([f"threads={threads}"] if threads is not None else [])]


def _dump(recipe: Any) -> str:
    from speculators.core.recipes import dump_recipe
    return dump_recipe(recipe)


def _print_summary(title: str, summary: dict) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    for key, value in summary.items():
        table.add_row(str(key), value if isinstance(value, str) else json.dumps(value, default=str))
    Console(stderr=False).print(table)


def _stage_command(name: str, help_text: str) -> None:
    @app.command(name=name, help=help_text)
    @_user_errors
    def command(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False,
                dry_run: DryRunOpt = False, threads: ThreadsOpt = None) -> None:
        r = _load(recipe, _with_threads(overrides, threads),
                  resolve_target=not dry_run)
        if dry_run:
            typer.echo(_dump(r), nl=False)
            return
        _print_summary(f"{name}: {r.name}", run_stage(name, r, force=force))


for _name, _help in (
    ("prepare", "Apply the target's chat template: input_ids + assistant-only loss masks."),
    ("regenerate", "Let the target write the assistant turns itself (self-distillation)."),
    ("capture", "Run the target and store hidden-state taps as feature shards; build the draft vocabulary."),
    ("traffic", "Turn recorded served traffic (+ a replay share of earlier rows) into weighted feature shards."),
    ("train", "Train the speculator (1 CPU process up to N GPUs x M nodes, via accelerate)."),
    ("evaluate", "Per-position acceptance on held-out workloads; choose the best checkpoint."),
    ("export", "Write a vLLM-loadable checkpoint with pairing.json and a launch command."),
    ("vllm-check", "Serve the export with the real vLLM: lossless check + its acceptance vs the prediction."),
):
    _stage_command(_name, _help)


@app.command(help="Run every stage of a recipe in order, skipping stages whose outputs are complete.")
@_user_errors
def run(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
        only: Annotated[str | None, typer.Option(help="comma-separated stages to run")] = None,
        threads: ThreadsOpt = None) -> None:
    stages = o.choices(only, "--only", [s.name for s in STAGES]) if only is not None else None
    r = _load(recipe, _with_threads(overrides, threads),
              resolve_target=not dry_run)
    if dry_run:
        typer.echo(_dump(r), nl=False)
        return
    results = run_pipeline(r, only=stages, force=force, log=lambda m: typer.echo(m, err=True))
    _print_summary(f"run: {r.name}", {k: _stage_line(v) for k, v in results.items()})


@app.command(help="Learn from served traffic: train a draft revision on a traffic recipe's recordings, adopt it "
                  "only when it drafts better on the held-back rows, and swap it into a running server (--server).")
@_user_errors
def adapt(recipe: RecipeArg, overrides: OverridesArg = None, force: ForceOpt = False,
          server: Annotated[str | None, typer.Option(help="the server to swap an adopted revision into, e.g. "
                                                            "http://127.0.0.1:8000")] = None,
          margin: Annotated[float, typer.Option(help="tau at cycle starts the new revision must gain to be "
                                                     "adopted")] = 0.0,
          depth: Annotated[int | None, typer.Option(help="chain depth scored (default: evaluate.depth)")] = None,
          api_key_env: Annotated[str | None, typer.Option(help="environment variable holding the server's API "
                                                               "key")] = None, threads: ThreadsOpt = None) -> None:
    from speculators.adapt.adapt_loop import run_adapt_loop
    from speculators.pipeline import use_threads
    r = _load(recipe, _with_threads(overrides, threads))
    use_threads(r)
    _print_summary(f"adapt: {r.name}", run_adapt_loop(r, server=server, margin=margin, depth=depth,
                                                  api_key_env=api_key_env, force=force,
                                                  log=lambda m: typer.echo(m, err=True)))


@app.command(name="adapt-bench", help="A stream of held-out requests of one cohort in windows: prompt lookup, the "
                                      "static revision and the adapting one (the adapt loop between windows) side "
                                      "by side, tau at cycle starts and tokens/s over plain per window.")
@_user_errors
def adapt_bench(recipe: RecipeArg, overrides: OverridesArg = None,
                speculator: Annotated[str, typer.Option(help="the starting draft revision")] = "",
                cohort: Annotated[str, typer.Option(help="the workload cohort streamed")] = "json-tool-call",
                windows: Annotated[int, typer.Option(help="windows of requests")] = 4,
                window_rows: Annotated[int, typer.Option(help="requests per window")] = 8,
                out: Annotated[Path, typer.Option(help="where the recording, runs and report go")] = Path(
                    "runs/adapt-bench"),
                other_rows: Annotated[int, typer.Option(help="rows of every other cohort served by both revisions "
                                                             "after the last window (0: none)")] = 2,
                threads: Annotated[int, typer.Option(help="torch threads (0: torch's default)")] = 0) -> None:
    import torch

    from speculators.adapt.adapt_bench import run_adapt_bench, table
    if threads:
        torch.set_num_threads(threads)
    r = _load(recipe, overrides)
    report = run_adapt_bench(r, speculator=speculator or str(r.train.init_from), cohort=cohort, windows=windows,
                             window_rows=window_rows, out=out, other_rows=other_rows,
                             log=lambda m: typer.echo(m, err=True))
    typer.echo(table(report))


def _stage_line(summary: dict) -> str:
    """One line per stage for the run summary: status, seconds, then its first few scalar figures."""
    status = str(summary.get("status", "done"))
    figures = [f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in summary.items()
               if k not in ("status", "seconds", "output") and isinstance(v, int | float | str)
               and not isinstance(v, bool)]
    return status if status != "done" else " · ".join([status, f"{summary.get('seconds', 0):.0f} s", *figures[:6]])


def _flags(cls: type, settings: bool = False) -> list[inspect.Parameter]:
    """Typer parameters from a dataclass's fields: name, type, default and help (metadata) of each field that is a
    flag. `settings`: every flag defaults to None (unset: the recipe's value) and a bool is --x/--no-x."""
    hints, out = get_type_hints(cls), []
    for f in (f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)):
        kind, flags, text = hints[f.name], [f.metadata["flag"]] if "flag" in f.metadata else [], f.metadata["help"]
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        if settings:
            kind, default, text, name = kind | None, None, setting_help(cls, f.name), f.name.replace("_", "-")
            flags = [f"--{name}/--no-{name}"] if hints[f.name] is bool else flags
        info = typer.Argument(help=text) if f.metadata.get("argument") else typer.Option(*flags, help=text)
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[kind, info]))
    return out


def _command(name: str, cls: type, settings: type | None = None) -> Callable[[Callable], Any]:
    """Register `body(options)` as command `name`: help from `cls`'s docstring, flags from its fields (+ `settings`'
    fields, the ones given collected into `options.settings`); torch's threads set and a `target` resolved first."""
    own = {f.name for f in dataclasses.fields(cls)}

    def register(body: Callable[[Any], None]) -> Callable[[Any], None]:
        def command(**kwargs: Any) -> None:
            given = {k: v for k, v in kwargs.items() if k not in own and v is not None}
            opts = cls(**{k: v for k, v in kwargs.items() if k in own}, **({"settings": given} if settings else {}))
            if isinstance(opts, o.TorchThreads) and opts.threads:
                import torch
                torch.set_num_threads(opts.threads)
            if getattr(opts, "target", None) is not None:
                opts.target = _target(opts.target)
            body(opts)

        command.__signature__ = inspect.Signature(_flags(cls) + (_flags(settings, True) if settings else []))
        app.command(name=name, help=" ".join((cls.__doc__ or "").split()))(_user_errors(command))
        return body

    return register


@_command("generate", o.GenerateOptions)
def generate(opts: o.GenerateOptions) -> None:
    from speculators.serving.commands import generate_command
    for text, to_stderr in generate_command(opts):
        print(text, file=sys.stderr if to_stderr else sys.stdout, flush=True)


@_command("serve", o.ServeOptions, settings=ServeConfig)
def serve(opts: o.ServeOptions) -> None:
    from speculators.serving.commands import serve_command
    serve_command(opts, _load(opts.recipe, opts.overrides) if opts.recipe is not None or opts.overrides else None)


@_command("bench", o.BenchOptions)
def bench(opts: o.BenchOptions) -> None:
    from speculators.serving.bench import bench_command
    typer.echo(bench_command(opts)[1])


@_command("profile", o.ProfileOptions)
def profile(opts: o.ProfileOptions) -> None:
    from speculators.oracle.profile import profile_command
    typer.echo(profile_command(opts)[1])


@_command("train-bench", o.TrainBenchOptions)
def train_bench(opts: o.TrainBenchOptions) -> None:
    from speculators.train.train_bench import train_bench_command
    Console().print(train_bench_command(opts)[1])


@_command("curves", o.CurvesOptions)
def curves(opts: o.CurvesOptions) -> None:
    from speculators.train.curve_compare import curves_command
    typer.echo(curves_command(opts))


@_command("fetch-target", o.FetchTargetOptions)
def fetch_target(opts: o.FetchTargetOptions) -> None:
    from speculators.core.target_sources import is_target_source, resolve_target_source
    if not is_target_source(opts.source):
        raise SpeculatorsError(f"{opts.source!r} is neither package:NAME nor a .gguf file")
    typer.echo(resolve_target_source(opts.source))


@_command("record-vllm", o.RecordVllmOptions)
def record_vllm(opts: o.RecordVllmOptions) -> None:
    from speculators.adapt.vllm_recording import run_record_vllm
    from speculators.core.config import TargetConfig
    from speculators.runtime.recording import RecordingSpec
    if opts.record_budget_gb <= 0 or opts.port <= 0 or opts.max_model_len <= 0 or opts.threads <= 0:
        raise SpeculatorsError("--record-budget-gb, --port, --max-model-len and --threads must be > 0")
    spec = RecordingSpec(opts.record, int(opts.record_budget_gb * 2**30))
    report = run_record_vllm(TargetConfig(name_or_path=opts.target), spec, port=opts.port, host=opts.host,
                             layers=o.ints(opts.layers, "--layers"), dtype=opts.dtype,
                             max_model_len=opts.max_model_len, threads=opts.threads, python=opts.vllm_python,
                             log=lambda m: typer.echo(m, err=True))
    _print_summary(f"record-vllm: {opts.target}", report)


@_command("build-house", o.BuildHouseOptions)
def build_house(opts: o.BuildHouseOptions) -> None:
    from speculators.house.build import build
    build(opts)


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
def worker_train_bench(recipe: RecipeArg, result: Path, overrides: OverridesArg = None) -> None:
    from speculators.train.train_bench import child_main
    raise typer.Exit(child_main(str(recipe), overrides or [], result))


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    configure()
    try:
        app(args=argv, prog_name="speculators")
    except SpeculatorsError as exc:  # raised outside a command (--log-level): one line too, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
