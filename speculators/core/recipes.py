"""Recipe files: YAML -> a typed, checked `Recipe` (speculators.core.config), and back.

`load_recipe(path, overrides)` reads a YAML recipe, applies dotted overrides such as `train.lr=3e-4`, and returns a
typed `Recipe`. Unknown or mistyped keys are errors naming the key and the closest valid one; values are checked
against their types, `Literal` choices and ranges (one line each). `load_recipe` also owns resolving the target's
source (`package:NAME`, a `.gguf` file: core/target_sources.py), so `run_pipeline(load_recipe(path))` from Python runs
what `speculators run` runs. `dump_recipe` writes the resolved recipe back.

This module does not run stages. It imports torch (through target_sources), so cli.py imports it per command.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target_sources import resolve_target_source

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
    recipe = _from_dict(Recipe, data)
    check_ranges(recipe)
    return recipe


# ----------------------------------------------------------------------------------------------------------------
# value ranges (types and Literal choices are checked while converting; these are the numbers that fit the type but
# make no sense). (dotted setting, lowest, highest, low inclusive, high inclusive); None bounds are open; an unset
# optional setting (None) is always allowed.

_RANGES: tuple[tuple[str, float | None, float | None, bool, bool], ...] = (
    ("seed", 0, None, True, True),
    ("data.max_length", 2, None, True, True),
    ("data.val_fraction", 0, 1, True, False),
    ("data.regenerate.crosscheck_rows", 0, None, True, True),
    ("evaluate.crosscheck_rows", 0, None, True, True),
    ("data.regenerate.temperature", 0, None, True, True),
    ("data.regenerate.top_p", 0, 1, False, True),
    ("data.regenerate.max_new_tokens", 1, None, True, True),
    ("data.regenerate.batch_size", 1, None, True, True),
    ("data.regenerate.concurrency", 1, None, True, True),
    ("data.regenerate.max_retries", 0, None, True, True),
    ("data.regenerate.request_timeout", 0, None, False, True),
    ("data.regenerate.max_failed_fraction", 0, 1, True, True),
    ("capture.teacher_topk", 1, None, True, True),
    ("capture.shard_tokens", 1, None, True, True),
    ("capture.batch_size", 1, None, True, True),
    ("capture.num_processes", 1, None, True, True),
    ("speculator.num_steps", 1, None, True, True),
    ("speculator.num_layers", 1, None, True, True),
    ("speculator.draft_vocab_size", 1, None, True, True),
    ("speculator.intermediate_size", 1, None, True, True),
    ("speculator.step_loss_decay", 0, None, False, True),
    ("train.epochs", 0, None, False, True),
    ("train.max_steps", 1, None, True, True),
    ("train.batch_size", 1, None, True, True),
    ("train.grad_accum", 1, None, True, True),
    ("train.lr", 0, None, False, True),
    ("train.teacher_temperature", 0, None, False, True),
    ("train.weight_decay", 0, None, True, True),
    ("train.warmup_ratio", 0, 1, True, True),
    ("train.min_lr_ratio", 0, 1, True, True),
    ("train.grad_clip", 0, None, True, True),
    ("train.num_processes", 1, None, True, True),
    ("train.eval_every", 0, None, True, True),
    ("train.save_every", 0, None, True, True),
    ("train.keep_last", 1, None, True, True),
    ("train.log_every", 1, None, True, True),
    ("train.num_workers", 0, None, True, True),
    ("evaluate.max_rows_per_cohort", 1, None, True, True),
    ("evaluate.depth", 1, None, True, True),
    ("evaluate.live_rows_per_cohort", 0, None, True, True),
    ("evaluate.serving_chain_depth", 1, None, True, True),
    ("export.speculative_tokens", 1, None, True, True),
    ("vllm.rows_per_cohort", 1, None, True, True),
    ("vllm.max_new_tokens", 1, None, True, True),
    ("vllm.port", 1, 65535, True, True),
    ("vllm.threads", 1, None, True, True),
    ("vllm.max_model_len", 2, None, True, True),
)
# list settings whose items must each be in range / one of a set of choices
_LIST_RANGES = (("train.betas", 0, 1, True, False), ("evaluate.temperatures", 0, None, True, True),
                ("export.concurrencies", 1, None, True, True))
_LIST_CHOICES = (("train.trackers", ("jsonl", "tensorboard", "wandb")),)


def _get(obj: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        obj = getattr(obj, key)
    return obj


def _out_of_range(value: float, low: float | None, high: float | None, low_in: bool, high_in: bool) -> bool:
    return (low is not None and (value < low or (value == low and not low_in))) or \
        (high is not None and (value > high or (value == high and not high_in)))


def _range_text(low: float | None, high: float | None, low_in: bool, high_in: bool) -> str:
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def check_ranges(recipe: Recipe) -> None:
    """One-line SpeculatorsError for the first setting out of its range or list item outside its choices."""
    for name, low, high, low_in, high_in in _RANGES:
        value = _get(recipe, name)
        for item in (value if isinstance(value, list) else [value]):  # a number, or a list of them
            if item is not None and _out_of_range(item, low, high, low_in, high_in):
                raise SpeculatorsError(f"{name} must be {_range_text(low, high, low_in, high_in)}, got {value}")
    for name, low, high, low_in, high_in in _LIST_RANGES:
        bad = [v for v in _get(recipe, name) if _out_of_range(v, low, high, low_in, high_in)]
        if bad:
            raise SpeculatorsError(f"every item of {name} must be {_range_text(low, high, low_in, high_in)}, "
                                   f"got {bad}")
    for name, choices in _LIST_CHOICES:
        unknown = [v for v in _get(recipe, name) if v not in choices]
        if unknown:
            raise SpeculatorsError(f"{name}: unknown {unknown}; choose from {', '.join(choices)}")
    recipe.serve.validate()


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _public_fields(type(obj))}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj


def apply_override(data: dict, assignment: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML) to a nested dict, validating the path against `Recipe`; an item of a
    list of sections is named by its index (`data.sources.1.max_rows=300`)."""
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
    i = 0
    while i < len(keys):
        key = keys[i]
        fields = {f.name: f for f in _public_fields(cls)} if dataclasses.is_dataclass(cls) else {}
        prefix = ".".join(keys[:i])
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            full = ".".join(keys[: i + 1])
            hint = f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            raise SpeculatorsError(f"unknown recipe key '{full}' in override {assignment!r}{hint}")
        if i == len(keys) - 1:
            node[key] = value
            return
        hint_tp = typing.get_type_hints(cls)[key]
        item_tp = (typing.get_args(hint_tp) or [None])[0] if typing.get_origin(hint_tp) is list else None
        if dataclasses.is_dataclass(item_tp) and i + 2 < len(keys):  # one item of a list of sections, by index
            node, cls = _list_item(node, keys, i, assignment), item_tp
            i += 2
            continue
        if not dataclasses.is_dataclass(hint_tp):
            raise SpeculatorsError(f"'{'.'.join(keys[: i + 1])}' is a value, not a section, in {assignment!r}")
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SpeculatorsError(f"'{'.'.join(keys[: i + 1])}' is not a mapping in the recipe")
        cls = hint_tp
        i += 1


