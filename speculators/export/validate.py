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

The EAGLE-3 rules are in eagle3_format.py, DFlash's in dflash_format.py, the shared checks (weight headers,
dtypes, pairing) in format_checks.py; this module detects the format, checks Medusa and stitched MTP, and runs the
rest. It reads files only; it never loads a model or writes anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from speculators.export.dflash_format import validate_dflash
from speculators.export.eagle3_format import validate_eagle3
from speculators.export.format_checks import Tensors, check_floats, expect_shape, is_int, pairing_target, read_json

MTP_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_mtp", "glm4_moe", "glm4_moe_mtp", "ernie4_5_moe",
                      "mimo")
MTP_QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


# ----------------------------------------------------------------------------------------------------------------
# Medusa (vLLM's own HF format)


def _validate_medusa(config: dict, t: Tensors, target: dict | None, problems: list[str]) -> None:
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if not is_int(config.get(key)) or config[key] < (0 if key == "num_hidden_layers" else 1):
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
        expect_shape(t, name, shape, problems)
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
    if not is_int(n_mtp) or n_mtp < 1:
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
        names = set(Tensors(directory, problems).info)
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
    config = read_json(d / "config.json", problems)
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
    tensors = Tensors(d, problems)
    if not tensors.files:
        problems.append(f"no *.safetensors weight file in {d}")
        return problems
    target = pairing_target(d)
    if kind == "eagle3":
        validate_eagle3(config, tensors, target, problems)
    elif kind == "dflash":
        validate_dflash(config, tensors, target, problems)
    else:
        _validate_medusa(config, tensors, target, problems)
    check_floats(tensors, config, problems, deep)
    return problems
