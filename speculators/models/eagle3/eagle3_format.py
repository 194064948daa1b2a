"""EAGLE-3 in the vLLM speculators format: the rules vLLM's Eagle3LlamaForCausalLM / Eagle3Qwen3ForCausalLM loader
applies (config keys and norm flags, aux layer ids, every tensor name and shape, the d2t / t2d vocabulary map).

`validate_eagle3(config, tensors, target, problems)` appends one line per problem; `check_eagle3_export` (registered
as the family's vLLM format) runs it with the checks every weight-file format shares (format_checks.py). It does not
detect the format (export/validate.py) and never writes anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speculators.models import register_format
from speculators.models.eagle3.eagle3_config import NORM_FLAGS
from speculators.models.format_checks import (
    Tensors,
    check_layer_config,
    check_speculators_config,
    check_weight_dir,
    expect_shape,
    is_int,
    no_model_prefix,
    pairing_problems,
    unknown_tensors,
)

EAGLE3_ARCHS = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}


def _eagle3_layer_config(config: dict, problems: list[str]) -> dict | None:
    """transformer_layer_config (the draft's HF config in vLLM) and the norm flags; None when unusable."""
    layer = check_layer_config(config, problems)
    if layer is None:
        return None
    if layer["model_type"] not in EAGLE3_ARCHS:
        problems.append(f"transformer_layer_config.model_type {layer['model_type']!r} has no vLLM EAGLE-3 "
                        f"architecture (allowed: {', '.join(EAGLE3_ARCHS)})")
    if "rope_theta" not in layer and "rope_parameters" not in layer:
        problems.append("transformer_layer_config has no rope settings (rope_theta / rope_parameters)")
    for flag in NORM_FLAGS:
        if not isinstance(config.get(flag), bool):
            problems.append(f"{flag} must be written explicitly as true/false (vLLM and speculators default "
                            f"differently)")
    if config.get("norm_before_fc") and config.get("fc_norm"):
        problems.append("norm_before_fc and fc_norm are mutually exclusive")
    if "eagle_config" in config:
        problems.append("top-level eagle_config is not part of the speculators format; remove it")
    return layer


def _eagle3_expected_shapes(config: dict, layer: dict, vd: int, target_h: int) -> dict[str, list[int]]:
    """Every tensor name vLLM's Eagle3LlamaForCausalLM loads, with its shape."""
    h = int(layer["hidden_size"])
    n_layers = int(layer["num_hidden_layers"])
    heads, kv = int(layer["num_attention_heads"]), int(layer["num_key_value_heads"])
    hd = int(layer.get("head_dim") or h // heads)
    inter = int(layer["intermediate_size"])
    expected: dict[str, list[int]] = {"fc.weight": [h, 3 * target_h], "norm.weight": [h], "lm_head.weight": [vd, h]}
    for i in range(n_layers):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [heads * hd, width], p + "self_attn.k_proj.weight": [kv * hd, width],
            p + "self_attn.v_proj.weight": [kv * hd, width], p + "self_attn.o_proj.weight": [h, heads * hd],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter], p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h]})
        if i == 0:
            expected[p + "hidden_norm.weight"] = [h]
        if layer["model_type"] == "qwen3":
            expected[p + "self_attn.q_norm.weight"] = [hd]
            expected[p + "self_attn.k_norm.weight"] = [hd]
        if layer.get("attention_bias"):  # vLLM's LlamaDecoderLayer: bias_o_proj = attention_bias (o_proj too)
            for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd), ("o_proj", h)):
                expected[p + f"self_attn.{proj}.bias"] = [rows]
    if config.get("norm_before_fc"):
        expected["input_norm.weight"] = [3 * target_h]
    if config.get("fc_norm"):
        for i in range(3):
            expected[f"fc_norm.{i}.weight"] = [target_h]
    return expected


