"""Recipes: YAML files that map 1:1 onto the dataclasses below, plus dotted command-line overrides.

`load_recipe(path, overrides)` reads a YAML recipe, applies overrides such as `train.lr=3e-4`, and returns a typed
`Recipe`. Unknown or mistyped keys are errors naming the key and the closest valid one. Every stage reads only
its own section plus `target`; `Recipe.paths` says where each stage's output lives under `run_dir`.

This module does not run stages and does not import torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from speculators.errors import SpeculatorsError

# ----------------------------------------------------------------------------------------------------------------
# sections


@dataclass
class TargetConfig:
    """The model the speculator drafts for."""

    name_or_path: str = "data/targets/stdlib-lm"
    revision: str | None = None  # hub branch/tag/commit; resolved to a commit (or content hash) and pinned
    adapter: str | None = None  # PEFT (LoRA) adapter id or path applied on top of the target
    adapter_revision: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    chat_template: str | None = None  # path to a .jinja file or a literal template; None = the tokenizer's
    trust_remote_code: bool = False


@dataclass
class DataSource:
    """One conversation source: a hub dataset id or a local jsonl/json/parquet/arrow path."""

    path: str = ""
    split: str = "train"
    schema: Literal["auto", "messages", "sharegpt", "prompt_completion"] = "auto"
    max_rows: int | None = None


@dataclass
class RegenerateConfig:
    """Self-distillation: the target rewrites the assistant turns (DESIGN §1)."""

    enabled: bool = False
    backend: Literal["local", "openai"] = "local"  # in-process generate, or an OpenAI-compatible endpoint
    endpoint: str | None = None  # e.g. http://127.0.0.1:8000/v1 (vLLM / SGLang server)
    model: str | None = None  # model name to send to the endpoint (default: target name)
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int = 8
    concurrency: int = 8
    max_retries: int = 3  # openai backend: attempts per request beyond the first (timeouts, 429, 5xx)
    request_timeout: float = 300.0  # openai backend: seconds per request
    max_failed_fraction: float = 0.01  # more rows failed than this (after retries): the stage fails, nothing written


@dataclass
class DataConfig:
    sources: list[DataSource] = field(default_factory=list)
    max_length: int = 1024
    length_policy: Literal["drop", "truncate"] = "truncate"
    on_bad_row: Literal["fail", "skip"] = "fail"
    val_fraction: float = 0.05
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} (Qwen3)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class CaptureConfig:
    """What `capture` stores per token (DESIGN §1, issue 3 storage goals)."""

    mode: Literal["offline", "online"] = "offline"  # online: taps computed inside the training step, no disk
    layer_ids: list[int] | None = None  # EAGLE-3 taps: residual stream ENTERING these layers; None = [2, N//2, N-3]
    storage: Literal["bf16", "int8"] = "int8"  # hidden-state storage (int8 = per-token absmax scaled)
    teacher: Literal["hidden", "topk"] = "topk"  # recompute logits from stored last hidden, or store top-k logprobs
    teacher_topk: int = 20
    shard_tokens: int = 65536
    batch_size: int = 8
    num_processes: int = 1  # > 1: `accelerate launch` that many capture processes (each rank writes its shards)


@dataclass
class SpeculatorConfig:
    family: Literal["eagle3", "medusa", "mtp"] = "eagle3"
    num_steps: int = 5  # eagle3: TTT steps; medusa: heads; mtp: recursive steps
    num_layers: int = 1  # eagle3/mtp: draft decoder layers; medusa: ResBlocks per head
    draft_vocab_size: int | None = None  # eagle3: reduced draft vocab (None = full target vocab)
    draft_arch: Literal["llama", "qwen3"] = "llama"  # layout of the draft decoder layer(s)
    intermediate_size: int | None = None  # None = the target's (dense) intermediate size
    step_loss_decay: float = 0.8  # per-step (per-head) loss weight = decay ** k
    init_lm_head_from_target: bool = True


@dataclass
class TrainConfig:
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 8  # sequences per process per optimizer micro-step
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.03
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    accelerate_config: str | None = None  # recipes/accelerate/*.yaml (DDP, DeepSpeed ZeRO-2/3, FSDP)
    num_processes: int = 1
    eval_every: int = 100
    save_every: int = 100
    keep_last: int = 2
    resume: Literal["auto", "never"] | str = "auto"  # auto: latest checkpoint in run_dir; or a checkpoint path
    trackers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard", "wandb"])
    wandb_project: str = "speculators"
    wandb_entity: str | None = None  # W&B team / user (None: the credentials' default entity)
    wandb_group: str | None = None  # groups related runs in the W&B UI
    wandb_tags: list[str] = field(default_factory=list)
    log_every: int = 10
    num_workers: int = 0


@dataclass
class TreeConfig:
    """How the runtime drafts: a dynamic top-k tree, a static (Medusa) tree, a chain, or a sampled tree (at T > 0
    the first draw of each level is continued, `topk` - 1 more draws without replacement are its siblings)."""

    kind: Literal["dynamic", "static", "chain", "sampled"] = "dynamic"
    depth: int = 5
    topk: int = 4
    budget: int = 16  # verified draft nodes (root excluded)
    choices: list[list[int]] | None = None  # static trees: Medusa-style paths
    adaptive: bool = True  # per request and cycle: depth, and at T > 0 the kind (chain / sampled / configured)
    # sampled drafts at T > 0: "sequence" = block (chains) / traversal (sampled trees) verification, never fewer
    # accepted tokens than "token" = token-wise (iid / without_replacement), kept for comparisons
    verify: Literal["sequence", "token"] = "sequence"


# prompt-lookup nodes the runtime grafts onto a speculator's trees by default (serving/graft.py); measured on the
# house target's 10-epoch EAGLE-3 (5 rows x 5 cohorts, T = 0): tau 3.24 -> 3.48 with 3 nodes (6: 3.43), tokens/s
# +1.3% (6: +2.1%) — small, since every extra verified node costs target time on a CPU
DEFAULT_NGRAM_GRAFT = 3


@dataclass
class EvaluateConfig:
    workloads: list[str] = field(default_factory=lambda: ["data/workloads/*.jsonl"])
    max_rows_per_cohort: int | None = None
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    depth: int = 5  # teacher-forced chain depth
    live: bool = True  # also run the bundled runtime on the workloads
    live_rows_per_cohort: int = 8
    select_best: bool = True  # choose checkpoints/best by held-out simulated tau
    select_temperature: float = 0.0  # best = highest mean-over-cohorts simulated tau at this temperature


@dataclass
class ExportConfig:
    speculative_tokens: int = 3  # vLLM num_speculative_tokens default written into the config
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    checkpoint: str = "best"  # best | latest | a path
    # max-concurrency buckets of the launch schedule; the target's verify cost is measured at each
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 64])


def _help(text: str) -> dict:
    """Field metadata: the help text the CLI shows for a setting (one place for recipe, server and flags)."""
    return {"help": text}


@dataclass
class VllmCheckConfig:
    """The vllm-check stage: serve the export with the real vLLM and compare its acceptance with the prediction."""

    mode: Literal["auto", "always", "never"] = "auto"  # auto: when a vLLM environment exists (make vllm-env)
    python: str | None = None  # the vLLM environment's python (default: $SPECULATORS_VLLM_PYTHON, ./.venv-vllm)
    rows_per_cohort: int = 4
    max_new_tokens: int = 64
    port: int = 8431
    threads: int = 2
    max_model_len: int = 1024


@dataclass
class ServeConfig:
    """`speculators serve`: the recipe's `serve:` section, the server's limits and the CLI flags are this one
    dataclass (the CLI reads defaults and help from here; flags override the recipe)."""

    host: str = field(default="127.0.0.1", metadata=_help("interface to listen on (127.0.0.1: this machine only)"))
    port: int = field(default=8000, metadata=_help("TCP port"))
    api_key_env: str | None = field(default=None, metadata=_help(
        "name of an environment variable holding the API key; /v1/* then needs 'Authorization: Bearer <key>' "
        "(unset: no key)"))
    max_prompt_tokens: int | None = field(default=None, metadata=_help(
        "longest prompt accepted, in tokens (unset: the model's context minus one)"))
    max_new_tokens: int = field(default=512, metadata=_help(
        "most tokens one request may generate; a request without max_tokens gets this, or what still fits in the "
        "context"))
    max_concurrent_requests: int = field(default=4, metadata=_help(
        "requests running or waiting; more get 429 with Retry-After"))
    max_batch_size: int = field(default=4, metadata=_help("running requests that share each target forward"))
    max_request_bytes: int = field(default=4 * 1024 * 1024, metadata=_help(
        "largest request body accepted, in bytes (larger: 413 before the body is read)"))
    allow_revision_mismatch: bool = field(default=False, metadata=_help(
        "serve a speculator trained on another target revision (never another tokenizer)"))
    ngram_graft: int = field(default=DEFAULT_NGRAM_GRAFT, metadata=_help(
        "graft at most this many prompt-lookup (n-gram) nodes onto a speculator's trees (0: off)"))
    tree: TreeConfig = field(default_factory=TreeConfig, metadata=_help("draft tree settings (recipe only)"))

    def validate(self) -> None:
        """One-line SpeculatorsError for a setting out of range."""
        for name in ("max_new_tokens", "max_concurrent_requests", "max_batch_size", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise SpeculatorsError(f"serve.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise SpeculatorsError(f"serve.max_prompt_tokens must be >= 1 (or unset), got {self.max_prompt_tokens}")
        if not 0 < self.port < 65536:
            raise SpeculatorsError(f"serve.port must be in [1, 65535], got {self.port}")
        if self.ngram_graft < 0:
            raise SpeculatorsError(f"serve.ngram_graft must be >= 0 (0 = off), got {self.ngram_graft}")


def setting_help(cls: type, name: str) -> str:
    """The help text of a recipe setting, with its default (what the CLI shows for the matching flag)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default if f.default is not dataclasses.MISSING else None
    return f"{f.metadata.get('help', '')} (default: {'unset' if default is None else default})"


