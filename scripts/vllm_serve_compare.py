#!/usr/bin/env python
"""Serve one target with the real vLLM and measure EAGLE-3 drafts side by side: vLLM's own acceptance at T = 0.

For every draft given as LABEL=DIR (a speculators-format EAGLE-3 checkpoint: `speculators export`'s folder, or an
epoch folder written by vLLM's trainer, e.g. runs/vllm-trainer/tiny/checkpoints/0), one vLLM server is started with
`--speculative-config '{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}'` (the same K for every
draft, no batch-size schedule: launch.sh's plan is not used) and generates the held-out rows of the `vllm-check`
stage (`vllm_check.rows_to_check`: `--rows-per-cohort` rows of each workload cohort, outputs capped at
`--max-new-tokens`; prompts rendered as token ids by `teacher.encode_row`), one request at a time, greedy. vLLM's
`vllm:spec_decode_*` counters are read around every request (`vllm_check.serve_rows`) and summed into its mean
acceptance length (1 + accepted / drafts) and its per-position acceptance rate (accepted at position j / drafts,
the figure vLLM logs; the conditional rates are in the JSON too). The target alone is served first on the same rows
and every draft's outputs are compared token by token with it (lossless: all rows identical; mismatching rows are
listed). Servers are started one after the other, with the environment vllm-check uses (`vllm_env.server_env`,
`vllm_consumer.repaired_env` for method eagle3 at T = 0, `server_args`: float32, eager, max-model-len as there).

What it does not do: no prediction from our evaluation and no bundled-runtime run (that is `speculators vllm-check`),
no sampling (T > 0), no batching or throughput study (the tokens/s in the JSON are one request at a time, for
orientation only), no training, conversion or repair of a draft: a checkpoint vLLM refuses is reported with vLLM's
own error line. It never imports vLLM (it runs in .venv-vllm, spoken to over HTTP). Exit status: 0 when every
draft was served and lossless, 1 when one was not (the table says which), 2 for bad input (one error line).

usage: .venv/bin/python scripts/vllm_serve_compare.py [--recipe R] [--set a.b=v ...] [--target T]
           [--rows-per-cohort N] [--max-new-tokens M] [--k K] [--threads T] [--out FILE.json] LABEL=DIR [LABEL=DIR ...]
  e.g. ... --rows-per-cohort 1 --max-new-tokens 16 ours=runs/smollm2-small/export tiny=/tmp/run/checkpoints/0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from speculators.core.atomic import write_json_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import ChainCounts
from speculators.core.recipes import load_recipe
from speculators.core.target import load_tokenizer
from speculators.core.target_sources import resolve_target_source
from speculators.core.vllm_env import server_env, vllm_python
from speculators.core.workers import free_port
from speculators.core.workloads import WorkloadRow
from speculators.evaluate.teacher import encode_row
from speculators.export.vllm import verifier_name
from speculators.export.vllm_check import first_difference, rows_to_check, serve_rows
from speculators.export.vllm_consumer import VllmServer, repaired_env, server_args

FORMAT = "speculators.vllm-serve-compare/v1"
METHOD = "eagle3"


@dataclass
class Draft:
    label: str
    path: Path
    verifier: str | None  # the verifier its config names (informational: vLLM serves it with --target)


def parse_draft(spec: str) -> Draft:
    """LABEL=DIR checked to be a speculators-format EAGLE-3 folder (config.json + safetensors weights)."""
    label, sep, raw = spec.partition("=")
    if not sep or not label or not raw:
        raise SpeculatorsError(f"draft {spec!r} must look like LABEL=DIR (e.g. ours=runs/smollm2-small/export)")
    path = Path(raw).expanduser().resolve()
    if not path.is_dir():
        raise SpeculatorsError(f"draft {label}: {raw} is not a directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"draft {label}: cannot read {path / 'config.json'} ({exc})") from None
    kind = config.get("speculators_model_type") if isinstance(config, dict) else None
    if kind != METHOD or not isinstance(config.get("speculators_config"), dict):
        raise SpeculatorsError(f"draft {label}: {path / 'config.json'} is not an EAGLE-3 speculators config "
                               f"(speculators_model_type={kind!r}, needs 'eagle3' and a speculators_config)")
    if not any(path.glob("*.safetensors")):
        raise SpeculatorsError(f"draft {label}: no *.safetensors weights in {path}")
    verifier = (config["speculators_config"].get("verifier") or {}).get("name_or_path")
    return Draft(label, path, verifier)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafts", nargs="+", metavar="LABEL=DIR", help="EAGLE-3 speculators-format draft folders")
    ap.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml", help="recipe (rows, target, vLLM settings)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=V",
                    help="dotted recipe override, repeatable (e.g. vllm.max_model_len=2048)")
    ap.add_argument("--target", help="target to serve (default: the recipe's target)")
    ap.add_argument("--rows-per-cohort", type=int, default=8, help="held-out rows per workload cohort (default 8)")
    ap.add_argument("--max-new-tokens", type=int, help="output cap per row (default: the recipe's vllm.max_new_tokens)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default 3)")
    ap.add_argument("--threads", type=int, help="vLLM CPU threads (default: the recipe's vllm.threads)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)
    for name in ("rows_per_cohort", "max_new_tokens", "k", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def setup(args: argparse.Namespace) -> tuple[Recipe, Path, list[Draft]]:
    """(recipe with the CLI's settings, vLLM python, drafts), or SpeculatorsError for any bad input."""
    drafts = [parse_draft(spec) for spec in args.drafts]
    labels = [d.label for d in drafts]
    if len(set(labels)) != len(labels):
        raise SpeculatorsError(f"draft labels must be unique, got {labels}")
    recipe = load_recipe(args.recipe, args.overrides)
    if args.target:
        recipe.target.name_or_path = resolve_target_source(args.target)
    recipe.vllm.rows_per_cohort = args.rows_per_cohort
    if args.max_new_tokens is not None:
        recipe.vllm.max_new_tokens = args.max_new_tokens
    if args.threads is not None:
        recipe.vllm.threads = args.threads
    python = vllm_python(recipe)
    if python is None or not python.is_file():
        raise SpeculatorsError("no vLLM environment: build it with `make vllm-env` (or set vllm.python / "
                               "SPECULATORS_VLLM_PYTHON to the python of an environment with vLLM)")
    return recipe, python, drafts


def prompts_of(recipe: Recipe) -> tuple[list[WorkloadRow], list[list[int]], int]:
    """vllm-check's rows, their prompt token ids, and vllm-check's --max-model-len for this target."""
    rows = rows_to_check(recipe)
    tokenizer = load_tokenizer(recipe.target)
    prompts = [encode_row(tokenizer, r) for r in rows]
    cfg = recipe.target
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision,
                                            trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SpeculatorsError(f"cannot read the config of target {cfg.name_or_path}: {exc}") from None
    positions = int(getattr(config, "max_position_embeddings", 0) or recipe.vllm.max_model_len)
    return rows, prompts, min(recipe.vllm.max_model_len, positions)


def summarize(draft: Draft, k: int, rows: list[WorkloadRow], plain: list[list[int]], outs: list[list[int]],
              counts: list[ChainCounts | None], seconds: float, plain_rate: float) -> dict[str, Any]:
    """One draft's figures: pooled and per-cohort counters, lossless check against the target alone, speed."""
    total, cohorts = ChainCounts(k), {}
    for row, c in zip(rows, counts, strict=True):
        total.merge(c or ChainCounts(k))
        cohorts.setdefault(row.cohort, ChainCounts(k)).merge(c or ChainCounts(k))
    mismatches = [{"id": r.id, "cohort": r.cohort, "first_difference": first_difference(o, p),
                   "tokens": len(o), "tokens_target_alone": len(p)}
                  for r, o, p in zip(rows, outs, plain, strict=True) if o != p]
    rate = sum(map(len, outs)) / max(seconds, 1e-9)
    return {"label": draft.label, "path": str(draft.path), "verifier": draft.verifier, "rows": len(rows),
            "drafts": round(total.drafts), "draft_tokens": round(total.draft_tokens),
            "accepted_per_position": [round(a) for a in total.accepted],
            "mean_acceptance_length": round(total.mean_acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in total.reach],
            "conditional_acceptance_per_position": [round(a, 4) for a in total.per_position_acceptance],
            "lossless": not mismatches, "identical_rows": len(rows) - len(mismatches), "mismatches": mismatches,
            "tokens_per_s": round(rate, 2), "speedup_vs_target_alone": round(rate / max(plain_rate, 1e-9), 3),
            "cohorts": {name: c.to_dict() for name, c in cohorts.items()}}


def serve(command: list[str], env: dict[str, str], log: Path, rows: list[WorkloadRow], prompts: list[list[int]],
          k: int, counted: bool, max_model_len: int) -> tuple[list[list[int]], list[ChainCounts | None], float]:
    """Start one vLLM server (on a free port), serve every row one at a time, stop it."""
    port = free_port()
    command = [*command, *server_args(port, max_model_len=max_model_len)]
    with VllmServer(command, port=port, env=env, log=log) as server:
        return serve_rows(server, rows, prompts, k, counted=counted)


def measure(recipe: Recipe, python: Path, drafts: list[Draft], k: int, logs: Path) -> dict[str, Any]:
    rows, prompts, max_model_len = prompts_of(recipe)
    target = verifier_name(recipe)
    env = server_env(python, recipe.vllm.threads)
    spec_env, env_notes = repaired_env(python, env, temperature=0.0, method=METHOD)  # what vllm-check does at T=0
    base = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    print(f"{len(rows)} rows, k = {k}, target {target}; vLLM logs in {logs}", flush=True)
    t0 = time.perf_counter()
    plain, _, plain_s = serve(base, env, logs / "target-alone.log", rows, prompts, k, False, max_model_len)
    plain_rate = sum(map(len, plain)) / max(plain_s, 1e-9)
    print(f"  target alone: {sum(map(len, plain))} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = []
    for draft in drafts:
        t0 = time.perf_counter()
        spec = json.dumps({"method": METHOD, "model": str(draft.path), "num_speculative_tokens": k})
        try:
            outs, counts, secs = serve([*base, "--speculative-config", spec], spec_env, logs / f"{draft.label}.log",
                                       rows, prompts, k, True, max_model_len)
        except SpeculatorsError as exc:
            print(f"  {draft.label}: FAILED: {exc}", flush=True)
            results.append({"label": draft.label, "path": str(draft.path), "error": str(exc)})
            continue
        results.append(summarize(draft, k, rows, plain, outs, counts, secs, plain_rate))
        print(f"  {draft.label}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"format": FORMAT, "target": target, "k": k, "temperature": 0.0, "rows": len(rows),
            "rows_per_cohort": recipe.vllm.rows_per_cohort, "max_new_tokens": recipe.vllm.max_new_tokens,
            "max_model_len": max_model_len, "threads": recipe.vllm.threads, "vllm_python": str(python),
            "vllm_env": env_notes, "row_ids": [r.id for r in rows], "logs": str(logs),
            "target_alone": {"tokens": sum(map(len, plain)), "seconds": round(plain_s, 3),
                             "tokens_per_s": round(plain_rate, 2)},
            "drafts": results}


def table(report: dict[str, Any]) -> str:
    k = report["k"]
    head = ["label", "rows", "drafts", "mean acc. len",
            f"acceptance rate at positions 1..{k}", "lossless"]
    lines = []
    for d in report["drafts"]:
        if "error" in d:
            lines.append([d["label"], "-", "-", "-", "FAILED (see error)", "-"])
            continue
        lossless = "yes" if d["lossless"] else f"NO ({d['identical_rows']}/{d['rows']} rows)"
        lines.append([d["label"], str(d["rows"]), str(d["drafts"]), f"{d['mean_acceptance_length']:.3f}",
                      " ".join(f"{a:.3f}" for a in d["acceptance_rate_per_position"]), lossless])
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
    return "\n".join(_cells(r, widths) for r in [head, ["-" * w for w in widths], *lines])


def _cells(row: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    try:
        recipe, python, drafts = setup(args)
        logs = Path(tempfile.mkdtemp(prefix="vllm-serve-compare-"))
        report = measure(recipe, python, drafts, args.k, logs)
    except SpeculatorsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    report["wall_seconds"] = round(time.perf_counter() - wall, 1)
    print(f"\nvLLM, T = 0, k = {report['k']}, {report['rows']} rows (max {report['max_new_tokens']} new tokens each), "
          f"target {report['target']}:")
    print(table(report))
    for d in report["drafts"]:
        if d.get("mismatches"):
            print(f"{d['label']}: rows differing from the target alone: "
                  + ", ".join(f"{m['id']} (from token {m['first_difference']})" for m in d["mismatches"]))
        if "error" in d:
            print(f"{d['label']}: {d['error']}")
    print(f"wall time {report['wall_seconds']:.0f} s")
    if args.out:
        write_json_atomic(args.out, report)
        print(f"wrote {args.out}")
    return 1 if any("error" in d or not d.get("lossless") for d in report["drafts"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
