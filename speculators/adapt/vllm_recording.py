"""`speculators record-vllm TARGET --record DIR`: a vLLM replica whose served traffic becomes training rows.

vLLM 0.32 cannot take hidden states out of an engine that speculates: its extraction is itself a speculative method
(`extract_hidden_states`), an engine has one, and the hidden-states connector refuses any other method. So a vLLM
deployment feeds the learn-from-traffic loop through a plain replica beside its speculating ones: the same OpenAI
server, started with `extract_hidden_states` at the recording's layer ids and the target's last layer, and
`RecordingHiddenStatesConnector` (data/vllm_side/hidden_states_connector.py), which writes every normally finished
request's hidden states (prompt and generated tokens) into a spool directory. `VllmTrafficCollector` turns each
spool file into one row of the recording format `speculators serve --record` writes (runtime/recording.py, through
its `TrafficRecorder`): ids, loss mask over the generated tokens, int8 taps, and the target's top-k teacher, computed
here from vLLM's last-layer hidden state through the target's own final norm and output head (loaded alone from the
checkpoint). A plain replica drafts nothing, so its rows carry no verification feedback (no cycle starts, no draft
nodes; the traffic stage weights them evenly) and no draft revision.

Not here: the traffic stage and training (data/traffic.py), the gate (evaluate/adoption.py). vLLM cannot swap a
drafter live: an adopted revision reaches a vLLM deployment by `speculators export` and a rolling restart.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from speculators.core.config import TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.target import default_tap_layers, fingerprint_target, text_config, validate_layer_ids
from speculators.core.vllm_env import find_vllm_python, server_env
from speculators.data.vllm_capture import load_final_norm, load_output_head
from speculators.data.vllm_engine import VLLM_SIDE
from speculators.export.vllm_consumer import VllmServer, sampling_env
from speculators.runtime.recording import RecordingSpec, RequestRecord, TrafficRecorder

CONNECTOR = "RecordingHiddenStatesConnector"
POLL_S = 0.5
DRAIN_S = 2.0  # on stop, the spool must stay empty this long before the replica goes


class VllmTrafficCollector:
    """Turns the replica's spool files into recorded rows (one `TrafficRecorder`, one target, one layer layout)."""

    def __init__(self, spool: Path, recorder: TrafficRecorder, target: TargetConfig, text: Any,
                 tap_layers: list[int]) -> None:
        """`text`: the target's (text) config."""
        num_layers = int(text.num_hidden_layers)
        self.spool, self.recorder = Path(spool), recorder
        self.vllm_layers = sorted(set(tap_layers) | {num_layers})  # vLLM stacks them ascending
        self.tap_index = [self.vllm_layers.index(k) for k in tap_layers]
        self.last_index = self.vllm_layers.index(num_layers)
        self.norm, self.head = load_final_norm(target), load_output_head(target)
        self.logit_scale = 1.0 / float(getattr(text, "logits_scaling", 1.0) or 1.0)  # granite divides
        self.softcap = getattr(text, "final_logit_softcapping", None)  # gemma caps
        self.rows_refused = 0

    def collect(self) -> int:
        """Record every finished spool file (oldest first) and delete it; the rows written."""
        written = 0
        files = sorted(self.spool.glob("*.safetensors"), key=lambda f: f.stat().st_mtime_ns)
        for file in files:
            data = load_file(str(file))
            record, output_ids = self.record_of(data)
            if record is None or self.recorder.write(record, output_ids, draft_revision=None) is None:
                self.rows_refused += 1
            else:
                written += 1
            file.unlink()
        return written

    def record_of(self, data: dict[str, torch.Tensor]) -> tuple[RequestRecord | None, list[int]]:
        """One spool file -> the request's record and its generated ids (None when the file is not a whole row)."""
        ids = [int(t) for t in data["token_ids"].tolist()]  # [T - 1]: all but the last generated token
        hidden = data["hidden_states"].float()  # [T - 1, L, H]
        prompt_len, final = int(data["num_prompt_tokens"]), int(data["final_token"])
        if hidden.shape[0] != len(ids) or hidden.shape[1] != len(self.vllm_layers) or not 0 < prompt_len <= len(ids):
            return None, []
        taps = hidden[:, self.tap_index].reshape(len(ids), -1)  # [T - 1, n_taps * H]
        with torch.no_grad():
            logits = self.head(self.norm(hidden[prompt_len - 1:, self.last_index])).float()  # [n_out, V]
            logits = logits * self.logit_scale
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            top = torch.log_softmax(logits, dim=-1).topk(self.recorder.spec.teacher_topk, dim=-1)
        record = self.recorder.start(ids[:prompt_len], float(data["temperature"]), taps[:prompt_len - 1])
        record.taps.append(taps[prompt_len - 1:])
        record.teacher_ids.append(top.indices)
        record.teacher_logprobs.append(top.values.clamp_min(-1e4))
        return record, ids[prompt_len:] + [final]


