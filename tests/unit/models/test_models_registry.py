"""The family registry (models/__init__.py): families are the folders, found in listing order; the one reader of
"which family is this config.json" agrees with every golden export; an unknown name is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.core.config import SpeculatorConfig
from speculators.core.errors import SpeculatorsError
from speculators.models import CONFIGS, FAMILIES, SPECULATORS, VLLM_FORMATS, check_family, family_of

GOLDEN = Path(__file__).resolve().parents[3] / "export" / "golden"


def test_families_are_the_folders_in_listing_order() -> None:
    assert FAMILIES == ("eagle3", "medusa", "mtp", "dflash")
    for name in FAMILIES:
        assert SPECULATORS[name].family == name and CONFIGS[name].family == name
        assert callable(VLLM_FORMATS[name])
        assert name in SPECULATORS


@pytest.mark.parametrize("golden", ["eagle3", "eagle3-full-vocab", "medusa", "mtp", "dflash"])
def test_family_of_reads_every_golden_export(golden: str) -> None:
    config = json.loads((GOLDEN / golden / "config.json").read_text())
    family = golden.split("-")[0]
    assert family_of(config) == family
    assert family_of(config, native=False) == family  # the vLLM layout's own markers


def test_family_of_stitched_mtp_and_unknowns() -> None:
    assert family_of({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}) == "mtp"
    assert family_of({"text_config": {"model_type": "qwen3_5", "mtp_num_hidden_layers": 1}}) == "mtp"
    with pytest.raises(SpeculatorsError, match="names no family"):
        family_of({"model_type": "llama"})
    with pytest.raises(SpeculatorsError, match=r"unknown speculator family 'eagle4' in the checkpoint config"):
        family_of({"speculators_native": {"family": "eagle4"}})
    with pytest.raises(SpeculatorsError, match=r"^unknown speculator family 'x' \(here\); known: eagle3, medusa"):
        check_family("x", " (here)")
    with pytest.raises(SpeculatorsError, match="unknown speculator family 'x'"):
        SPECULATORS["x"]  # noqa: B018


def test_defaults_have_one_home() -> None:
    """The options every family shares default to the recipe's; DFlash reads an unrecorded decay as its gamma 7."""
    for name in ("eagle3", "medusa", "mtp"):
        assert CONFIGS[name]().step_loss_decay == SpeculatorConfig.step_loss_decay
        assert CONFIGS[name].from_native({}).step_loss_decay == SpeculatorConfig.step_loss_decay
    assert CONFIGS["dflash"]().draft_arch == "qwen3"
    assert list(CONFIGS["eagle3"]().to_dict())[-3:] == ["norm_before_fc", "fc_norm", "norm_output"]
