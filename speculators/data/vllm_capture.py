"""`capture.backend: vllm`: the target's hidden states computed by vLLM, the engine users serve big targets with.

`VllmFeatures(job, python)` starts one vLLM engine in the vLLM environment (`vllm_side/capture_main.py`: vLLM's
`extract_hidden_states` speculative method with a synchronous hidden-states connector) and, per shard, sends it
the rows as token-id prompts; it returns, per row, the same float32 features the Hugging Face path computes
(`features.compute_features`), so capture.py encodes, validates and writes them through one path:

- "taps" [T, n_taps * H]: vLLM's hidden states at the recipe's layer ids (id k = the residual entering layer k,
  what `target.TapRecorder` records), in the recipe's order;
- "last_hidden" [T, H]: vLLM's layer-N output (before the final norm) through the target's own final norm, loaded
  alone from the checkpoint (`load_final_norm`);
- the top-k teacher ("teacher_topk_ids" / "teacher_topk_logprobs" [T, k]) from vLLM's prompt log-probs (position
  t's next-token law is vLLM's log-prob row of position t + 1; the last position's is the generated token's).

vLLM's token ids are checked against the rows sent; vLLM's own files and the exchange directory are removed. The
engine's log is `logs/capture-vllm.log`; a failed start or request is one line quoting vLLM's error. This module
never imports vLLM (its environment pins other versions) and writes no shard (capture.py does).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from speculators.config import TargetConfig
from speculators.core.vllm_env import find_vllm_python, last_error_line, server_env
from speculators.data.capture_job import Job, job_dataset, row_lengths
from speculators.errors import SpeculatorsError
from speculators.target import final_norm, load_target

VLLM_SIDE = Path(__file__).resolve().parent / "vllm_side"
REQUEST_TIMEOUT_S = 3600.0  # one message of rows_per_request rows


def vllm_python(recipe: Any) -> Path:
    """The vLLM environment's interpreter (recipe `vllm.python`, $SPECULATORS_VLLM_PYTHON, ./.venv-vllm)."""
    python = Path(recipe.vllm.python) if recipe.vllm.python else find_vllm_python()
    if python is None or not python.is_file():
        raise SpeculatorsError("capture.backend=vllm needs a vLLM environment: run `make vllm-env`, or set "
                               "vllm.python / $SPECULATORS_VLLM_PYTHON to its python")
    return python


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


def load_final_norm(cfg: TargetConfig) -> torch.nn.Module:
    """The target's final norm module with its weights, built from the config on the meta device and filled from
    the checkpoint alone (a 70B target's weights are not loaded); the whole model when that cannot be done (a hub
    id, unusual key names)."""
    directory = Path(cfg.name_or_path)
    if directory.is_dir() and cfg.adapter is None:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
        norm = final_norm(model)
        prefix = next(name for name, module in model.named_modules() if module is norm)
        params = {n: _checkpoint_tensor(directory, f"{prefix}.{n}") for n, _ in norm.named_parameters()}
        if params and all(v is not None for v in params.values()):
            norm = norm.to_empty(device="cpu")
            norm.load_state_dict(params, strict=False)
            return norm.float().eval()
    return final_norm(load_target(cfg, device="cpu", dtype="float32").model).float().eval()


class VllmFeatures:
    """One vLLM capture engine for the life of the `with` block; `rows(ids_list)` yields (row index, features)."""

    def __init__(self, job: Job, request: Any, python: Path) -> None:
        self.job, self.request, self.python = job, request, python
        cap = job.recipe.capture
        self.taps = list(request.tap_layer_ids) if request.tap_layer_ids else []
        self.need_last = "last_hidden" in job.stored
        ids = set(self.taps) | ({job.num_layers} if self.need_last else set())
        self.layer_ids = sorted(ids)  # vLLM stacks them in layer order
        self.topk = cap.teacher_topk if cap.teacher == "topk" else 0
        self.norm = load_final_norm(job.recipe.target) if self.need_last else None
        self.proc: subprocess.Popen | None = None
        self.seconds = 0.0
        self._batch = 0

    # ------------------------------------------------------------------------------------------------------------
    # the engine process

    def __enter__(self) -> VllmFeatures:
        cap, target = self.job.recipe.capture, self.job.recipe.target
        self.work = Path(tempfile.mkdtemp(prefix=".capture-vllm-", dir=self.job.recipe.paths.run_dir))
        (self.work / "vllm").mkdir()
        (self.work / "rows").mkdir()
        max_len = max(row_lengths(job_dataset(self.job))) + 1  # + the one generated token
        dtype = target.dtype if target.dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32")
        config = {"model": target.name_or_path, "revision": target.revision, "dtype": dtype,
                  "seed": self.job.recipe.seed, "max_model_len": max_len, "layer_ids": self.layer_ids,
                  "topk": self.topk, "tensor_parallel_size": cap.vllm.tensor_parallel_size,
                  "data_parallel_size": cap.vllm.data_parallel_size, "max_num_seqs": cap.vllm.max_num_seqs,
                  "enforce_eager": cap.vllm.enforce_eager, "trust_remote_code": target.trust_remote_code,
                  "vllm_dir": str(self.work / "vllm"), "out_dir": str(self.work / "rows")}
        (self.work / "config.json").write_text(json.dumps(config))
        env = server_env(self.python, threads=cap.vllm.threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(cap.vllm.kv_cache_gb)))
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM_SIDE)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.log = self.job.recipe.paths.logs / "capture-vllm.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        env.update({"CAPTURE_CONFIG": str(self.work / "config.json"), "CAPTURE_REPLY_FD": str(write_fd)})
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(self.python), str(VLLM_SIDE / "capture_main.py")],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,),
                start_new_session=True, text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        try:
            self._reply(cap.vllm.startup_timeout, "start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)
                        self.proc.wait(timeout=30)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        if getattr(self, "replies", None) is not None:
            self.replies.close()
            self.replies = None
        shutil.rmtree(getattr(self, "work", ""), ignore_errors=True)

    def _reply(self, timeout: float, what: str) -> dict:
        """The engine's next reply line, or one error line naming vLLM's own error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.replies], [], [], 2.0)
            if ready:
                line = self.replies.readline()
                if line:
                    reply = json.loads(line)
                    if "error" in reply:
                        raise SpeculatorsError(f"vLLM capture failed ({what}): {reply['error']} (log {self.log})")
                    return reply
            if self.proc.poll() is not None:
                raise SpeculatorsError(f"vLLM capture engine exited with status {self.proc.returncode} ({what}): "
                                       f"{last_error_line(self.log)} (log {self.log})")
        raise SpeculatorsError(f"vLLM capture engine did not answer within {timeout:.0f} s ({what}); log {self.log}")

    # ------------------------------------------------------------------------------------------------------------
    # rows -> features

    def rows(self, ids_list: list[list[int]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(row index, float32 features of that row) for every row, in order (see the module docstring)."""
        step = self.job.recipe.capture.vllm.rows_per_request
        for start in range(0, len(ids_list), step):
            chunk = ids_list[start:start + step]
            self._batch += 1
            t0 = time.time()
            self.proc.stdin.write(json.dumps({"batch": self._batch, "rows": chunk}) + "\n")
            self.proc.stdin.flush()
            reply = self._reply(REQUEST_TIMEOUT_S, f"rows {start}..{start + len(chunk) - 1}")
            self.seconds += time.time() - t0
            for j, file in enumerate(reply["files"]):
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
