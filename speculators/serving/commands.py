"""`speculators generate` and `speculators serve`: the runtime's command bodies (cli.py parses, these run).

- `generate_command(GenerateOptions)`: one raw prompt (`--prompt`), one chat message (`--chat`) or every row of a
  workload file (`--workload`, each row with its own max_new_tokens; with `--batch N` up to N rows share each
  target forward); yields the lines to print as each generation finishes: the text (stdout) and its stats (stderr),
  or one JSON object per generation with `--json`, and for workloads a per-cohort summary (tau, per-position
  acceptance, tokens/s; a batched request's seconds overlap the others', so its tokens/s is per request, and the
  batch's own wall-clock total is logged once).
- `serve_command(ServeOptions, recipe)`: load the engine once and serve the OpenAI-compatible app (server.py) with
  uvicorn, with the settings of one `config.ServeConfig` (the recipe's `serve:` section, the flags applied over it).

Not here: argument parsing and printing (cli.py), the generation loop (engine.py), HTTP handling (server.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculators.core.config import DEFAULT_NGRAM_GRAFT, Recipe, ServeConfig, tree_config
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import AcceptanceStats
from speculators.core.options import GenerateOptions, ServeOptions
from speculators.core.sampling import SamplingParams
from speculators.core.workloads import load_workloads
from speculators.runtime.batching import generate_batch
from speculators.runtime.engine import Engine
from speculators.runtime.recording import RecordingSpec
from speculators.serving.server import create_app, run_server

log = logging.getLogger(__name__)

Output = tuple[str, bool]  # a line to print, and whether it goes to stderr
TreeFlags = tuple[str | None, int | None, int | None, int | None]  # --tree, --depth, --topk, --budget


def _command_engine(target: str | None, speculator: str | None, device: str, dtype: str,
                    allow_revision_mismatch: bool, tree: TreeFlags | None = None, draft_dtype: str = "auto",
                    ngram_graft: int = DEFAULT_NGRAM_GRAFT, max_len: int | None = None,
                    cost_cache: bool = False) -> Engine:
    """The engine of a command; `tree`: (kind, depth, topk, budget) flags applied over the drafter's own tree;
    `cost_cache`: costs from / kept in the cache root (runtime/cost_cache.py)."""
    engine = Engine.from_pretrained(target, None if speculator in (None, "", "none") else speculator, device=device,
                                    dtype=dtype, allow_revision_mismatch=allow_revision_mismatch,
                                    draft_dtype=draft_dtype, ngram_graft=ngram_graft, max_len=max_len)
    engine.cost_cache = cost_cache
    for warning in engine.info.pairing_warnings:
        log.warning(warning)
    if engine.info.precision:
        log.info("drafting: %s in %s", engine.info.family, engine.info.precision)
    chosen = tree_config(*tree, None, base=engine.tree) if tree is not None else None
    if chosen is not None:
        engine.set_tree(chosen)
    return engine


def _stats_line(stats: Any) -> str:
    s = stats
    acc = ", ".join(f"{a:.2f}" for a in s.per_position_acceptance) or "-"
    return (f"[{s.drafter}] {s.generated_tokens} tokens in {s.total_seconds:.3f}s ({s.tokens_per_second:.1f} tok/s, "
            f"{s.ms_per_token:.2f} ms/token decode) | prompt {s.prompt_tokens} (reused {s.reused_prefix_tokens}) | "
            f"target calls {s.target_calls} | tau {s.tau:.2f} | per-position acceptance [{acc}] | "
            f"finish {s.finish_reason} | adaptive {s.adaptive.get('mode', '-')}")


def _rows(opts: GenerateOptions) -> list[tuple[str, str, Any, int]]:
    """(id, cohort, prompt, max_new_tokens) of what to generate: the workload's rows, or the one prompt / message."""
    if opts.workload is not None:
        return [(row.id, row.cohort, row.prompt if row.prompt is not None else row.messages, row.max_new_tokens)
                for row in load_workloads([str(opts.workload)])]
    prompt = opts.prompt if opts.prompt is not None else [{"role": "user", "content": opts.chat}]
    return [("prompt", "-", prompt, opts.max_new_tokens)]


