"""Run INSIDE the vLLM environment (.venv-vllm): serve many (target, EAGLE-3 export) pairs with the real vLLM engine
in ONE process, one engine after the other (vLLM imported once; an engine starts in seconds where a server takes
half a minute), for tests/vllm/test_vllm_architectures.py.

usage: VLLM_ENABLE_V1_MULTIPROCESSING=0 python serve_sweep.py JOBS.json RESULTS.json
JOBS: [{"name", "target", "export", "dtype", "prompts": [[ids]], "max_tokens", "k"}]. Per job, the target with the
export as its EAGLE-3 drafter (the speculative config the export's launch.sh passes) generates every prompt at T = 0,
one at a time, reading vLLM's spec-decode counters after each; then the target alone generates them (not started
where vLLM refused the drafter: an MLA target on a CPU without AMX).
RESULTS: {name: {"plain": [[ids]], "spec": [[ids]], "counts": [{"drafts", "draft_tokens", "accepted": [k]}]} |
{"error": "vLLM's exception, one line"}}. vLLM's log (stdout) has a line `== job NAME` before each job's engines.
"""

import gc
import json
import sys
import traceback

from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.inputs import TokensPrompt


def _counters(llm: LLM, k: int) -> dict:
    values = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
    per_pos = list(values.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * k)
    return {"drafts": int(values.get("vllm:spec_decode_num_drafts", 0)),
            "draft_tokens": int(values.get("vllm:spec_decode_num_draft_tokens", 0)),
            "accepted": [int(per_pos[j]) if j < len(per_pos) else 0 for j in range(k)]}


def _generate(job: dict, speculative: dict | None) -> dict:
    llm = LLM(model=job["target"], dtype=job["dtype"], enforce_eager=True, max_model_len=1024, max_num_seqs=8,
              seed=0, speculative_config=speculative, disable_log_stats=speculative is None)
    try:
        params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, detokenize=False)
        outs, counts, k = [], [], int(job["k"])
        for prompt in job["prompts"]:  # one request at a time: per-row counters at batch size 1
            before = _counters(llm, k) if speculative else None
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            outs.append([int(t) for t in out[0].outputs[0].token_ids])
            if speculative:
                after = _counters(llm, k)
                counts.append({"drafts": after["drafts"] - before["drafts"],
                               "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
                               "accepted": [a - b for a, b in zip(after["accepted"], before["accepted"], strict=True)]})
        return {"outputs": outs, "counts": counts}
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> int:
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for job in jobs:
        print(f"== job {job['name']}", flush=True)  # the log's sections: the test reads each job's aux-layer line
        try:
            spec = _generate(job, {"model": job["export"], "method": "eagle3", "num_speculative_tokens": int(job["k"])})
            plain = _generate(job, None)
            results[job["name"]] = {"plain": plain["outputs"], "spec": spec["outputs"], "counts": spec["counts"]}
        except Exception as exc:  # one job's failure is its result; the next job runs
            traceback.print_exc()
            results[job["name"]] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:1000]}"}
    json.dump(results, open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
