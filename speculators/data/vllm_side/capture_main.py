"""Runs inside the vLLM environment (never imported by `speculators`): one vLLM engine that regenerates answers
(`data.regenerate.backend: vllm`) and captures hidden states (`capture.backend: vllm`) for the data stages
(data/vllm_engine.py starts it and speaks to it).

    CAPTURE_CONFIG=config.json CAPTURE_REPLY_FD=N python capture_main.py

The engine runs vLLM's `extract_hidden_states` speculative method with the synchronous connector of
hidden_states_connector.py. Requests arrive on stdin, one JSON line each: `{"batch": B, "rows": [[token ids], ...]}`.
Every row is a token-id prompt generated for one greedy token; vLLM writes its hidden states at the config's layer
ids (`hidden_states [T, L, H]`, ids ascending: id k < N = the residual entering layer k, id N = the last layer's
output before the final norm) and, when `topk` > 0, its prompt log-probs give the target's top-k next-token
log-probs at every position. The reply, one JSON line on the reply fd, names one safetensors file per row in `out_dir`
(`hidden_states`, `token_ids` and, with top-k, `topk_ids [T, k]` / `topk_logprobs [T, k]`); vLLM's own files are
removed. `{"batch": B, "generate": [[prompt ids], ...], "params": [{max_tokens, temperature, top_p, seed}, ...],
"stop_token_ids": [...]}` samples one answer per prompt and replies `{"outputs": [[token ids], ...]}` (the hidden
states vLLM writes for those requests are deleted). Prefix caching is on: a capture of a regenerated row recomputes
only what the generation did not (the cached blocks keep their hidden states). `{"ready": ...}` is the first line
once the engine is up; `{"error": ...}` and exit 1 on any failure.
vLLM's logs go to stdout / stderr, never to the reply fd.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    cleanup_hidden_states,
    load_hidden_states,
)
from vllm.inputs import TokensPrompt


def _capture_llm(cfg: dict) -> LLM:
    topk = int(cfg["topk"])
    return LLM(model=cfg["model"], revision=cfg.get("revision"), dtype=cfg["dtype"], seed=int(cfg["seed"]),
               max_model_len=int(cfg["max_model_len"]), enforce_eager=bool(cfg["enforce_eager"]),
               tensor_parallel_size=int(cfg["tensor_parallel_size"]),
               data_parallel_size=int(cfg["data_parallel_size"]), max_num_seqs=int(cfg["max_num_seqs"]),
               trust_remote_code=bool(cfg["trust_remote_code"]), max_logprobs=max(topk, 1),
               enable_prefix_caching=True,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": list(cfg["layer_ids"])}}},
               kv_transfer_config={"kv_connector": "SyncHiddenStatesConnector", "kv_role": "kv_producer",
                                   "kv_connector_module_path": "hidden_states_connector",
                                   "kv_connector_extra_config": {"shared_storage_path": cfg["vllm_dir"]}})


def _top(entries: dict, k: int) -> tuple[list[int], list[float]]:
    """The k best of one position's log-prob dict (vLLM adds the actual token when it ranks lower)."""
    best = sorted(entries.items(), key=lambda item: item[1].rank)[:k]
    return [int(t) for t, _ in best], [float(lp.logprob) for _, lp in best]


def _teacher(out, count: int, k: int) -> dict[str, torch.Tensor]:
    """Top-k next-token log-probs at positions 0..T-1: prompt log-probs of position t+1, then the generated token's."""
    ids, lps = [], []
    for t in range(1, count):
        i, lp = _top(out.prompt_logprobs[t], k)
        ids.append(i)
        lps.append(lp)
    i, lp = _top(out.outputs[0].logprobs[0], k)
    ids.append(i)
    lps.append(lp)
    return {"topk_ids": torch.tensor(ids, dtype=torch.int64), "topk_logprobs": torch.tensor(lps, dtype=torch.float32)}


def _run_batch(llm: LLM, cfg: dict, batch: int, rows: list[list[int]]) -> list[str]:
    topk = int(cfg["topk"])
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            prompt_logprobs=topk or None, logprobs=topk or None)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
    files = []
    for i, (row, out) in enumerate(zip(rows, outs, strict=True)):
        src = out.kv_transfer_params["hidden_states_path"]
        data = load_hidden_states(src)  # waits for the connector's lock
        got = [int(t) for t in data["token_ids"].tolist()]
        if got != row:
            raise RuntimeError(f"row {i} of batch {batch}: vLLM captured other token ids than it was sent "
                               f"({len(got)} vs {len(row)} tokens)")
        tensors = {"hidden_states": data["hidden_states"].contiguous(), "token_ids": data["token_ids"].contiguous()}
        if topk:
            tensors.update(_teacher(out, len(row), topk))
        dest = os.path.join(cfg["out_dir"], f"batch-{batch:06d}-row-{i:05d}.safetensors")
        save_file(tensors, dest)
        cleanup_hidden_states(src)
        files.append(dest)
    return files


def _generate(llm: LLM, rows: list[list[int]], params: list[dict], stop_ids: list[int]) -> list[list[int]]:
    sampling = [SamplingParams(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                               top_p=float(p["top_p"]), seed=int(p["seed"]), stop_token_ids=stop_ids,
                               detokenize=False) for p in params]
    outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], sampling, use_tqdm=False)
    answers = []
    for out in outs:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path:  # the prompt's hidden states: not asked for here
            load_hidden_states(path)
            cleanup_hidden_states(path)
        answers.append([int(t) for t in out.outputs[0].token_ids])
    return answers


def main() -> int:
    with open(os.environ["CAPTURE_CONFIG"]) as fh:
        cfg = json.load(fh)
    reply = os.fdopen(int(os.environ["CAPTURE_REPLY_FD"]), "w", buffering=1)
    try:
        t0 = time.time()
        llm = _capture_llm(cfg)
        reply.write(json.dumps({"ready": True, "seconds": round(time.time() - t0, 2)}) + "\n")
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            t0 = time.time()
            if "generate" in request:
                out = {"outputs": _generate(llm, request["generate"], request["params"], request["stop_token_ids"])}
            else:
                out = {"files": _run_batch(llm, cfg, int(request["batch"]), request["rows"])}
            reply.write(json.dumps({"batch": request["batch"], **out, "seconds": round(time.time() - t0, 3)}) + "\n")
        return 0
    except Exception as exc:  # one line for the parent; the traceback goes to the log
        traceback.print_exc()
        reply.write(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
                    + "\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
