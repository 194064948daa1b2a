"""MTP in the form vLLM serves it: the module in a target checkpoint's native MTP slot (`method: mtp`).

- DeepSeek-V3 style targets (`DEEPSEEK_STYLE`): `model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm,
  shared_head.head, embed_tokens}` and the decoder block under `model.layers.{N}.*` (N = the target's layer count).
- Qwen3-Next / Qwen3.5 targets (`QWEN_NEXT_STYLE`): `mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.*,
  norm}`, their RMSNorms stored as w - 1 (zero-centred).
`slot_tensors` maps our names into a slot, `block_layout_problems` says why a trained block cannot fill one, and
`check_mtp_export` (registered as the family's vLLM format) checks a stitched checkpoint: `num_nextn_predict_layers`
(or `mtp_num_hidden_layers`) >= 1 and the slot's tensors present in the weight index. export/mtp_stitch.py writes
the checkpoint. Nothing here writes a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from speculators.models import register_format
from speculators.models.format_checks import Tensors, is_int

DEEPSEEK_STYLE = ("deepseek_v3", "deepseek_v32", "glm4_moe")  # the targets export stitches into
QWEN_NEXT_STYLE = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MTP_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_mtp", "glm4_moe", "glm4_moe_mtp", "ernie4_5_moe",
                      "mimo")  # the targets whose slot the check accepts
BLOCK_PREFIX = "layers.0."


def block_layout_problems(block: dict[str, torch.Tensor], target_shapes: dict[str, list[int]],
                          layer_prefix: str) -> list[str]:
    """Differences between the trained block (names relative to the layer) and the target's decoder layer."""
    theirs = {k[len(layer_prefix):]: v for k, v in target_shapes.items() if k.startswith(layer_prefix)}
    ours = {k: list(v.shape) for k, v in block.items()}
    problems = []
    only_ours, only_theirs = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if only_ours or only_theirs:
        problems.append(f"the trained MTP block has {only_ours[:3]} where the target's layers have "
                        f"{only_theirs[:3]}")
    problems += [f"{k}: trained {ours[k]} vs target {theirs[k]}" for k in sorted(set(ours) & set(theirs))
                 if ours[k] != theirs[k]]
    return problems


def slot_tensors(style: str, state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our MTP names -> the target family's native MTP slot names (layer index `num_layers` = N)."""
    block = {k[len(BLOCK_PREFIX):]: v for k, v in state.items() if k.startswith(BLOCK_PREFIX)}
    if style == "deepseek":
        p = f"model.layers.{num_layers}."
        out = {p + "enorm.weight": state["enorm.weight"], p + "hnorm.weight": state["hnorm.weight"],
               p + "eh_proj.weight": state["eh_proj.weight"],
               p + "shared_head.norm.weight": state["shared_head.norm.weight"],
               p + "shared_head.head.weight": state["shared_head.head.weight"],
               p + "embed_tokens.weight": state["embed_tokens.weight"]}
        out.update({p + k: v for k, v in block.items()})
        return out
    zc = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in block.items()}  # zero-centred RMSNorms
    out = {"mtp.fc.weight": state["eh_proj.weight"],
           "mtp.pre_fc_norm_embedding.weight": state["enorm.weight"] - 1.0,
           "mtp.pre_fc_norm_hidden.weight": state["hnorm.weight"] - 1.0,
           "mtp.norm.weight": state["shared_head.norm.weight"] - 1.0}
    out.update({"mtp.layers.0." + k: v for k, v in zc.items()})
    return out


@register_format("mtp")
def check_mtp_export(config: dict, directory: Path, problems: list[str], deep: bool) -> None:
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
    if model_type in QWEN_NEXT_STYLE:
        need = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight"]
    else:
        n = int(text["num_hidden_layers"])
        need = [f"model.layers.{n + i}.{part}" for i in range(n_mtp)
                for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
    missing = [k for k in need if k not in names]
    if missing:
        problems.append(f"MTP tensors missing from the stitched checkpoint: {', '.join(missing[:4])}")
