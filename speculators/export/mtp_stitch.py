"""MTP export: the trained module stitched into the target checkpoint's native MTP slot where vLLM serves one
(`method: mtp`; the slot's names and checks are models/mtp/mtp_format.py), otherwise a native directory that only the
bundled runtime serves — and the export says so.

- DeepSeek-V3 style targets (`model_type` deepseek_v3 / deepseek_v32 / glm4_moe): a copy of the target checkpoint
  (hard links where possible) plus `model-mtp.safetensors` holding `model.layers.{N}.{enorm, hnorm, eh_proj,
  shared_head.norm, shared_head.head, embed_tokens}` and the decoder block under `model.layers.{N}.*`, an updated
  `model.safetensors.index.json`, and `num_nextn_predict_layers: 1` in config.json.
- Qwen3-Next / Qwen3.5 targets: `mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.*, norm}` (their
  RMSNorms store w - 1: zero-centred), `num_nextn_predict_layers` / `mtp_num_hidden_layers: 1`.
  Stitching requires the trained block to have exactly the tensor layout of the target's own decoder layers
  (names and shapes); a Llama/Qwen3-layout block cannot fill a slot that holds an MLA or MoE layer, and the export
  refuses that in one line instead of writing a checkpoint vLLM would load with missing weights.
- Any other family (the house target is Llama): config.json + model.safetensors in our native layout, README.md
  and FORMAT note stating that vLLM cannot serve it and `launch.sh` running the bundled runtime.

This module writes into a directory the caller provides (export.py's `run` makes it atomic).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speculators.core.atomic import write_json_atomic, write_text_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import draft_revision, pairing_record
from speculators.core.recipes import to_dict
from speculators.core.target import text_config
from speculators.evaluate.report import render_markdown
from speculators.export.validate import validate_vllm_export
from speculators.export.vllm import (
    _DTYPES,
    config_k,
    evaluation_for,
    evaluation_summary,
    export_config,
    export_tensors,
    probe_features,
    readme,
    round_trip,
    verifier_name,
    write_weights,
)
from speculators.models.io import load_speculator, target_weights
from speculators.models.mtp.mtp_format import (
    BLOCK_PREFIX,
    DEEPSEEK_STYLE,
    QWEN_NEXT_STYLE,
    block_layout_problems,
    slot_tensors,
)

MTP_SHARD = "model-mtp.safetensors"


def _text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _target_tensor_shapes(target_dir: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                shapes[k] = list(fh.get_slice(k).get_shape())
    return shapes


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stitch(spec: Any, target_dir: Path, out_dir: Path, dtype: torch.dtype) -> dict:
    """Copy the target checkpoint into `out_dir` and add the trained module in its native MTP slot."""
    config = json.loads((target_dir / "config.json").read_text())
    text = _text_config(config)
    model_type = text.get("model_type") or config.get("model_type")
    style = "deepseek" if model_type in DEEPSEEK_STYLE else "qwen_next"
    n = int(text["num_hidden_layers"])
    if len(spec.layers) != 1:
        raise SpeculatorsError(f"{model_type}'s MTP slot holds one decoder block; the trained MTP module has "
                               f"{len(spec.layers)} (speculator.num_layers=1 to stitch)")
    shapes = _target_tensor_shapes(target_dir)
    state = {k: v.detach().cpu().float() for k, v in spec.state_dict().items()}
    block = {k[len(BLOCK_PREFIX):]: v for k, v in state.items() if k.startswith(BLOCK_PREFIX)}
    layer_prefix = f"model.layers.{n - 1}."  # the last layer (full attention in Qwen3-Next's 3:1 layout)
    problems = block_layout_problems(block, shapes, layer_prefix)
    if problems:
        raise SpeculatorsError(f"cannot stitch the MTP module into {model_type}'s MTP slot: its decoder block does "
                               f"not have the target's layer layout ({problems[0]}); this toolkit's MTP block is a "
                               f"dense Llama-style layer and vLLM would load it with missing weights, so this "
                               f"target gets no MTP export")
    for f in target_dir.iterdir():
        if f.is_file() and f.name not in ("pairing.json", "README.md", "launch.sh"):
            _link_or_copy(f, out_dir / f.name)
    tensors = {k: v.to(dtype).contiguous() for k, v in slot_tensors(style, state, n).items()}
    save_file(tensors, str(out_dir / MTP_SHARD), metadata={"format": "pt", "family": "mtp"})
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        index = {"metadata": {}, "weight_map": {k: f.name for f in sorted(target_dir.glob("*.safetensors"))
                                                for k in _target_tensor_shapes_of(f)}}
    stale = [k for k in index["weight_map"] if k in tensors]
    for k in stale:  # an MTP slot the target already had is replaced by the trained one
        del index["weight_map"][k]
    index["weight_map"].update({k: MTP_SHARD for k in tensors})
    index.setdefault("metadata", {})["total_size"] = sum(
        f.stat().st_size for f in out_dir.glob("*.safetensors"))
    write_json_atomic(out_dir / "model.safetensors.index.json", index)
    key = "mtp_num_hidden_layers" if model_type in ("qwen3_5", "qwen3_5_moe") else "num_nextn_predict_layers"
    text[key] = 1
    write_json_atomic(out_dir / "config.json", config)
    return {"style": style, "model_type": model_type, "layer": n, "tensors": sorted(tensors), "replaced": stale}


def _target_tensor_shapes_of(f: Path) -> list[str]:
    with safe_open(str(f), framework="pt") as fh:
        return list(fh.keys())


NATIVE_NOTE = ("vLLM cannot serve this MTP module: vLLM loads MTP heads only from the target checkpoint of "
               "families with a native MTP slot (DeepSeek-V3 style, Qwen3-Next, Qwen3.5), and {model_type} has "
               "none. Only the bundled runtime (`speculators serve` / `speculators generate`) serves this directory.")


def export_mtp(recipe: Recipe, ckpt: Path, family: str, target: Any, fingerprint: dict, out_dir: Path) -> dict:
    """Write the MTP export of `ckpt` into `out_dir` (stitched or native); returns the pairing record."""
    weights = target_weights(target.model)
    spec = load_speculator(ckpt, weights).float().eval()
    dtype = _DTYPES[recipe.export.dtype]
    model_type = str(getattr(text_config(target.model.config), "model_type", "unknown"))
    report, selection = evaluation_for(recipe, ckpt)
    summary = evaluation_summary(report, selection, ckpt)
    target_dir = Path(recipe.target.name_or_path)
    tgt = verifier_name(recipe)
    if model_type in DEEPSEEK_STYLE + QWEN_NEXT_STYLE:
        if not target_dir.is_dir():
            raise SpeculatorsError(f"stitching an MTP module needs the target checkpoint on disk; "
                                   f"{recipe.target.name_or_path} is not a local directory (download it first)")
        info = stitch(spec, target_dir, out_dir, dtype)
        problems = validate_vllm_export(out_dir)
        if problems:
            raise SpeculatorsError(f"stitched MTP export is not vLLM-loadable: {'; '.join(problems[:3])}")
        k = config_k(spec, recipe)  # the recipe's: MTP fixes no k
        section = "\n".join([
            "## Serving with vLLM", "", "This directory is the target checkpoint with the trained MTP module in "
            f"its native slot (`{info['tensors'][0].rsplit('.', 2)[0]}...`).", "", "```bash",
            f"vllm serve <export_dir> --speculative-config '{json.dumps({'method': 'mtp', 'num_speculative_tokens': k})}'",
            "```", ""])
        write_text_atomic(out_dir / "launch.sh", "\n".join([
            "#!/usr/bin/env bash", "# Serve the target with its stitched MTP module in vLLM.", "set -euo pipefail",
            'EXPORT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', f'K="${{K:-{k}}}"',
            'exec vllm serve "$EXPORT_DIR" --speculative-config "{\\"method\\": \\"mtp\\", '
            '\\"num_speculative_tokens\\": $K}" "$@"', ""]))
        kind, loadable, method, extra = "mtp-stitched", True, "mtp", ""
    else:
        tensors, records = export_tensors(spec, weights, dtype)
        config = export_config(spec, "mtp", recipe, fingerprint, records, ckpt, recipe.export.dtype)
        config["speculators_native"]["export"]["vllm"] = NATIVE_NOTE.format(model_type=model_type)
        write_weights(out_dir, tensors, "mtp")
        write_json_atomic(out_dir / "config.json", config)
        problems = round_trip(out_dir, spec, tensors, weights, probe_features(target.model, spec))
        if problems:
            raise SpeculatorsError(f"export of {ckpt} failed its round trip: {'; '.join(problems[:3])}")
        k = int(recipe.serve.tree.depth)
        extra = "**" + NATIVE_NOTE.format(model_type=model_type) + "**"
        section = "\n".join(["## Serving", "", "```bash",
                             f"speculators serve --target {tgt} --speculator <export_dir>", "```", ""])
        write_text_atomic(out_dir / "launch.sh", "\n".join([
            "#!/usr/bin/env bash", f"# {NATIVE_NOTE.format(model_type=model_type)}", "set -euo pipefail",
            'EXPORT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', f'TARGET="${{TARGET:-{tgt}}}"',
            'exec speculators serve --target "$TARGET" --speculator "$EXPORT_DIR" "$@"', ""]))
        kind, loadable, method = "mtp-native", False, "bundled-runtime"
    os.chmod(out_dir / "launch.sh", 0o755)
    write_text_atomic(out_dir / "README.md", readme(recipe, "mtp", ckpt, summary, section, extra))
    write_json_atomic(out_dir / "report.json", {"format": "speculators.export/v1", "source_checkpoint": str(ckpt),
                                                "evaluation": report, "launch": {"k": k, "kind": kind}})

    write_text_atomic(out_dir / "report.md", (render_markdown(report) if report else
                                              "# Acceptance report\n\nThe exported checkpoint was not evaluated.")
                      + "\n")
    return pairing_record(target=fingerprint, family=family, layer_ids=None, draft_dir=out_dir,
                          recipe=to_dict(recipe), evaluation=summary,
                          extra={"export": {"format": "speculators.export/v1", "kind": kind,
                                            "source_checkpoint": str(ckpt), "source_revision": draft_revision(ckpt),
                                            "vllm_method": method, "vllm_loadable": loadable, "launch_k": k,
                                            "vllm_served": spec.VLLM_SERVED}})