def generate_command(opts: GenerateOptions) -> Iterator[Output]:
    """Generate what `opts` asks for; yields (text, to stderr?) lines as each generation finishes (the caller prints
    them): the text (or one JSON object per generation with `as_json`) and its stats, then for a workload the
    per-cohort summary."""
    given = [name for name, v in (("--prompt", opts.prompt), ("--chat", opts.chat), ("--workload", opts.workload))
             if v is not None]
    if len(given) != 1:
        raise SpeculatorsError("give exactly one of --prompt TEXT, --chat MESSAGE or --workload FILE.jsonl"
                               + (f" (got {', '.join(given)})" if given else ""))
    params = SamplingParams(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                            top_p=opts.top_p, seed=opts.seed)
    try:
        params.validate()
    except ValueError as exc:
        raise SpeculatorsError(str(exc)) from None
    if opts.batch < 1:
        raise SpeculatorsError(f"--batch must be >= 1, got {opts.batch}")
    tree_config(opts.tree, opts.depth, opts.topk, opts.budget, None)  # the flags' errors before any loading
    rows = _rows(opts)
    engine = _command_engine(opts.target, opts.speculator, opts.device, opts.dtype, opts.allow_revision_mismatch,
                             (opts.tree, opts.depth, opts.topk, opts.budget), opts.draft_dtype, opts.ngram_graft,
                             cost_cache=opts.cost_cache)
    per_cohort: dict[str, dict] = {}
    requests = [dataclasses.replace(params, max_new_tokens=mnt) for _, _, _, mnt in rows]
    if opts.batch > 1:
        t0 = time.perf_counter()
        outs = generate_batch(engine, [r[2] for r in rows], requests, max_batch=opts.batch)
        log.info("batch of up to %d: %d requests in %.3fs", opts.batch, len(outs), time.perf_counter() - t0)
    else:
        outs = (engine.generate(r[2], p) for r, p in zip(rows, requests, strict=True))
    for (rid, cohort, _, _), out in zip(rows, outs, strict=True):
        if opts.as_json:
            yield json.dumps({"id": rid, "cohort": cohort, "text": out.text, "token_ids": out.token_ids,
                              "stats": out.stats.to_dict()}), False
        else:
            if opts.workload is not None:
                yield f"=== {rid} ({cohort})", False
            yield out.text, False
            yield _stats_line(out.stats), True
        c = per_cohort.setdefault(cohort, {"acc": AcceptanceStats(), "tokens": 0, "seconds": 0.0, "rows": 0})
        c["acc"].merge(out.stats.acceptance)
        c["tokens"] += out.stats.generated_tokens
        c["seconds"] += out.stats.total_seconds
        c["rows"] += 1
    if opts.workload is not None:
        yield _cohorts_text(per_cohort, opts.as_json), False


def _cohorts_text(per_cohort: dict[str, dict], as_json: bool) -> str:
    summary = {
        cohort: {"rows": c["rows"], "tokens": c["tokens"], "tokens_per_second": round(c["tokens"] / c["seconds"], 2)
                 if c["seconds"] else 0.0, "tau": round(c["acc"].tau, 3),
                 "per_position_acceptance": [round(a, 3) for a in c["acc"].per_position_acceptance]}
        for cohort, c in per_cohort.items()
    }
    if as_json:
        return json.dumps({"summary": summary})
    lines = ["\ncohort                rows  tokens   tok/s    tau   per-position acceptance"]
    for cohort, s in summary.items():
        acc = " ".join(f"{a:.2f}" for a in s["per_position_acceptance"]) or "-"
        lines.append(f"{cohort:<20} {s['rows']:>5} {s['tokens']:>7} {s['tokens_per_second']:>7.1f} "
                     f"{s['tau']:>6.2f}   {acc}")
    return "\n".join(lines)


def serve_command(opts: ServeOptions, recipe: Recipe | None = None) -> None:
    """Load the engine once and serve it with the recipe's serve: section (or the defaults), `opts.settings` (the
    flags given) applied over it; the target, speculator, device and dtype are the flags', else the recipe's."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpeculatorsError("speculators serve needs the serve extra: pip install 'speculators[serve]' "
                               "(fastapi, uvicorn, prometheus-client)") from None

    config = dataclasses.replace(recipe.serve if recipe is not None else ServeConfig(), **opts.settings)
    config.validate()
    speculator = opts.speculator
    if speculator is None:
        export = recipe.paths.export if recipe is not None else None
        speculator = str(export) if export is not None and (export / "config.json").is_file() else "none"
    target = opts.target or (recipe.target.name_or_path if recipe is not None else None)
    device = opts.device or (recipe.target.device if recipe is not None else "auto")
    dtype = opts.dtype or (recipe.target.dtype if recipe is not None else "auto")
    api_key = None
    if config.api_key_env:
        api_key = os.environ.get(config.api_key_env, "")
        if not api_key:
            raise SpeculatorsError(f"--api-key-env {config.api_key_env}: that environment variable is unset or "
                                   f"empty; export it, or drop the option to serve without a key")
    engine = _command_engine(target, speculator, device, dtype, config.allow_revision_mismatch,
                             ngram_graft=config.ngram_graft, max_len=config.max_model_len, cost_cache=config.cost_cache)
    if config.record:
        recorder = engine.record_to(RecordingSpec(Path(config.record), int(config.record_budget_gb * 2**30)))
        log.info("recording finished requests into %s (%d rows there already)", config.record, len(recorder.entries))
    app = create_app(engine, config, api_key=api_key)  # refuses settings that contradict the model's context
    svc = app.state.service
    if config.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key", config.host)
    log.info("serving %s with drafter %s on http://%s:%d/v1 (context %d tokens, prompts up to %d, up to %d new tokens "
             "per request)", engine.target.cfg.name_or_path, engine.info.name, config.host, config.port, engine.max_len,
             svc.max_prompt_tokens, config.max_new_tokens)
    try:
        run_server(app, host=config.host, port=config.port)
    finally:
        engine.record_to(None)  # the rows written since the manifest's last rewrite are listed
