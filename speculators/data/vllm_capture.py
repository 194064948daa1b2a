"""`capture.backend: vllm`: the target's hidden states computed by vLLM, the engine users serve big targets with.

`VllmFeatures(job, request)` takes the recipe's vLLM engine (vllm_engine.py: vLLM's `extract_hidden_states`
speculative method with a synchronous hidden-states connector, shared with `data.regenerate.backend: vllm`) and,
per shard, sends it the rows as token-id prompts; it returns, per row, the same float32 features the Hugging Face
path computes
(`features.compute_features`), so capture.py encodes, validates and writes them through one path:

- "taps" [T, n_taps * H]: vLLM's hidden states at the recipe's layer ids (id k = the residual entering layer k,
  what `target.TapRecorder` records), in the recipe's order;
- "last_hidden" [T, H]: vLLM's layer-N output (before the final norm) through the target's own final norm, loaded
  alone from the checkpoint (`load_final_norm`);
- the top-k teacher ("teacher_topk_ids" / "teacher_topk_logprobs" [T, k]) from vLLM's prompt log-probs (position
  t's next-token law is vLLM's log-prob row of position t + 1; the last position's is the generated token's).

vLLM's token ids are checked against the rows sent; vLLM's own files and the exchange directory are removed. This
module never imports vLLM (its environment pins other versions) and writes no shard (capture.py does).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from speculators.core.config import TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.target import final_norm, load_target
from speculators.data.capture_job import Job
from speculators.data.vllm_engine import engine_for, release


def _checkpoint_tensor(directory: Path, key: str) -> torch.Tensor | None:
    """One tensor of a local safetensors checkpoint (sharded or not), or None when it is not there."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        name = json.loads(index.read_text()).get("weight_map", {}).get(key)
        files = [directory / name] if name else []
    else:
        files = sorted(directory.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key)
    return None


def _from_checkpoint(cfg: TargetConfig, pick: Callable[[torch.nn.Module], torch.nn.Module],
                     aliases: Callable[[torch.nn.Module], dict[str, str]] | None = None) -> torch.nn.Module:
    """`pick(model)` of the target with its weights, built from the config on the meta device and filled from the
    checkpoint alone (a 70B target's weights are not loaded); `aliases(model)` maps a missing key to the one that
    holds it (a tied head's embedding). The whole model when that cannot be done (a hub id, an adapter, unusual key
    names)."""
    directory = Path(cfg.name_or_path)
    if directory.is_dir() and cfg.adapter is None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
        module, other = pick(model), aliases(model) if aliases else {}
        prefix = next(name for name, m in model.named_modules() if m is module)
        params = {}
        for n, _ in module.named_parameters():
            key = f"{prefix}.{n}"
            found = _checkpoint_tensor(directory, key)
            params[n] = found if found is not None or key not in other else _checkpoint_tensor(directory, other[key])
        if params and all(v is not None for v in params.values()):
            module = module.to_empty(device="cpu")
            module.load_state_dict(params, strict=False)
            return module.float().eval()
    return pick(load_target(cfg, device="cpu", dtype="float32").model).float().eval()


def load_final_norm(cfg: TargetConfig) -> torch.nn.Module:
    """The target's final norm module with its weights (see `_from_checkpoint`)."""
    return _from_checkpoint(cfg, final_norm)


def load_output_head(cfg: TargetConfig) -> torch.nn.Module:
    """The target's output head (hidden -> vocab logits) with its weights, a tied head from the input embedding's
    (see `_from_checkpoint`)."""
    def tied(model: torch.nn.Module) -> dict[str, str]:
        if not getattr(model.config, "tie_word_embeddings", False):
            return {}
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        names = {m: n for n, m in model.named_modules() if m is head or m is embed}
        return {f"{names[head]}.weight": f"{names[embed]}.weight"}

    return _from_checkpoint(cfg, lambda model: model.get_output_embeddings(), tied)


class VllmFeatures:
    """The recipe's vLLM engine for the life of the `with` block; `rows(ids_list)` yields (row index, features)."""

    def __init__(self, job: Job, request: Any) -> None:
        self.job, self.request = job, request
        self.taps = list(request.tap_layer_ids) if request.tap_layer_ids else []
        self.need_last = "last_hidden" in job.stored
        self.norm = load_final_norm(job.recipe.target) if self.need_last else None
        self.engine: Any = None
        self.seconds = 0.0

    def __enter__(self) -> VllmFeatures:
        self.engine = engine_for(self.job.recipe)
        self.layer_ids = list(self.engine.config["layer_ids"])  # ascending: vLLM stacks them in layer order
        self.topk = int(self.engine.config["topk"])
        return self

    def __exit__(self, *exc: Any) -> None:
        release(self.engine, keep=False)

    # ------------------------------------------------------------------------------------------------------------
    # rows -> features

    def rows(self, ids_list: list[list[int]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(row index, float32 features of that row) for every row, in order (see the module docstring)."""
        step = self.job.recipe.capture.vllm.rows_per_request
        for start in range(0, len(ids_list), step):
            chunk = ids_list[start:start + step]
            t0 = time.time()
            files = self.engine.capture(chunk)
            self.seconds += time.time() - t0
            for j, file in enumerate(files):
                data = load_file(file)
                os.remove(file)
                yield start + j, self._features(data, chunk[j], start + j)

    def _features(self, data: dict[str, torch.Tensor], ids: list[int], row: int) -> dict[str, torch.Tensor]:
        if data["token_ids"].tolist() != ids:
            raise SpeculatorsError(f"vLLM captured other token ids than row {row} holds; the target or its "
                                   f"tokenizer differ between vLLM and this process")
        hidden = data["hidden_states"].float()  # [T, L, H]
        if hidden.shape[1] != len(self.layer_ids):
            raise SpeculatorsError(f"vLLM returned {hidden.shape[1]} hidden states per token for layer ids "
                                   f"{self.layer_ids}")
        where = {layer: i for i, layer in enumerate(self.layer_ids)}
        out: dict[str, torch.Tensor] = {}
        if self.taps:
            out["taps"] = hidden[:, [where[k] for k in self.taps]].reshape(len(ids), -1)  # [T, n_taps * H]
        if self.need_last:
            with torch.no_grad():
                out["last_hidden"] = self.norm(hidden[:, where[self.job.num_layers]]).float()  # [T, H]
        if self.topk:
            out["teacher_topk_ids"] = data["topk_ids"].long()  # [T, k]
            out["teacher_topk_logprobs"] = data["topk_logprobs"].float().clamp_min(-1e4)  # [T, k]
        return out
