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

Each family's rules are its vLLM format module, `models/<family>/<family>_format.py` (registered in
`models.VLLM_FORMATS`), the shared checks (weight headers, dtypes, pairing) in models/format_checks.py; this module
detects the family from config.json (`models.family_of`, the one reader) and runs its check. It reads files only; it
never loads a model or writes anything.
"""

from __future__ import annotations

from pathlib import Path

from speculators.core.errors import SpeculatorsError
from speculators.models import VLLM_FORMATS, family_of
from speculators.models.format_checks import read_json_or_note


def export_kind(config: dict) -> str:
    """'eagle3' / 'dflash' (speculators format), 'medusa', 'mtp' (stitched target), 'mtp-native' or 'unknown'."""
    try:
        family = family_of(config, native=False)
    except SpeculatorsError:
        return "unknown"
    return "mtp-native" if family == "mtp" and config.get("mtp_layout") is not None else family


def validate_vllm_export(directory: str | Path, *, deep: bool = True) -> list[str]:
    """Every problem that would stop vLLM from loading (or silently degrade) the exported directory."""
    d = Path(directory)
    problems: list[str] = []
    if not d.is_dir():
        return [f"{d} is not a directory"]
    config = read_json_or_note(d / "config.json", problems)
    if config is None:
        return problems
    kind = export_kind(config)
    if kind == "mtp-native":
        return ["a native MTP directory (mtp_layout): vLLM serves MTP only from a target checkpoint with a native "
                "MTP slot; only the bundled runtime serves this directory"]
    if kind == "unknown":
        return ["config.json is neither the speculators format, vLLM's Medusa format nor a stitched MTP checkpoint"]
    VLLM_FORMATS[kind](config, d, problems, deep)
    return problems
