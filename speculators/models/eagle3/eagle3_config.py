"""EAGLE-3's options block (`speculators_native` of its config): the shared options and the EAGLE 3.1 norm flags,
with their defaults. The vLLM speculators format marks an EAGLE-3 config with `speculators_model_type: "eagle3"`
(a `speculators_config` without the type is read as EAGLE-3 too, so the format check names what is missing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculators.models import FamilyConfig, register_config

# every norm flag of the speculators format (written explicitly: vLLM and speculators default differently), and the
# ones this toolkit implements (norm_before_residual is always false); the latter are Eagle3Config's own fields
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SUPPORTED_NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@register_config
@dataclass
class Eagle3Config(FamilyConfig):
    family: ClassVar[str] = "eagle3"
    RANK: ClassVar[int] = 0

    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @staticmethod
    def recognizes(config: dict) -> bool:
        smt = config.get("speculators_model_type")
        return smt == "eagle3" or (smt is None and config.get("speculators_config") is not None)
