"""Medusa's options block (`speculators_native` of its config), with its defaults. vLLM's Medusa format marks a
config with `model_type: "medusa"`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculators.models import FamilyConfig, register_config


@register_config
@dataclass
class MedusaConfig(FamilyConfig):
    family: ClassVar[str] = "medusa"
    RANK: ClassVar[int] = 1

    @staticmethod
    def recognizes(config: dict) -> bool:
        return config.get("model_type") == "medusa"