@dataclass
class Paths:
    """Where each stage writes, under `run_dir`."""

    run_dir: Path

    @property
    def prepared(self) -> Path:
        return self.run_dir / "prepared"

    @property
    def regenerated(self) -> Path:
        return self.run_dir / "regenerated"

    @property
    def features(self) -> Path:
        return self.run_dir / "features"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def eval(self) -> Path:
        return self.run_dir / "eval"

    @property
    def export(self) -> Path:
        return self.run_dir / "export"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"


@dataclass
class Recipe:
    name: str = "recipe"
    run_dir: str = "runs/recipe"
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    speculator: SpeculatorConfig = field(default_factory=SpeculatorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    vllm: VllmCheckConfig = field(default_factory=VllmCheckConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    source_path: str | None = field(default=None, metadata={"internal": True})

    @property
    def paths(self) -> Paths:
        return Paths(Path(self.run_dir))

    @property
    def training_data_dir(self) -> Path:
        """Regenerated data when regeneration is on, else the prepared data."""
        return self.paths.regenerated if self.data.regenerate.enabled else self.paths.prepared


# ----------------------------------------------------------------------------------------------------------------
# conversion from plain dicts, with strict keys and types


def _public_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except SpeculatorsError as exc:
                errors.append(str(exc))
        raise SpeculatorsError(errors[0] if len(errors) == 1 else
                               f"{where}: {value!r} does not match any of {', '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpeculatorsError(f"{where}: {value!r} is not one of {list(args)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SpeculatorsError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpeculatorsError(f"{where}: expected a mapping for section {where!r}, got {value!r}")
        return _from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpeculatorsError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SpeculatorsError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise SpeculatorsError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise SpeculatorsError(f"{where}: expected a string, got {value!r}")
    return value


def _from_dict(cls: type, data: dict, where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _public_fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{(where + '.') if where else ''}{close[0]}'?" if close else \
                f"; valid keys: {', '.join(fields)}"
            raise SpeculatorsError(f"unknown recipe key '{full}'{hint}")
        kwargs[key] = _convert(value, hints[key], full)
    return cls(**kwargs)


def recipe_from_dict(data: dict) -> Recipe:
    if not isinstance(data, dict):
        raise SpeculatorsError("a recipe must be a YAML mapping of sections (target:, data:, train: ...)")
    return _from_dict(Recipe, data)


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _public_fields(type(obj))}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj


def apply_override(data: dict, assignment: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML) to a nested dict, validating the path against `Recipe`."""
    if "=" not in assignment:
        raise SpeculatorsError(f"override {assignment!r} must look like section.key=value (e.g. train.lr=3e-4)")
    dotted, raw = assignment.split("=", 1)
    keys = [k for k in dotted.strip().split(".") if k]
    if not keys:
        raise SpeculatorsError(f"override {assignment!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    cls: Any = Recipe
    node = data
    for i, key in enumerate(keys):
        fields = {f.name: f for f in _public_fields(cls)} if dataclasses.is_dataclass(cls) else {}
        prefix = ".".join(keys[:i])
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            full = ".".join(keys[: i + 1])
            hint = f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            raise SpeculatorsError(f"unknown recipe key '{full}' in override {assignment!r}{hint}")
        if i == len(keys) - 1:
            node[key] = value
        else:
            hint_tp = typing.get_type_hints(cls)[key]
            if not dataclasses.is_dataclass(hint_tp):
                raise SpeculatorsError(f"'{'.'.join(keys[: i + 1])}' is a value, not a section, in {assignment!r}")
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SpeculatorsError(f"'{'.'.join(keys[: i + 1])}' is not a mapping in the recipe")
            cls = hint_tp


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SpeculatorsError(f"recipe not found: {p} (pass a YAML file, e.g. recipes/house-eagle3.yaml)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise SpeculatorsError(f"recipe {p} is not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
        data = loaded or {}
        if not isinstance(data, dict):
            raise SpeculatorsError(f"recipe {p} must be a YAML mapping of sections, got {type(data).__name__}")
    for assignment in overrides or []:
        apply_override(data, assignment)
    recipe = recipe_from_dict(data)
    recipe.source_path = str(path) if path is not None else None
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=None, width=100)