def _eagle3_vocab_map(t: Tensors, vd: int, vocab: int, problems: list[str]) -> None:
    """d2t / t2d: present exactly when the draft vocab is reduced, int64 offsets onto distinct target ids."""
    if vd == vocab and "d2t" in t.info:
        problems.append(f"d2t is present but draft_vocab_size == vocab ({vocab}): vLLM >= 0.30 creates no "
                        "draft_id_to_target_id then and refuses to load the file; leave d2t and t2d out")
    elif "d2t" not in t.info:
        if vd < vocab:
            problems.append(f"d2t is missing but draft_vocab_size {vd} < vocab {vocab}: vLLM would map draft id i "
                            f"to target id i (garbage drafts, no error)")
    else:
        if t.dtype("d2t") != "I64":
            problems.append(f"d2t must be int64 offsets, got {t.dtype('d2t')}")
        if t.shape("d2t") != [vd]:
            problems.append(f"d2t has shape {t.shape('d2t')}, expected [{vd}] (draft_vocab_size)")
        else:
            ids = torch.arange(vd) + t.load("d2t").long()  # [Vd] target ids
            if bool((ids < 0).any() or (ids >= vocab).any()):
                problems.append(f"d2t offsets map draft ids outside the target vocab [0, {vocab})")
            elif int(torch.unique(ids).numel()) != vd:
                problems.append("d2t maps two draft ids to the same target id")
            elif "t2d" in t.info:
                t2d = t.load("t2d")
                if t.dtype("t2d") != "BOOL" or list(t2d.shape) != [vocab]:
                    problems.append(f"t2d must be bool [{vocab}], got {t.dtype('t2d')} {list(t2d.shape)}")
                elif int(t2d.sum()) != vd or not bool(t2d[ids].all()):
                    problems.append("t2d does not mark exactly the target ids that d2t maps to")


def validate_eagle3(config: dict, t: Tensors, target: dict | None, problems: list[str]) -> None:
    check_speculators_config(config, problems, "eagle3")
    layer = _eagle3_layer_config(config, problems)
    if layer is None:
        return
    h = int(layer["hidden_size"])
    vocab = int(layer["vocab_size"])
    vd = config.get("draft_vocab_size")
    if not is_int(vd) or vd < 1:
        problems.append(f"draft_vocab_size must be a positive int, got {vd!r}")
        return
    if vd > vocab:
        problems.append(f"draft_vocab_size {vd} exceeds the vocab size {vocab}")
    target_h = config.get("target_hidden_size") or h
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not all(is_int(i) and i >= 0 for i in aux):
        problems.append("eagle_aux_hidden_state_layer_ids must be a list of layer ids (else vLLM silently "
                        "falls back to (2, N//2, N-3))")
        aux = [0, 0, 0]
    elif len(aux) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids has {len(aux)} ids; vLLM builds fc for exactly 3 aux "
                        f"layers (load crash otherwise)")
    elif len(set(aux)) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids {aux} contains duplicates")
    elif aux != sorted(aux):
        problems.append(f"eagle_aux_hidden_state_layer_ids {aux} are not increasing: vLLM sorts them and feeds fc "
                        f"the taps in layer order, not the order this fc was trained on")

    no_model_prefix(t, problems)
    n_layers = int(layer["num_hidden_layers"])
    expected = _eagle3_expected_shapes(config, layer, vd, target_h)
    for name, shape in expected.items():
        expect_shape(t, name, shape, problems)
    optional = {"d2t", "t2d", "embed_tokens.weight"} | {f"layers.{i}.hidden_norm.weight" for i in range(n_layers)}
    unknown = sorted(k for k in t.info if k not in expected and k not in optional and not k.startswith("model."))
    unknown_tensors(unknown, problems)
    if "embed_tokens.weight" in t.info:
        expect_shape(t, "embed_tokens.weight", [vocab, h], problems)
    else:
        problems.append("embed_tokens.weight is missing: vLLM's speculators library (0.9) then drafts with an "
                        "all-zero embedding (vLLM itself would share the target's)")

    _eagle3_vocab_map(t, vd, vocab, problems)
    pairing_problems(target, vocab, target_h, "eagle_aux_hidden_state_layer_ids", aux, problems)


@register_format("eagle3")
def check_eagle3_export(config: dict, directory: Path, problems: list[str], deep: bool) -> None:
    check_weight_dir(config, directory, problems, deep, validate_eagle3)
