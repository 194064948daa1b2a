"""One vLLM engine process for the data stages: regeneration (`data.regenerate.backend: vllm`) and capture
(`capture.backend: vllm`) of one recipe share it, so a `speculators run` with both starts vLLM once and capture's
forward of a regenerated row reuses the prompt + answer the engine just computed (vLLM's prefix cache holds the
hidden states with the KV blocks: measured bit-identical to a fresh forward).

- `engine_for(recipe)`: the recipe's engine, started on first use (`vllm_side/capture_main.py` in the vLLM
  environment: the `extract_hidden_states` method at capture's layer ids, the top-k teacher, prefix caching) and
  kept in this process's registry; `release(engine, keep=...)` stops it unless the next stage will use it (then the
  registry stops it when the process exits).
- `VllmEngine.capture(rows)` -> one safetensors file per row (hidden states, token ids, top-k teacher);
  `VllmEngine.generate(rows, params, stop_ids)` -> generated token ids per row (`params`: max_tokens, temperature,
  top_p, seed per row).

A failed start or request is one line quoting vLLM's own error (the engine log is `logs/vllm-engine.log`). This module
never imports vLLM and knows no shard format (vllm_capture.py turns the files into features).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target import resolve_device, resolve_dtype, text_config
from speculators.core.vllm_env import last_error_line, server_env, stop_process_group, vllm_python
from speculators.data.features import feature_request, stored_features

VLLM_SIDE = Path(__file__).resolve().parent / "vllm_side"
REQUEST_TIMEOUT_S = 3600.0  # one message of rows
_ENGINES: dict[str, VllmEngine] = {}


def require_vllm_python(recipe: Recipe) -> Path:
    """The vLLM environment's interpreter (recipe `vllm.python`, $SPECULATORS_VLLM_PYTHON, ./.venv-vllm), or a
    one-line error naming how to make one."""
    python = vllm_python(recipe)
    if python is None or not python.is_file():
        raise SpeculatorsError("the vLLM backend needs a vLLM environment: run `make vllm-env`, or set vllm.python "
                               "/ $SPECULATORS_VLLM_PYTHON to its python")
    return python


def num_layers(recipe: Recipe) -> int:
    cfg = recipe.target
    config = AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision,
                                        trust_remote_code=cfg.trust_remote_code)
    return int(text_config(config).num_hidden_layers)


def engine_config(recipe: Recipe) -> dict[str, Any]:
    """What the engine is started with: one engine serves every stage of the recipe that asks the same."""
    cap, target = recipe.capture, recipe.target
    n = num_layers(recipe)
    request = feature_request(recipe, n)
    taps = list(request.tap_layer_ids) if request.tap_layer_ids else []
    need_last = "last_hidden" in stored_features(request, cap.teacher)
    dtype = str(resolve_dtype(target.dtype, resolve_device(target.device))).removeprefix("torch.")
    return {"model": target.name_or_path, "revision": target.revision, "dtype": dtype, "seed": recipe.seed,
            "max_model_len": recipe.data.max_length + 1, "layer_ids": sorted(set(taps) | ({n} if need_last else set())),
            "topk": cap.teacher_topk if cap.teacher == "topk" else 0,
            "tensor_parallel_size": cap.vllm.tensor_parallel_size, "data_parallel_size": cap.vllm.data_parallel_size,
            "max_num_seqs": cap.vllm.max_num_seqs, "enforce_eager": cap.vllm.enforce_eager,
            "trust_remote_code": target.trust_remote_code}


class VllmEngine:
    """The engine process (its own process group) and the line protocol of `vllm_side/capture_main.py`."""

    def __init__(self, recipe: Recipe, config: dict[str, Any]) -> None:
        self.recipe, self.config = recipe, config
        self.key = json.dumps(config, sort_keys=True)  # its place in the registry
        self.python = require_vllm_python(recipe)  # before anything is written
        self.proc: subprocess.Popen | None = None
        self.replies: Any = None
        self._batch = 0
        run_dir = Path(recipe.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=".vllm-engine-", dir=run_dir))
        self.log = recipe.paths.logs / "vllm-engine.log"

    def start(self) -> VllmEngine:
        v, python = self.recipe.capture.vllm, self.python
        (self.work / "vllm").mkdir()
        (self.work / "rows").mkdir()
        cfg = {**self.config, "vllm_dir": str(self.work / "vllm"), "out_dir": str(self.work / "rows")}
        (self.work / "config.json").write_text(json.dumps(cfg))
        env = server_env(python, threads=v.threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(v.kv_cache_gb)))
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # in one process the capture engine hangs after its first batch
        env["PYTHONPATH"] = os.pathsep.join([str(VLLM_SIDE)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        read_fd, write_fd = os.pipe()
        env.update({"CAPTURE_CONFIG": str(self.work / "config.json"), "CAPTURE_REPLY_FD": str(write_fd)})
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            log.write(f"== speculators: vLLM engine start, layer ids {self.config['layer_ids']}, top-k "
                      f"{self.config['topk']}\n")
            log.flush()
            self.proc = subprocess.Popen([str(python), str(VLLM_SIDE / "capture_main.py")], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(write_fd,),
                                         start_new_session=True, text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")
        try:
            self._reply(v.startup_timeout, "start")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of input: the engine loop returns
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                stop_process_group(self.proc, (30.0, 30.0))
        if self.replies is not None:
            self.replies.close()
            self.replies = None
        shutil.rmtree(self.work, ignore_errors=True)

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
                        raise SpeculatorsError(f"vLLM engine failed ({what}): {reply['error']} (log {self.log})")
                    return reply
            if self.proc.poll() is not None:
                raise SpeculatorsError(f"vLLM engine exited with status {self.proc.returncode} ({what}): "
                                       f"{last_error_line(self.log)} (log {self.log})")
        raise SpeculatorsError(f"vLLM engine did not answer within {timeout:.0f} s ({what}); log {self.log}")

    def _ask(self, message: dict, what: str) -> dict:
        self._batch += 1
        self.proc.stdin.write(json.dumps({"batch": self._batch, **message}) + "\n")
        self.proc.stdin.flush()
        return self._reply(REQUEST_TIMEOUT_S, what)

    def capture(self, rows: list[list[int]]) -> list[str]:
        """One file per row: `hidden_states [T, L, H]` (the config's layer ids), `token_ids [T]`, top-k teacher."""
        return self._ask({"rows": rows}, f"capture of {len(rows)} rows")["files"]

    def generate(self, rows: list[list[int]], params: list[dict], stop_ids: list[int]) -> list[list[int]]:
        """Generated token ids per row (up to and including a stop token)."""
        return self._ask({"generate": rows, "params": params, "stop_token_ids": stop_ids},
                         f"generation of {len(rows)} rows")["outputs"]


def engine_for(recipe: Recipe) -> VllmEngine:
    """The recipe's running engine (started on first use, then shared by the stages that ask the same config)."""
    config = engine_config(recipe)
    engine = _ENGINES.get(json.dumps(config, sort_keys=True))
    if engine is None or engine.proc is None or engine.proc.poll() is not None:
        engine = VllmEngine(recipe, config).start()
        _ENGINES[engine.key] = engine
    return engine


def release(engine: VllmEngine | None, *, keep: bool) -> None:
    """Stop `engine` unless `keep` (a later stage of this process uses it; exit stops it then)."""
    if engine is None or keep:
        return
    _ENGINES.pop(engine.key, None)
    engine.stop()


@atexit.register
def _stop_all() -> None:
    for engine in _ENGINES.values():
        engine.stop()
    _ENGINES.clear()
