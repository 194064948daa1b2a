"""`speculators generate` and `speculators serve`: the runtime's command bodies (cli.py parses, these run).

- `generate_command(...)`: one raw prompt (`--prompt`), one chat message (`--chat`) or every row of a workload
  file (`--workload`, each row with its own max_new_tokens; with `--batch N` up to N rows share each target
  forward); prints the text and the stats (or one JSON object per generation with `--json`), and for workloads a
  per-cohort summary (tau, per-position acceptance, tokens/s; a batched request's seconds overlap the others', so
  its tokens/s is per request, and the batch's own wall-clock total is printed once).
- `serve_command(...)`: load the engine once and serve the OpenAI-compatible app (server.py) with uvicorn, with the
  settings of one `config.ServeConfig` (the recipe's `serve:` section, the CLI's flags applied over it).

Not here: argument parsing (cli.py), the generation loop (engine.py), HTTP handling (server.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from speculators.config import DEFAULT_NGRAM_GRAFT, ServeConfig
from speculators.core.sampling import SamplingParams
from speculators.core.workloads import load_workloads
from speculators.errors import SpeculatorsError
from speculators.metrics import AcceptanceStats
from speculators.runtime.batching import generate_batch
from speculators.runtime.engine import Engine
from speculators.serving.server import create_app, run_server

log = logging.getLogger(__name__)


def _engine(target: str | None, speculator: str | None, device: str, dtype: str, allow_revision_mismatch: bool,
            tree: str | None = None, depth: int | None = None, topk: int | None = None,
            budget: int | None = None, draft_dtype: str = "auto", ngram_graft: int = DEFAULT_NGRAM_GRAFT,
            max_len: int | None = None) -> Any:
    engine = Engine.from_pretrained(target, None if speculator in (None, "", "none") else speculator, device=device,
                                    dtype=dtype, allow_revision_mismatch=allow_revision_mismatch,
                                    draft_dtype=draft_dtype, ngram_graft=ngram_graft, max_len=max_len)
    for warning in engine.info.pairing_warnings:
        log.warning(warning)
    if engine.info.precision:
        log.info("drafting: %s in %s", engine.info.family, engine.info.precision)
    overrides = {k: v for k, v in (("kind", tree), ("depth", depth), ("topk", topk), ("budget", budget))
                 if v is not None}
    if overrides:
        engine.set_tree(dataclasses.replace(engine.tree, **overrides))
    return engine


def _print_stats(stats: Any) -> None:
    s = stats
    acc = ", ".join(f"{a:.2f}" for a in s.per_position_acceptance) or "-"
    print(f"[{s.drafter}] {s.generated_tokens} tokens in {s.total_seconds:.3f}s ({s.tokens_per_second:.1f} tok/s, "
          f"{s.ms_per_token:.2f} ms/token decode) | prompt {s.prompt_tokens} (reused {s.reused_prefix_tokens}) | "
          f"target calls {s.target_calls} | tau {s.tau:.2f} | per-position acceptance [{acc}] | "
          f"finish {s.finish_reason} | adaptive {s.adaptive.get('mode', '-')}", file=sys.stderr)


def generate_command(*, target: str | None, speculator: str | None, prompt: str | None, chat: str | None,
                     workload: Path | None, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int | None, device: str, dtype: str, tree: str | None, depth: int | None,
                     topk: int | None, budget: int | None, allow_revision_mismatch: bool, as_json: bool,
                     draft_dtype: str = "auto", ngram_graft: int = DEFAULT_NGRAM_GRAFT, batch: int = 1) -> None:
    given = [name for name, v in (("--prompt", prompt), ("--chat", chat), ("--workload", workload)) if v is not None]
    if len(given) != 1:
        raise SpeculatorsError("give exactly one of --prompt TEXT, --chat MESSAGE or --workload FILE.jsonl"
                               + (f" (got {', '.join(given)})" if given else ""))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed)
    try:
        params.validate()
    except ValueError as exc:
        raise SpeculatorsError(str(exc)) from None
    if batch < 1:
        raise SpeculatorsError(f"--batch must be >= 1, got {batch}")
    rows: list[tuple[str, str, Any, int]] = []  # (id, cohort, prompt, max_new_tokens)
    if workload is not None:
        for row in load_workloads([str(workload)]):
            rows.append((row.id, row.cohort, row.prompt if row.prompt is not None else row.messages,
                         row.max_new_tokens))
    else:
        rows.append(("prompt", "-", prompt if prompt is not None else [{"role": "user", "content": chat}],
                     max_new_tokens))
    engine = _engine(target, speculator, device, dtype, allow_revision_mismatch, tree, depth, topk, budget,
                     draft_dtype, ngram_graft)
    per_cohort: dict[str, dict] = {}
    requests = [dataclasses.replace(params, max_new_tokens=mnt) for _, _, _, mnt in rows]
    if batch > 1:
        t0 = time.perf_counter()
        outs = generate_batch(engine, [r[2] for r in rows], requests, max_batch=batch)
        log.info("batch of up to %d: %d requests in %.3fs", batch, len(outs), time.perf_counter() - t0)
    else:
        outs = (engine.generate(r[2], p) for r, p in zip(rows, requests, strict=True))
    for (rid, cohort, _, _), out in zip(rows, outs, strict=True):
        if as_json:
            print(json.dumps({"id": rid, "cohort": cohort, "text": out.text, "token_ids": out.token_ids,
                              "stats": out.stats.to_dict()}), flush=True)
        else:
            if workload is not None:
                print(f"=== {rid} ({cohort})")
            print(out.text, flush=True)
            _print_stats(out.stats)
        c = per_cohort.setdefault(cohort, {"acc": AcceptanceStats(), "tokens": 0, "seconds": 0.0, "rows": 0})
        c["acc"].merge(out.stats.acceptance)
        c["tokens"] += out.stats.generated_tokens
        c["seconds"] += out.stats.total_seconds
        c["rows"] += 1
    if workload is not None:
        _print_cohorts(per_cohort, as_json)


def _print_cohorts(per_cohort: dict[str, dict], as_json: bool) -> None:
    summary = {
        cohort: {"rows": c["rows"], "tokens": c["tokens"], "tokens_per_second": round(c["tokens"] / c["seconds"], 2)
                 if c["seconds"] else 0.0, "tau": round(c["acc"].tau, 3),
                 "per_position_acceptance": [round(a, 3) for a in c["acc"].per_position_acceptance]}
        for cohort, c in per_cohort.items()
    }
    if as_json:
        print(json.dumps({"summary": summary}), flush=True)
        return
    print("\ncohort                rows  tokens   tok/s    tau   per-position acceptance")
    for cohort, s in summary.items():
        acc = " ".join(f"{a:.2f}" for a in s["per_position_acceptance"]) or "-"
        print(f"{cohort:<20} {s['rows']:>5} {s['tokens']:>7} {s['tokens_per_second']:>7.1f} {s['tau']:>6.2f}   {acc}")


def serve_command(*, target: str | None, speculator: str | None, device: str, dtype: str, config: ServeConfig) -> None:
    """Load the engine once and serve it with the settings of `config` (the recipe's serve: section with the CLI's
    flags applied)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpeculatorsError("speculators serve needs the serve extra: pip install 'speculators[serve]' "
                               "(fastapi, uvicorn, prometheus-client)") from None

    config.validate()
    api_key = None
    if config.api_key_env:
        api_key = os.environ.get(config.api_key_env, "")
        if not api_key:
            raise SpeculatorsError(f"--api-key-env {config.api_key_env}: that environment variable is unset or "
                                   f"empty; export it, or drop the option to serve without a key")
    engine = _engine(target, speculator, device, dtype, config.allow_revision_mismatch,
                     ngram_graft=config.ngram_graft, max_len=config.max_model_len)
    app = create_app(engine, config, api_key=api_key)  # refuses settings that contradict the model's context
    svc = app.state.service
    if config.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without an API key", config.host)
    log.info("serving %s with drafter %s on http://%s:%d/v1 (context %d tokens, prompts up to %d, up to %d new tokens "
             "per request)", engine.target.cfg.name_or_path, engine.info.name, config.host, config.port, engine.max_len,
             svc.max_prompt_tokens, config.max_new_tokens)
    run_server(app, host=config.host, port=config.port)
