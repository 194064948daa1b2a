"""The exported formats, field by field, against the tiny golden exports in export/golden/ (every family).

Regenerate the goldens after an intended format change with `SPECULATORS_REGEN_GOLDEN=1 pytest <this file>`
(and review the diff: `test_golden_files_encode_the_vllm_rules` pins the rules themselves).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluate"))
from evalexport_helpers import REPO, make_run  # noqa: E402

from speculators.export import export as export_stage  # noqa: E402
from speculators.export.validate import validate_vllm_export  # noqa: E402

torch.set_num_threads(1)
GOLDEN = REPO / "export" / "golden"
REGEN = os.environ.get("SPECULATORS_REGEN_GOLDEN") == "1"


def normalized_config(path: Path) -> dict:
    """config.json without machine-specific values (paths, hashes of random weights)."""
    cfg = json.loads(path.read_text())
    ver = cfg.get("speculators_config", {}).get("verifier")
    if ver:
        ver["name_or_path"] = "<target>"
    if isinstance(cfg.get("verifier"), dict):
        cfg["verifier"]["name_or_path"] = "<target>"
    native = cfg.get("speculators_native", {})
    if isinstance(native.get("verifier"), dict):
        native["verifier"]["name_or_path"] = "<target>"
    for rec in native.get("target_tensors", {}).values():
        for key in ("sha256", "norm", "probe"):
            rec.pop(key, None)
    if "export" in native:
        native["export"]["target_revision"] = "<revision>"
    return cfg


def tensor_listing(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return {k: [str(fh.get_slice(k).get_dtype()), list(fh.get_slice(k).get_shape())] for k in sorted(fh.keys())}


CASES = {
    "eagle3": dict(family="eagle3", draft_vocab_size=512),
    "eagle3-full-vocab": dict(family="eagle3"),  # draft vocab = target vocab: no d2t / t2d (vLLM >= 0.30)
    "medusa": dict(family="medusa"),
    "mtp": dict(family="mtp"),
    "dflash": dict(family="dflash"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_matches_golden(tmp_path: Path, tiny_llama: Path, case: str) -> None:
    kw = dict(CASES[case])
    recipe = make_run(tmp_path, tiny_llama, kw.pop("family"), steps=(10,), num_steps=3,
                      extra=("export.checkpoint=latest",), **kw)
    export_stage.run(recipe)
    out = recipe.paths.export
    got = {"config.json": normalized_config(out / "config.json"),
           "tensors.json": tensor_listing(out / "model.safetensors")}
    for name, value in got.items():
        golden = GOLDEN / case / name
        if REGEN:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
        assert json.loads(golden.read_text()) == value, f"{case}/{name} differs from export/golden"


def test_golden_files_encode_the_vllm_rules() -> None:
    """The goldens themselves say what vLLM requires (so a regenerated golden cannot silently drop a rule)."""
    e = json.loads((GOLDEN / "eagle3" / "config.json").read_text())
    assert "model_type" not in e and e["speculators_model_type"] == "eagle3"
    sc = e["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["default_proposal_method"] == sc["proposal_methods"][0]["proposal_type"]
    assert sc["verifier"] == {"name_or_path": "<target>", "architectures": ["LlamaForCausalLM"]}
    assert e["transformer_layer_config"]["model_type"] == "llama"
    assert e["transformer_layer_config"]["rope_theta"] == 10000.0
    assert all(e[f] is False for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    assert e["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and e["draft_vocab_size"] == 512
    assert e["dtype"] == "bfloat16"
    t = json.loads((GOLDEN / "eagle3" / "tensors.json").read_text())
    assert t["fc.weight"] == ["BF16", [64, 192]] and t["lm_head.weight"] == ["BF16", [512, 64]]
    assert t["d2t"] == ["I64", [512]] and t["t2d"] == ["BOOL", [8192]]
    assert t["embed_tokens.weight"] == ["BF16", [8192, 64]]  # vLLM's speculators library needs it
    assert not any(k.startswith("model.") for k in t)
    f = json.loads((GOLDEN / "eagle3-full-vocab" / "tensors.json").read_text())
    assert "d2t" not in f and "t2d" not in f and f["lm_head.weight"] == ["BF16", [8192, 64]]
    m = json.loads((GOLDEN / "medusa" / "config.json").read_text())
    assert m["model_type"] == "medusa" and m["num_heads"] == 3 and m["num_hidden_layers"] == 1
    mt = json.loads((GOLDEN / "medusa" / "tensors.json").read_text())
    assert set(mt) == {f"blocks.{h}.layers.0.{w}" for h in range(3) for w in ("weight", "bias")} | {
        f"lm_heads.{h}.weight" for h in range(3)}
    d = json.loads((GOLDEN / "dflash" / "config.json").read_text())
    assert "model_type" not in d and d["speculators_model_type"] == "dflash"
    assert d["speculators_config"]["algorithm"] == "dflash" and d["architectures"] == ["DFlashDraftModel"]
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == d["block_size"] - 1 == 3
    assert d["aux_hidden_state_layer_ids"] == [2, 4, 5] and isinstance(d["mask_token_id"], int)
    assert d["sliding_window_non_causal"] is True and d["sample_from_anchor"] is False  # bidirectional blocks
    assert d["transformer_layer_config"]["model_type"] == "qwen3"
    assert set(d["transformer_layer_config"]["layer_types"]) == {"full_attention"}
    dt = json.loads((GOLDEN / "dflash" / "tensors.json").read_text())
    assert dt["fc.weight"] == ["BF16", [64, 192]] and dt["hidden_norm.weight"] == ["BF16", [64]]
    assert dt["layers.0.self_attn.k_norm.weight"] == ["BF16", [16]]
    assert not {"embed_tokens.weight", "lm_head.weight", "d2t", "mask_hidden"} & set(dt)  # vLLM shares the target's
    n = json.loads((GOLDEN / "mtp" / "config.json").read_text())
    assert n["mtp_layout"] == "deepseek" and "vLLM cannot serve" in n["speculators_native"]["export"]["vllm"]


def test_qwen3_draft_layout_exports_valid(tmp_path: Path, tiny_qwen3: Path) -> None:
    recipe = make_run(tmp_path, tiny_qwen3, "eagle3", steps=(10,), num_steps=2,
                      extra=("export.checkpoint=latest", "speculator.draft_arch=qwen3"))
    export_stage.run(recipe)
    out = recipe.paths.export
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    names = tensor_listing(out / "model.safetensors")
    assert names["layers.0.self_attn.q_norm.weight"] == ["BF16", [16]]
    assert validate_vllm_export(out) == []
