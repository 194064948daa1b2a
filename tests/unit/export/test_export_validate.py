"""The format validator catches every deliberately broken export (and passes the good ones)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
from evalexport_helpers import make_run  # noqa: E402

from speculators.core.errors import SpeculatorsError  # noqa: E402
from speculators.export import export as export_stage  # noqa: E402
from speculators.export.validate import validate_vllm_export  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good_exports(tmp_path_factory, tiny_llama: Path) -> dict[str, Path]:
    out = {}
    for family, kw in (("eagle3", {"draft_vocab_size": 512}), ("medusa", {}), ("dflash", {})):
        recipe = make_run(tmp_path_factory.mktemp(family), tiny_llama, family, steps=(10,), num_steps=2,
                          extra=("export.checkpoint=latest",), **kw)
        export_stage.run(recipe)
        out[family] = recipe.paths.export
    return out


def _broken(src: Path, tmp: Path, config: Callable[[dict], None] | None = None,
            tensors: Callable[[dict], dict] | None = None) -> Path:
    d = tmp / "broken"
    shutil.copytree(src, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(str(d / "model.safetensors"))
        save_file(tensors(state), str(d / "model.safetensors"))
    return d


def _one(problems: list[str], needle: str) -> None:
    assert any(needle in p for p in problems), f"expected a problem mentioning {needle!r}, got {problems}"


def test_good_exports_pass(good_exports: dict[str, Path]) -> None:
    for d in good_exports.values():
        assert validate_vllm_export(d) == []


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda c: c.__setitem__(key, value)


def _four_aux(c: dict) -> None:
    c["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4, 5]


def _fc_four(s: dict) -> dict:
    s["fc.weight"] = torch.cat([s["fc.weight"], s["fc.weight"][:, :64]], dim=1)
    return s


EAGLE3_BREAKS = {
    "top-level model_type": (_set("model_type", "llama"), None, "top-level model_type 'llama' must be absent"),
    "missing d2t": (None, lambda s: {k: v for k, v in s.items() if k != "d2t"}, "d2t is missing"),
    "model. prefix": (None, lambda s: {"model." + k: v for k, v in s.items()}, "'model.' prefix"),
    "4 aux layers": (_four_aux, _fc_four, "has 4 ids"),
    "unsorted aux layers": (lambda c: c["eagle_aux_hidden_state_layer_ids"].reverse(), None, "are not increasing"),
    "lm_head rows": (_set("draft_vocab_size", 256), None, "lm_head.weight has shape [512, 64], expected [256, 64]"),
    "d2t out of range": (None, lambda s: {**s, "d2t": s["d2t"] + 8000}, "outside the target vocab"),
    "d2t dtype": (None, lambda s: {**s, "d2t": s["d2t"].int()}, "d2t must be int64"),
    "d2t not injective": (None, lambda s: {**s, "d2t": torch.zeros_like(s["d2t"]) - torch.arange(512) + 7},
                          "same target id"),
    "norm flag": (lambda c: c.pop("norm_before_residual"), None, "norm_before_residual must be written"),
    "layer model_type": (lambda c: c["transformer_layer_config"].__setitem__("model_type", "mistral"), None,
                         "no vLLM EAGLE-3 architecture"),
    "speculative_tokens": (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
                           None, "speculative_tokens must be an int"),
    "verifier": (lambda c: c["speculators_config"].pop("verifier"), None, "verifier.name_or_path is missing"),
    "model type key": (lambda c: c.pop("speculators_model_type"), None, "lacks speculators_model_type"),
    "unknown tensor": (None, lambda s: {**s, "extra.weight": torch.zeros(2)}, "unexpected tensors"),
    "NaN": (None, lambda s: {**s, "norm.weight": torch.full_like(s["norm.weight"], float("nan"))}, "NaN"),
    "dtype mismatch": (_set("dtype", "float32"), None, "declares dtype float32"),
    "t2d": (None, lambda s: {**s, "t2d": torch.ones_like(s["t2d"])}, "t2d does not mark exactly"),
    "no embed_tokens": (None, lambda s: {k: v for k, v in s.items() if k != "embed_tokens.weight"},
                        "embed_tokens.weight is missing"),
}


@pytest.mark.parametrize("name", sorted(EAGLE3_BREAKS))
def test_broken_eagle3_export_is_caught(good_exports: dict[str, Path], tmp_path: Path, name: str) -> None:
    config, tensors, needle = EAGLE3_BREAKS[name]
    _one(validate_vllm_export(_broken(good_exports["eagle3"], tmp_path, config, tensors)), needle)


MEDUSA_BREAKS = {
    "missing head": (None, lambda s: {k: v for k, v in s.items() if not k.startswith("lm_heads.1")},
                     "missing tensor lm_heads.1.weight"),
    "no bias": (None, lambda s: {k: v for k, v in s.items() if not k.endswith("bias")},
                "missing tensor blocks.0.layers.0.bias"),
    "num_heads": (lambda c: c.pop("num_heads"), None, "needs an integer num_heads"),
    "vocab": (_set("vocab_size", 100), None, "lm_heads.0.weight has shape [8192, 64], expected [100, 64]"),
    "prefix": (None, lambda s: {"medusa_heads." + k: v for k, v in s.items()}, "unexpected tensors"),
}


@pytest.mark.parametrize("name", sorted(MEDUSA_BREAKS))
def test_broken_medusa_export_is_caught(good_exports: dict[str, Path], tmp_path: Path, name: str) -> None:
    config, tensors, needle = MEDUSA_BREAKS[name]
    _one(validate_vllm_export(_broken(good_exports["medusa"], tmp_path, config, tensors)), needle)


def _layer(key: str, value: object) -> Callable[[dict], None]:
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


DFLASH_BREAKS = {
    "causal blocks": (_set("sliding_window_non_causal", False), None, "sliding_window_non_causal must be true"),
    "no non-causal flag": (lambda c: c.pop("sliding_window_non_causal"), None, "sliding_window_non_causal"),
    "sample from anchor": (_set("sample_from_anchor", True), None, "sample_from_anchor must be written as false"),
    "k != block - 1": (lambda c: c["speculators_config"]["proposal_methods"][0].__setitem__("speculative_tokens", 1),
                       None, "speculative_tokens 1 != block_size - 1"),
    "mask token": (_set("mask_token_id", 10**6), None, "mask_token_id must be a token id"),
    "no aux ids": (lambda c: c.pop("aux_hidden_state_layer_ids"), None, "aux_hidden_state_layer_ids must be"),
    "unsorted aux": (lambda c: c["aux_hidden_state_layer_ids"].reverse(), None, "must be increasing"),
    "fc width": (_set("aux_hidden_state_layer_ids", [2, 4]), None, "fc.weight has shape [64, 192], expected [64, 128]"),
    "llama layers": (_layer("model_type", "llama"), None, "DFlashQwen3ForCausalLM"),
    "sliding layers": (_layer("layer_types", ["sliding_attention"]), None, "must be all full_attention"),
    "mask_hidden": (None, lambda s: {**s, "mask_hidden": torch.zeros(1, 64)}, "mask_hidden is shipped"),
    "no k_norm": (None, lambda s: {k: v for k, v in s.items() if "k_norm" not in k},
                  "missing tensor layers.0.self_attn.k_norm.weight"),
    "no hidden_norm": (None, lambda s: {k: v for k, v in s.items() if k != "hidden_norm.weight"},
                       "missing tensor hidden_norm.weight"),
    "d2t": (None, lambda s: {**s, "d2t": torch.zeros(8192, dtype=torch.long)}, "full target vocab"),
    "algorithm": (lambda c: c["speculators_config"].__setitem__("algorithm", "eagle3"), None,
                  "expected 'dflash'"),
}


@pytest.mark.parametrize("name", sorted(DFLASH_BREAKS))
def test_broken_dflash_export_is_caught(good_exports: dict[str, Path], tmp_path: Path, name: str) -> None:
    config, tensors, needle = DFLASH_BREAKS[name]
    _one(validate_vllm_export(_broken(good_exports["dflash"], tmp_path, config, tensors)), needle)


def test_missing_files_and_unknown_configs(good_exports: dict[str, Path], tmp_path: Path) -> None:
    d = _broken(good_exports["eagle3"], tmp_path)
    (d / "model.safetensors").unlink()
    _one(validate_vllm_export(d), "no *.safetensors weight file")
    with pytest.raises(SpeculatorsError, match="is missing model.safetensors"):
        export_stage.require_valid_export(d)
    (d / "config.json").unlink()
    _one(validate_vllm_export(d), "config.json is missing")
    (d / "config.json").write_text("{not json")
    _one(validate_vllm_export(d), "not valid JSON")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _one(validate_vllm_export(d), "neither the speculators format")
    _one(validate_vllm_export(tmp_path / "nope"), "is not a directory")


def test_d2t_with_the_full_vocab_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM >= 0.30 creates no draft_id_to_target_id when draft vocab == vocab and refuses a file holding d2t."""
    (tmp_path / "run").mkdir()
    recipe = make_run(tmp_path / "run", tiny_llama, "eagle3", steps=(10,), num_steps=2,
                      extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    good = recipe.paths.export
    assert validate_vllm_export(good) == []
    names = set(load_file(str(good / "model.safetensors")))
    assert not names & {"d2t", "t2d"} and "embed_tokens.weight" in names
    d = _broken(good, tmp_path, tensors=lambda s: {**s, "d2t": torch.zeros(8192, dtype=torch.long)})
    _one(validate_vllm_export(d), "d2t is present but draft_vocab_size == vocab (8192)")


def test_pairing_shapes_are_cross_checked(good_exports: dict[str, Path], tmp_path: Path) -> None:
    d = _broken(good_exports["eagle3"], tmp_path, _set("eagle_aux_hidden_state_layer_ids", [2, 4, 9]))
    _one(validate_vllm_export(d), "out of range for a 8-layer target")


def test_attention_bias_exports_carry_every_projection_bias(tmp_path: Path) -> None:
    """A target with attention biases (gpt-oss) gives a draft layer with q/k/v AND o_proj biases, as vLLM's Llama
    layer builds them (bias_o_proj = attention_bias): the export validates; without o_proj.bias it does not."""
    from tests.conftest import make_tiny_target

    target = make_tiny_target(tmp_path / "gpt-oss", "gpt_oss")
    (tmp_path / "run").mkdir()
    recipe = make_run(tmp_path / "run", target, "eagle3", steps=(10,), num_steps=2, draft_vocab_size=512,
                      extra=("export.checkpoint=latest",))
    export_stage.run(recipe)
    good = recipe.paths.export
    assert json.loads((good / "config.json").read_text())["transformer_layer_config"]["attention_bias"] is True
    assert validate_vllm_export(good) == []
    d = _broken(good, tmp_path, tensors=lambda s: {k: v for k, v in s.items() if k != "layers.0.self_attn.o_proj.bias"})
    _one(validate_vllm_export(d), "layers.0.self_attn.o_proj.bias")
