"""DFlash in the vLLM speculators format (vLLM's `dflash` method, DFlashQwen3ForCausalLM; docs/dflash.md §4): qwen3
full-attention layers, the tap ids, the block fields (mask token, block size = k + 1, bidirectional blocks) and every
tensor name and shape.

`validate_dflash(config, tensors, target, problems)` appends one line per problem; `check_dflash_export` (registered
as the family's vLLM format) runs it with the checks every weight-file format shares (format_checks.py). It does not
detect the format (export/validate.py) and never writes anything.
"""

from __future__ import annotations

from pathlib import Path

from speculators.models import register_format
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


def _dflash_expected_shapes(layer: dict, n_taps: int, target_h: int) -> dict[str, list[int]]:
    """Every tensor name vLLM's DFlashQwen3ForCausalLM loads (target-shared embed_tokens / lm_head aside)."""
    h, n_layers = int(layer["hidden_size"]), int(layer["num_hidden_layers"])
    heads, kv = int(layer["num_attention_heads"]), int(layer["num_key_value_heads"])
    hd, inter = int(layer.get("head_dim") or h // heads), int(layer["intermediate_size"])
    expected = {"fc.weight": [h, n_taps * target_h], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(n_layers):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [heads * hd, h], p + "self_attn.k_proj.weight": [kv * hd, h],
            p + "self_attn.v_proj.weight": [kv * hd, h], p + "self_attn.o_proj.weight": [h, heads * hd],
            p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter], p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h]})
        if layer.get("attention_bias"):
            for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd), ("o_proj", h)):
                expected[p + f"self_attn.{proj}.bias"] = [rows]
    return expected


def _dflash_block(config: dict, vocab: int, problems: list[str]) -> None:
    """The block fields: mask token, block size = k + 1, bidirectional blocks drafted from the mask slots."""
    mask = config.get("mask_token_id")
    if not is_int(mask) or not 0 <= mask < vocab:
        problems.append(f"mask_token_id must be a token id in [0, {vocab}) (vLLM embeds it in every mask slot), "
                        f"got {mask!r}")
    block = config.get("block_size")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if not is_int(block) or block < 2:
        problems.append(f"block_size must be an int >= 2, got {block!r}")
    elif is_int(k) and k != block - 1:
        problems.append(f"speculative_tokens {k} != block_size - 1 = {block - 1}: vLLM would run a block of "
                        f"{k + 1} slots, whose laws the drafter was not trained on")
    if config.get("sample_from_anchor") is not False:
        problems.append("sample_from_anchor must be written as false (DFlash drafts from the mask slots)")
    if config.get("sliding_window_non_causal") is not True:
        problems.append("sliding_window_non_causal must be true: vLLM 0.32 makes every layer causal inside the "
                        "block otherwise (the drafter was trained with bidirectional blocks)")


def validate_dflash(config: dict, t: Tensors, target: dict | None, problems: list[str]) -> None:
    check_speculators_config(config, problems, "dflash")
    layer = check_layer_config(config, problems)
    if layer is None:
        return
    if layer["model_type"] != "qwen3":
        problems.append(f"transformer_layer_config.model_type is {layer['model_type']!r}; vLLM's DFlash drafter "
                        "is DFlashQwen3ForCausalLM (qwen3 layers)")
    if "rope_theta" not in layer and "rope_parameters" not in layer:
        problems.append("transformer_layer_config has no rope settings (vLLM defaults DFlash to rope_theta 1e6)")
    if set(layer.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        problems.append(f"transformer_layer_config.layer_types {layer.get('layer_types')} must be all "
                        "full_attention (the CPU V1 proposer has no mixed sliding-window DFlash)")
    h, vocab = int(layer["hidden_size"]), int(layer["vocab_size"])
    if config.get("draft_vocab_size") not in (None, vocab) or "d2t" in t.info:
        problems.append("a DFlash export drafts over the full target vocab: draft_vocab_size must equal vocab_size "
                        "and no d2t is shipped")
    target_h = config.get("target_hidden_size") or h
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(is_int(i) and i >= 0 for i in aux):
        problems.append("aux_hidden_state_layer_ids must be a non-empty list of layer ids (vLLM requires it)")
        aux = []
    elif aux != sorted(set(aux)):
        problems.append(f"aux_hidden_state_layer_ids {aux} must be increasing and distinct (vLLM concatenates the "
                        "taps in layer order)")
    _dflash_block(config, vocab, problems)
    no_model_prefix(t, problems)
    expected = _dflash_expected_shapes(layer, len(aux), target_h)
    for name, shape in expected.items():
        expect_shape(t, name, shape, problems)
    if "mask_hidden" in t.info:
        problems.append("mask_hidden is shipped: vLLM 0.32 asserts that a DFlash checkpoint has none")
    optional = {"embed_tokens.weight": [vocab, h], "lm_head.weight": [vocab, h]}
    for name, shape in optional.items():
        if name in t.info:
            expect_shape(t, name, shape, problems)
    unknown = sorted(k for k in t.info if k not in expected and k not in optional and k != "mask_hidden"
                     and not k.startswith("model."))
    unknown_tensors(unknown, problems)
    pairing_problems(target, vocab, target_h, "aux_hidden_state_layer_ids", aux, problems)


@register_format("dflash")
def check_dflash_export(config: dict, directory: Path, problems: list[str], deep: bool) -> None:
    check_weight_dir(config, directory, problems, deep, validate_dflash)
