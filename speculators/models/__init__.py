"""Speculator families (EAGLE-3, Medusa, MTP, DFlash) behind one interface (`base.Speculator`), one folder each.

A family is the folder `models/<name>/` (docs/architecture.md §4), holding three modules named after it:
- `<name>_config.py`: the typed config dataclass (a `FamilyConfig`, decorated `@register_config`): the family's
  options block of the exported config (`speculators_native`), the only home of its defaults, and `recognizes`
  (which config.json is this family's);
- `<name>_model.py`: the `Speculator` subclass, decorated `@register_model`;
- `<name>_format.py`: the rules of its vLLM format (`validate_vllm_export` calls the function decorated
  `@register_format(name)`).

The registry finds the families by their folders: `FAMILIES` (in listing order, `FamilyConfig.RANK`) imports only the
light config modules; `SPECULATORS[name]` and `VLLM_FORMATS[name]` import a family's model / format module the first
time it is asked for, so `import speculators` loads no torch. `family_of(config)` is the one reader of "which family
is this config.json"; `check_family(name)` the one error line for a name that is no family.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from speculators.core.config import SpeculatorConfig
from speculators.core.errors import SpeculatorsError

T = TypeVar("T")


@dataclass
class FamilyConfig:
    """The options every family records in its config's `speculators_native` block, with their defaults (a family
    subclass adds its own fields after these). `from_recipe` builds it from the recipe's `speculator:` section,
    `from_native` from a saved config (a key that is absent or null takes the default); `to_dict` is the block, in
    field order."""

    family: ClassVar[str]
    RANK: ClassVar[int]  # the family's place in listings (`FAMILIES`): the order families were added

    num_steps: int = 1
    num_layers: int = SpeculatorConfig.num_layers
    draft_arch: str = SpeculatorConfig.draft_arch
    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    step_loss_decay: float = SpeculatorConfig.step_loss_decay
    init_lm_head_from_target: bool = SpeculatorConfig.init_lm_head_from_target

    @classmethod
    def from_recipe(cls: type[T], spec: SpeculatorConfig, **values: Any) -> T:
        casts = {"int": int, "float": float, "bool": bool}
        out = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = values[f.name] if f.name in values else getattr(spec, f.name)
            cast = casts.get(str(f.type))
            out[f.name] = cast(value) if cast is not None and value is not None else value
        return cls(**out)

    @classmethod
    def from_native(cls: type[T], native: dict, **values: Any) -> T:
        out = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = values[f.name] if f.name in values else native.get(f.name)
            if value is not None or f.name in values:
                out[f.name] = value
        return cls(**out)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def recognizes(config: dict) -> bool:
        """Whether a config.json without our native block is this family's (its vLLM layout's markers)."""
        return False


# ----------------------------------------------------------------------------------------------------------------
# the registry


class _FamilyParts(dict):
    """family name -> one part of it (its model class, its format check), imported from `models/<name>/<name>_<part>.py`
    the first time it is asked for; the module registers it with a decorator."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part

    def __missing__(self, family: str) -> Any:
        check_family(family)
        importlib.import_module(f"{__name__}.{family}.{family}_{self.part}")
        if not dict.__contains__(self, family):
            raise SpeculatorsError(f"models/{family}/{family}_{self.part}.py registers no {self.part} for {family}")
        return dict.__getitem__(self, family)

    def __contains__(self, family: object) -> bool:
        return family in FAMILIES


CONFIGS: dict[str, type[FamilyConfig]] = {}  # family -> its typed config (all imported: they are light)
SPECULATORS: _FamilyParts = _FamilyParts("model")  # family -> its Speculator class
VLLM_FORMATS: _FamilyParts = _FamilyParts("format")  # family -> fn(config, tensors, target, problems)


def register_config(cls: type[FamilyConfig]) -> type[FamilyConfig]:
    """Class decorator of a family's config dataclass (`models/<family>/<family>_config.py`)."""
    CONFIGS[cls.family] = cls
    return cls


def register_model(cls: type[T]) -> type[T]:
    """Class decorator of a family's `Speculator` subclass (`models/<family>/<family>_model.py`)."""
    dict.__setitem__(SPECULATORS, cls.family, cls)  # type: ignore[attr-defined]
    return cls


def register_format(family: str) -> Callable[[T], T]:
    """Decorator of a family's vLLM format check (`models/<family>/<family>_format.py`): fn(config, tensors,
    target, problems) appends one line per problem."""
    def put(fn: T) -> T:
        dict.__setitem__(VLLM_FORMATS, family, fn)
        return fn
    return put


def _discover() -> tuple[str, ...]:
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}.{info.name}_config")
    return tuple(sorted(CONFIGS, key=lambda name: CONFIGS[name].RANK))


FAMILIES: tuple[str, ...] = _discover()  # the family names, in listing order


def check_family(name: str, where: str = "") -> str:
    """`name` when it is a family (a folder under models/), else one error line (`where`: what named it)."""
    if name not in CONFIGS:
        raise SpeculatorsError(f"unknown speculator family {name!r}{where}; known: {', '.join(FAMILIES)} (one "
                               "folder each under speculators/models/)")
    return name


def family_of(config: dict, *, native: bool = True) -> str:
    """The family of a speculator config.json: its `speculators_native.family` (with `native`), else the family whose
    config `recognizes` the layout (the speculators format's `speculators_model_type`, vLLM's Medusa `model_type`,
    MTP's `mtp_layout` or a target's MTP slot)."""
    named = (config.get("speculators_native") or {}).get("family") if native else None
    if named is not None:
        return check_family(str(named), " in the checkpoint config")
    found = [name for name in FAMILIES if CONFIGS[name].recognizes(config)]
    if found:
        return found[0]
    if config.get("speculators_model_type") is not None:
        return check_family(str(config["speculators_model_type"]), " (speculators_model_type)")
    raise SpeculatorsError("speculator config names no family (speculators_native.family, speculators_model_type "
                           "or model_type); not a speculator checkpoint")
