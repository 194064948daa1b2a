"""DFlash's options block (`speculators_native` of its config), with its defaults: qwen3 draft layers, at most
`max_anchors` blocks per sequence in training, and a checkpoint without a recorded decay reads as DFlash's
exp(-k/gamma) with gamma 7. The vLLM speculators format marks a DFlash config with
`speculators_model_type: "dflash"`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from speculators.models import FamilyConfig, register_config


@register_config
@dataclass
class DFlashConfig(FamilyConfig):
    family: ClassVar[str] = "dflash"
    RANK: ClassVar[int] = 3

    draft_arch: str = "qwen3"
    step_loss_decay: float = math.exp(-1 / 7)
    max_anchors: int | None = None

    @staticmethod
    def recognizes(config: dict) -> bool:
        return config.get("speculators_model_type") == "dflash"
