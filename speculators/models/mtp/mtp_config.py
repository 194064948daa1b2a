"""MTP's options block (`speculators_native` of its config), with its defaults. Our native MTP layout has
`mtp_layout`; a target checkpoint with the module stitched into its MTP slot has `num_nextn_predict_layers` (or
Qwen3.5's `mtp_num_hidden_layers`) in its (text) config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from speculators.models import FamilyConfig, register_config


@register_config
@dataclass
class MTPConfig(FamilyConfig):
    family: ClassVar[str] = "mtp"
    RANK: ClassVar[int] = 2

    @staticmethod
    def recognizes(config: dict) -> bool:
        if config.get("mtp_layout") is not None:
            return True
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return bool(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers"))