def _list_item(node: dict, keys: list[str], i: int, assignment: str) -> dict:
    """The item `keys[i+1]` (an index) of the list of sections `keys[i]` in `node`, e.g. data.sources.1."""
    items, index, where = node.get(keys[i]), keys[i + 1], ".".join(keys[: i + 1])
    count = len(items) if isinstance(items, list) else 0
    if not count:
        raise SpeculatorsError(f"'{where}.{index}' in {assignment!r}: {where} is empty in the recipe")
    if not index.isdigit() or int(index) >= count:
        raise SpeculatorsError(f"'{where}.{index}' in {assignment!r}: {where} has {count} item(s) in the recipe; "
                               f"give an index 0..{count - 1}")
    item = items[int(index)]
    if not isinstance(item, dict):
        raise SpeculatorsError(f"'{where}.{index}' is not a mapping in the recipe")
    return item


def load_recipe(path: str | Path | None, overrides: list[str] | None = None, *,
                resolve_target: bool = True) -> Recipe:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply dotted overrides. A `package:NAME` or
    `.gguf` target becomes its local folder (downloaded / converted on first use: `resolve_target_source`), as the
    CLI runs it; `resolve_target=False` keeps the name as written (a dry run)."""
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
    if resolve_target:
        recipe.target.name_or_path = resolve_target_source(recipe.target.name_or_path)
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=None, width=100)