def replica_command(python: Path, target: TargetConfig, *, port: int, host: str, layers: list[int], spool: Path,
                    dtype: str, max_model_len: int, extra: list[str]) -> list[str]:
    """The vLLM OpenAI server of a recording replica (extraction at `layers`, the recording connector)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    transfer = {"kv_connector": CONNECTOR, "kv_role": "kv_producer", "kv_connector_module_path":
                "hidden_states_connector", "kv_connector_extra_config": {
                    "shared_storage_path": str(spool), "use_synchronization_lock": False}}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target.name_or_path,
               "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
    if target.revision:
        command += ["--revision", target.revision]
    if target.trust_remote_code:
        command.append("--trust-remote-code")
    return command + extra


def run_record_vllm(target: TargetConfig, spec: RecordingSpec, *, port: int = 8000, host: str = "127.0.0.1",
                    layers: list[int] | None = None, dtype: str = "auto", max_model_len: int = 2048,
                    threads: int = 2, python: Path | None = None, extra: list[str] | None = None,
                    stop: threading.Event | None = None, log: Callable[[str], None] = print) -> dict:
    """Serve `target` with a recording vLLM replica until `stop` is set (SIGINT / SIGTERM set it when run from the
    main thread), recording every finished request into `spec.directory`; the recorder's report."""
    directory = Path(target.name_or_path)
    if not (directory / "config.json").is_file():
        raise SpeculatorsError(f"record-vllm needs a local target directory with a config.json, got "
                               f"{target.name_or_path}")
    python = python or find_vllm_python(Path.cwd())
    if python is None or not Path(python).is_file():
        raise SpeculatorsError("record-vllm needs a vLLM environment: run `make vllm-env`, or pass --vllm-python")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=target.trust_remote_code)
    text = text_config(config)
    n = int(text.num_hidden_layers)
    taps = validate_layer_ids(list(layers) if layers else default_tap_layers(n), n)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=target.trust_remote_code)
    fp = fingerprint_target(target, tokenizer=tokenizer, model_config=config).to_dict()
    recorder = TrafficRecorder(spec, target=fp, layer_ids=taps, num_layers=n, hidden_size=int(text.hidden_size),
                               vocab_size=int(text.vocab_size))  # another target's recording: refused here
    spool = spec.directory / ".vllm-spool"
    spool.mkdir(parents=True, exist_ok=True)
    collector = VllmTrafficCollector(spool, recorder, target, text, taps)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    command = replica_command(Path(python), target, port=port, host=host, layers=collector.vllm_layers, spool=spool,
                              dtype=dtype, max_model_len=max_model_len, extra=list(extra or []))
    env, sampling = sampling_env(Path(python), server_env(Path(python), threads=threads))  # traffic at T > 0 too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_SIDE), env.get("PYTHONPATH")) if p)
    server = VllmServer(command, port=port, env=env, log=spec.directory / "vllm-replica.log")
    with server:
        log(f"recording vLLM replica of {target.name_or_path} at http://{host}:{port}/v1 -> {spec.directory} "
            f"(taps {taps}; log {server.log}; {sampling})")
        while not stop.wait(POLL_S):
            collector.collect()
            if server.proc is not None and server.proc.poll() is not None:
                raise SpeculatorsError(f"the vLLM replica exited with status {server.proc.returncode} (log "
                                       f"{server.log}); the rows recorded so far are in {spec.directory}")
        quiet_since = time.monotonic()  # stopping: a request answered just now is written an engine step later
        while time.monotonic() - quiet_since < DRAIN_S:
            time.sleep(POLL_S)
            if collector.collect():
                quiet_since = time.monotonic()
    collector.collect()  # what finished before the replica stopped
    recorder.flush()
    if not any(spool.iterdir()):
        spool.rmdir()
    return {**recorder.report(), "rows_refused": collector.rows_refused}
