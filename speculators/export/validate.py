"""Format validator for exported directories: every rule vLLM's loader applies, checked before anybody serves.

`validate_vllm_export(dir) -> list[str]` returns one line per problem ([] = loadable). It detects the format from
config.json:
- speculators format (EAGLE-3): vLLM routes a config to its speculators path only when the top-level `model_type`
  is absent (or "speculators") and `speculators_config` is present; it then requires `speculators_model_type`,
  `speculators_config.proposal_methods[0].speculative_tokens`, `speculators_config.verifier.name_or_path` and a
  `transformer_layer_config` dict whose `model_type` maps to an architecture (llama -> Eagle3LlamaForCausalLM,
  qwen3 -> Eagle3Qwen3ForCausalLM). The loader builds `fc` with 3 * target_hidden inputs (3 aux layers unless the
  config nests `eagle_config`), an lm_head of `draft_vocab_size` rows, a `draft_id_to_target_id` [Vd] int64 buffer
  from `d2t` only when draft_vocab_size < vocab (silently zero when absent -> garbage drafts; vLLM >= 0.30 refuses
  a `d2t` when the vocabularies are equal), prefixes every weight but `lm_head` with `model.` (so a
  `model.`-prefixed checkpoint does not load) and fails on unknown parameter names.
- DFlash (speculators format, `speculators_model_type: "dflash"`): qwen3 `transformer_layer_config` (full
  attention), `aux_hidden_state_layer_ids` (fc width = n taps x target hidden), `mask_token_id`, `block_size` =
  speculative_tokens + 1, `sample_from_anchor: false`, `sliding_window_non_causal: true` (vLLM 0.32 makes every
  layer causal in-block otherwise), `fc`, `hidden_norm`, qwen3 layers, `norm`; the target's embed_tokens /
  lm_head optional; no `mask_hidden`, no d2t.
- Medusa (`model_type: "medusa"`): `num_heads` x `num_hidden_layers` ResBlocks `blocks.{h}.layers.{l}.weight`
  [H, H] (+bias iff `medusa_fc_bias`) and `lm_heads.{h}.weight` [V, H].
- MTP stitched into a target (`num_nextn_predict_layers` >= 1): DeepSeek-style `model.layers.{N+i}.{enorm, hnorm,
  eh_proj, shared_head.norm, shared_head.head}` present in the weight index.
Also: float tensors finite and in the dtype config.json declares; when `pairing.json` is present, the shapes and
layer ids agree with the target it records.

This module reads files only; it never loads a model or writes anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

EAGLE3_ARCHS = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings")
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FLOAT = ("BF16", "F16", "F32", "F64")
MTP_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_mtp", "glm4_moe", "glm4_moe_mtp", "ernie4_5_moe",
                      "mimo")
MTP_QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


class _Tensors:
    """Header view of every *.safetensors file in a directory: name -> (dtype, shape, file)."""

    def __init__(self, directory: Path, problems: list[str]) -> None:
        self.info: dict[str, tuple[str, list[int], Path]] = {}
        self.files = sorted(directory.glob("*.safetensors"))
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        sl = fh.get_slice(k)
                        if k in self.info:
                            problems.append(f"tensor {k} appears in two weight files ({self.info[k][2].name}, {f.name})")
                        self.info[k] = (str(sl.get_dtype()), list(sl.get_shape()), f)
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
                problems.append(f"{f.name} is not a readable safetensors file ({str(exc).splitlines()[0]})")

    def load(self, name: str) -> Any:
        with safe_open(str(self.info[name][2]), framework="pt") as fh:
            return fh.get_tensor(name)

    def shape(self, name: str) -> list[int] | None:
        return self.info[name][1] if name in self.info else None

    def dtype(self, name: str) -> str | None:
        return self.info[name][0] if name in self.info else None


def _read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.is_file():
        problems.append(f"{path.name} is missing from {path.parent}")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{path.name} is not valid JSON ({exc})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} must be a JSON object")
        return None
    return data


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expect_shape(t: _Tensors, name: str, shape: list[int], problems: list[str]) -> None:
    got = t.shape(name)
    if got is None:
        problems.append(f"missing tensor {name} (expected shape {shape})")
    elif got != shape:
        problems.append(f"tensor {name} has shape {got}, expected {shape}")


def _check_floats(t: _Tensors, config: dict, problems: list[str], deep: bool) -> None:
    want = _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or ""))
    floats = [k for k, (dt, _, _) in t.info.items() if dt in _FLOAT]
    kinds = sorted({t.dtype(k) for k in floats})
    if len(kinds) > 1:
        problems.append(f"float tensors mix dtypes {kinds}; export them in one dtype")
    if want and kinds and kinds != [want]:
        problems.append(f"config.json declares dtype {config.get('dtype') or config.get('torch_dtype')} but the "
                        f"float tensors are {kinds}")
    if deep:
        for k in floats:
            if not bool(torch.isfinite(t.load(k)).all()):
                problems.append(f"tensor {k} contains NaN or Inf")


def _pairing_target(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "pairing.json").read_text()).get("target")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-3 in the vLLM speculators format


def _speculators_config(config: dict, problems: list[str], algorithm: str) -> None:
    """speculators_model_type and speculators_config: what vLLM reads first."""
    sc = config.get("speculators_config")
    smt = config.get("speculators_model_type")
    if smt is None:
        problems.append("config.json lacks speculators_model_type (vLLM requires it)")
    elif smt != algorithm:
        problems.append(f"speculators_model_type is {smt!r}; this exporter writes and checks {algorithm!r}")
    if not isinstance(sc, dict):
        problems.append("speculators_config must be a mapping")
        sc = {}
    if sc.get("algorithm") != algorithm:
        problems.append(f"speculators_config.algorithm is {sc.get('algorithm')!r}, expected {algorithm!r}")
    methods = sc.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        problems.append("speculators_config.proposal_methods must be a non-empty list (vLLM reads "
                        "proposal_methods[0].speculative_tokens)")
    else:
        k = methods[0].get("speculative_tokens")
        if not _is_int(k) or k < 1:
            problems.append(f"speculators_config.proposal_methods[0].speculative_tokens must be an int >= 1, got {k!r}")
        if sc.get("default_proposal_method") != methods[0].get("proposal_type"):
            problems.append("speculators_config.default_proposal_method must name proposal_methods[0] "
                            f"({methods[0].get('proposal_type')!r}), got {sc.get('default_proposal_method')!r}")
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict) or not isinstance(verifier.get("name_or_path"), str) \
            or not verifier.get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vLLM serves it as the target)")
    elif not isinstance(verifier.get("architectures"), list) or not verifier["architectures"]:
        problems.append("speculators_config.verifier.architectures must list the target's architectures")


def _layer_config(config: dict, problems: list[str]) -> dict | None:
    """transformer_layer_config with every key vLLM reads; None (and the problem) when unusable."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("transformer_layer_config must be a mapping (it becomes the draft's HF config in vLLM)")
        return None
    missing = [k for k in LAYER_KEYS if k not in layer]
    if missing:
        problems.append(f"transformer_layer_config lacks {', '.join(missing)}")
        return None
    return layer


def _eagle3_layer_config(config: dict, problems: list[str]) -> dict | None:
    """transformer_layer_config (the draft's HF config in vLLM) and the norm flags; None when unusable."""
    layer = _layer_config(config, problems)
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


def _eagle3_vocab_map(t: _Tensors, vd: int, vocab: int, problems: list[str]) -> None:
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


def _validate_eagle3(config: dict, t: _Tensors, target: dict | None, problems: list[str]) -> None:
    _speculators_config(config, problems, "eagle3")
    layer = _eagle3_layer_config(config, problems)
    if layer is None:
        return
    h = int(layer["hidden_size"])
    vocab = int(layer["vocab_size"])
    vd = config.get("draft_vocab_size")
    if not _is_int(vd) or vd < 1:
        problems.append(f"draft_vocab_size must be a positive int, got {vd!r}")
        return
    if vd > vocab:
        problems.append(f"draft_vocab_size {vd} exceeds the vocab size {vocab}")
    target_h = config.get("target_hidden_size") or h
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not all(_is_int(i) and i >= 0 for i in aux):
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

    _no_model_prefix(t, problems)
    n_layers = int(layer["num_hidden_layers"])
    expected = _eagle3_expected_shapes(config, layer, vd, target_h)
    for name, shape in expected.items():
        _expect_shape(t, name, shape, problems)
    optional = {"d2t", "t2d", "embed_tokens.weight"} | {f"layers.{i}.hidden_norm.weight" for i in range(n_layers)}
    unknown = sorted(k for k in t.info if k not in expected and k not in optional and not k.startswith("model."))
    _unknown_tensors(unknown, problems)
    if "embed_tokens.weight" in t.info:
        _expect_shape(t, "embed_tokens.weight", [vocab, h], problems)
    else:
        problems.append("embed_tokens.weight is missing: vLLM's speculators library (0.9) then drafts with an "
                        "all-zero embedding (vLLM itself would share the target's)")

    _eagle3_vocab_map(t, vd, vocab, problems)
    _pairing_problems(target, vocab, target_h, "eagle_aux_hidden_state_layer_ids", aux, problems)


def _unknown_tensors(unknown: list[str], problems: list[str]) -> None:
    if unknown:
        problems.append(f"unexpected tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''}; vLLM's loader "
                        f"fails on parameter names it does not know")


def _pairing_problems(target: dict | None, vocab: int, target_h: int, aux_key: str, aux: list[int],
                      problems: list[str]) -> None:
    """The export's vocab, fc width and tap ids against the target pairing.json records (nothing without one)."""
    if not target:
        return
    if int(target.get("vocab_size", vocab)) != vocab:
        problems.append(f"transformer_layer_config.vocab_size {vocab} differs from the target's "
                        f"{target.get('vocab_size')} (pairing.json)")
    if int(target.get("hidden_size", target_h)) != target_h:
        problems.append(f"fc expects target hidden {target_h} but the target has {target.get('hidden_size')}")
    n = target.get("num_layers")
    if n is not None and any(i >= int(n) for i in aux):
        problems.append(f"{aux_key} {aux} out of range for a {n}-layer target")


def _no_model_prefix(t: _Tensors, problems: list[str]) -> None:
    bad_prefix = sorted(k for k in t.info if k.startswith("model."))
    if bad_prefix:
        problems.append(f"weights carry a 'model.' prefix ({bad_prefix[0]} ...); vLLM adds it itself, so they "
                        f"would not load")


# ----------------------------------------------------------------------------------------------------------------
# DFlash in the vLLM speculators format (vLLM's `dflash` method, DFlashQwen3ForCausalLM; docs/dflash.md §4)


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
    if not _is_int(mask) or not 0 <= mask < vocab:
        problems.append(f"mask_token_id must be a token id in [0, {vocab}) (vLLM embeds it in every mask slot), "
                        f"got {mask!r}")
    block = config.get("block_size")
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if not _is_int(block) or block < 2:
        problems.append(f"block_size must be an int >= 2, got {block!r}")
    elif _is_int(k) and k != block - 1:
        problems.append(f"speculative_tokens {k} != block_size - 1 = {block - 1}: vLLM would run a block of "
                        f"{k + 1} slots, whose laws the drafter was not trained on")
    if config.get("sample_from_anchor") is not False:
        problems.append("sample_from_anchor must be written as false (DFlash drafts from the mask slots)")
    if config.get("sliding_window_non_causal") is not True:
        problems.append("sliding_window_non_causal must be true: vLLM 0.32 makes every layer causal inside the "
                        "block otherwise (the drafter was trained with bidirectional blocks)")


def _validate_dflash(config: dict, t: _Tensors, target: dict | None, problems: list[str]) -> None:
    _speculators_config(config, problems, "dflash")
    layer = _layer_config(config, problems)
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
    if not isinstance(aux, list) or not aux or not all(_is_int(i) and i >= 0 for i in aux):
        problems.append("aux_hidden_state_layer_ids must be a non-empty list of layer ids (vLLM requires it)")
        aux = []
    elif aux != sorted(set(aux)):
        problems.append(f"aux_hidden_state_layer_ids {aux} must be increasing and distinct (vLLM concatenates the "
                        "taps in layer order)")
    _dflash_block(config, vocab, problems)
    _no_model_prefix(t, problems)
    expected = _dflash_expected_shapes(layer, len(aux), target_h)
    for name, shape in expected.items():
        _expect_shape(t, name, shape, problems)
    if "mask_hidden" in t.info:
        problems.append("mask_hidden is shipped: vLLM 0.32 asserts that a DFlash checkpoint has none")
    optional = {"embed_tokens.weight": [vocab, h], "lm_head.weight": [vocab, h]}
    for name, shape in optional.items():
        if name in t.info:
            _expect_shape(t, name, shape, problems)
    unknown = sorted(k for k in t.info if k not in expected and k not in optional and k != "mask_hidden"
                     and not k.startswith("model."))
    _unknown_tensors(unknown, problems)
    _pairing_problems(target, vocab, target_h, "aux_hidden_state_layer_ids", aux, problems)


# ----------------------------------------------------------------------------------------------------------------
# Medusa (vLLM's own HF format)


def _validate_medusa(config: dict, t: _Tensors, target: dict | None, problems: list[str]) -> None:
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if not _is_int(config.get(key)) or config[key] < (0 if key == "num_hidden_layers" else 1):
            problems.append(f"medusa config.json needs an integer {key}, got {config.get(key)!r}")
    if problems:
        return
    if not isinstance(config.get("medusa_fc_bias", False), bool):
        problems.append("medusa_fc_bias must be true/false")
    h, vocab = config["hidden_size"], config["vocab_size"]
    rows = config.get("truncated_vocab_size") or vocab
    bias = bool(config.get("medusa_fc_bias", False))
    expected: dict[str, list[int]] = {}
    for head in range(config["num_heads"]):
        for layer in range(config["num_hidden_layers"]):
            expected[f"blocks.{head}.layers.{layer}.weight"] = [h, h]
            if bias:
                expected[f"blocks.{head}.layers.{layer}.bias"] = [h]
        expected[f"lm_heads.{head}.weight"] = [rows, h]
    if rows != vocab:
        expected["token_map"] = [rows]
    for name, shape in expected.items():
        _expect_shape(t, name, shape, problems)
    unknown = sorted(k for k in t.info if k not in expected)
    if unknown:
        problems.append(f"unexpected tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''}; vLLM's Medusa "
                        f"loader fails on parameter names it does not know")
    if target:
        if int(target.get("vocab_size", vocab)) != vocab:
            problems.append(f"medusa vocab_size {vocab} differs from the target's {target.get('vocab_size')}")
        if int(target.get("hidden_size", h)) != h:
            problems.append(f"medusa hidden_size {h} differs from the target's {target.get('hidden_size')}")


# ----------------------------------------------------------------------------------------------------------------
# MTP stitched into a target checkpoint


def _validate_mtp(config: dict, directory: Path, problems: list[str]) -> None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = text.get("model_type") or config.get("model_type")
    n_mtp = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers")
    if not _is_int(n_mtp) or n_mtp < 1:
        problems.append("num_nextn_predict_layers must be an int >= 1 in a stitched MTP export")
        return
    names: set[str] = set()
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as exc:
            problems.append(f"model.safetensors.index.json is not valid JSON ({exc})")
            return
        names = set(weight_map)
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                problems.append(f"the weight index names {shard}, which is missing")
    else:
        names = set(_Tensors(directory, problems).info)
    if model_type in MTP_QWEN_TYPES:
        need = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight"]
    else:
        n = int(text["num_hidden_layers"])
        need = [f"model.layers.{n + i}.{part}" for i in range(n_mtp)
                for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
    missing = [k for k in need if k not in names]
    if missing:
        problems.append(f"MTP tensors missing from the stitched checkpoint: {', '.join(missing[:4])}")


# ----------------------------------------------------------------------------------------------------------------


def export_kind(config: dict) -> str:
    """'eagle3' / 'dflash' (speculators format), 'medusa', 'mtp' (stitched target), 'mtp-native' or 'unknown'."""
    if config.get("speculators_config") is not None or config.get("speculators_model_type") is not None:
        return "dflash" if config.get("speculators_model_type") == "dflash" else "eagle3"
    if config.get("model_type") == "medusa":
        return "medusa"
    if config.get("mtp_layout") is not None:
        return "mtp-native"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers"):
        return "mtp"
    return "unknown"


def validate_vllm_export(directory: str | Path, *, deep: bool = True) -> list[str]:
    """Every problem that would stop vLLM from loading (or silently degrade) the exported directory."""
    d = Path(directory)
    problems: list[str] = []
    if not d.is_dir():
        return [f"{d} is not a directory"]
    config = _read_json(d / "config.json", problems)
    if config is None:
        return problems
    kind = export_kind(config)
    if kind == "mtp-native":
        return ["a native MTP directory (mtp_layout): vLLM serves MTP only from a target checkpoint with a native "
                "MTP slot; only the bundled runtime serves this directory"]
    if kind == "unknown":
        return ["config.json is neither the speculators format, vLLM's Medusa format nor a stitched MTP checkpoint"]
    if kind == "mtp":
        _validate_mtp(config, d, problems)
        return problems
    if config.get("model_type") not in (None, "speculators", "medusa"):
        problems.append(f"top-level model_type {config['model_type']!r} must be absent: vLLM would route this "
                        f"directory to the plain {config['model_type']} model")
    if kind in ("eagle3", "dflash") and config.get("model_type") == "medusa":
        problems.append("config.json mixes the speculators format with model_type 'medusa'")
    tensors = _Tensors(d, problems)
    if not tensors.files:
        problems.append(f"no *.safetensors weight file in {d}")
        return problems
    target = _pairing_target(d)
    if kind == "eagle3":
        _validate_eagle3(config, tensors, target, problems)
    elif kind == "dflash":
        _validate_dflash(config, tensors, target, problems)
    else:
        _validate_medusa(config, tensors, target, problems)
    _check_floats(tensors, config, problems, deep)
    return problems
