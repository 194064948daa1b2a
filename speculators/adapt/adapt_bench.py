"""`speculators.adapt.adapt_bench`: a stream of held-out requests of one cohort, served in windows by prompt lookup alone,
the static draft revision and the adapting one side by side, with the loop between windows.

For each window of `window_rows` requests (T = 0, each row's own max_new_tokens), four engines on one loaded target
generate every request, one after the other on the same cores: plain (no drafter: the reference, and the T = 0
identity check of the others), ngram (prompt lookup, as served by default), static (the starting revision, never
changed) and adapting (the same revision at first, recording what it serves); both revisions draft a fixed chain of
`evaluate.depth` (no graft, no adaptive plans), so their tau compares the revisions and nothing else. After each window but the last, the adapt loop
(adapt_loop.py) trains a new revision on everything recorded so far, continuing the adapting one, gates it on the newest
recorded rows (`held_back`), and the adapting engine swaps it in when it wins. Per window the report has, for each
engine, live tau at cycle starts (committed tokens per target call: every cycle starts at a server's root) and
generated tokens/s over plain; plus the gate's verdict and the training's steps and CPU seconds. After the last
window, `other_rows` rows of every other cohort are served by the static and the final adapting revision (recording
off): what adapting to one cohort cost the others, live tau at cycle starts side by side.

Not here: the loop itself (adapt_loop.py), the engines (runtime), the offline table of every cohort (serving/bench.py).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import resource
import time
from pathlib import Path
from typing import Any

from speculators.adapt.adapt_loop import run_adapt_loop
from speculators.core.atomic import write_json_atomic
from speculators.core.config import Recipe, TargetConfig, TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.machine import cpu_model
from speculators.core.sampling import SamplingParams
from speculators.core.target import load_target
from speculators.core.workloads import load_workloads
from speculators.runtime.engine import Engine
from speculators.runtime.recording import RecordingSpec

ENGINES = ("plain", "ngram", "static", "adapting")


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _serve(engine: Engine, rows: list[Any]) -> dict:
    """Generate every row at T = 0: tokens, seconds, tau and tokens/s."""
    calls = committed = tokens = 0
    outputs, t0 = [], time.perf_counter()
    for row in rows:
        out = engine.generate(row.messages or row.prompt, SamplingParams(max_new_tokens=row.max_new_tokens))
        outputs.append(out.token_ids)
        calls += out.stats.acceptance.target_calls
        committed += out.stats.acceptance.committed_tokens
        tokens += len(out.token_ids)
    seconds = time.perf_counter() - t0
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens,
            "tau_cycle_starts": round(committed / calls, 4) if calls else 0.0,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0}


def _other_cohorts(engines: dict[str, Engine], rows: list[Any], cohort: str, per_cohort: int) -> dict:
    """Live tau at cycle starts of the static and the adapting revision on `per_cohort` rows of every other cohort."""
    out: dict[str, dict] = {}
    for other in sorted({r.cohort for r in rows} - {cohort}):
        batch = [r for r in rows if r.cohort == other][:per_cohort]
        static, adapting = _serve(engines["static"], batch), _serve(engines["adapting"], batch)
        out[other] = {"rows": len(batch), "static": static["tau_cycle_starts"], "adapting": adapting["tau_cycle_starts"],
                      "delta": round(adapting["tau_cycle_starts"] - static["tau_cycle_starts"], 4),
                      "identical": static["outputs"] == adapting["outputs"]}
    return out


def run_adapt_bench(recipe: Recipe, *, speculator: str, cohort: str, windows: int, window_rows: int, out: Path,
                workloads: str = "data/workloads/*.jsonl", other_rows: int = 2, log: Any = print) -> dict:
    """Run the scenario (see the module docstring); writes `out/adapt-bench.json` and returns the report."""
    every = load_workloads(workloads)
    rows = [r for r in every if r.cohort == cohort]
    if len(rows) < windows * window_rows:
        raise SpeculatorsError(f"cohort {cohort!r} has {len(rows)} rows in {workloads}; {windows} windows of "
                               f"{window_rows} need {windows * window_rows}")
    target = load_target(dataclasses.replace(TargetConfig(name_or_path=recipe.target.name_or_path), device="cpu",
                                             dtype="float32"))
    # the drafters at a fixed chain of the gate's depth, no graft, no adaptive plans: tau measures the revision alone
    chain = TreeConfig(kind="chain", depth=recipe.evaluate.depth, topk=1, budget=recipe.evaluate.depth,
                       adaptive=False)
    engines = {"plain": Engine.from_pretrained(target, "none"), "ngram": Engine.from_pretrained(target, "ngram"),
               **{name: Engine.from_pretrained(target, speculator, tree=chain, adaptive=False, ngram_graft=0)
                  for name in ("static", "adapting")}}
    recording = out / "traffic"
    engines["adapting"].record_to(RecordingSpec(recording))
    engines["plain"].generate(rows[0].messages or rows[0].prompt, SamplingParams(max_new_tokens=8))  # warm-up
    running, report = speculator, {"cpu": cpu_model(), "machine": platform.machine(), "cohort": cohort,
                                   "speculator": speculator, "windows": []}
    for w in range(windows):
        batch = rows[w * window_rows:(w + 1) * window_rows]
        served = {name: _serve(engine, batch) for name, engine in engines.items()}
        plain = served["plain"]
        entry: dict[str, Any] = {"window": w, "rows": len(batch), "revision": running}
        for name, s in served.items():
            entry[name] = {"tau_cycle_starts": s["tau_cycle_starts"], "tokens_per_s": s["tokens_per_s"],
                           "x_plain": round(plain["seconds"] / s["seconds"], 3) if s["seconds"] else 0.0,
                           "identical_to_plain": s["outputs"] == plain["outputs"]}
        if w < windows - 1:
            step = dataclasses.replace(recipe, run_dir=str(out / f"adapt-{w}"))
            step.train = dataclasses.replace(recipe.train, init_from=running)
            step.data = dataclasses.replace(recipe.data, sources=[dataclasses.replace(recipe.data.sources[0],
                                                                                      traffic=str(recording))])
            cpu0 = _cpu_seconds()
            verdict = run_adapt_loop(step, log=log)
            entry["adapt"] = {k: verdict[k] for k in ("adopt", "tau_running", "tau_candidate", "rows", "train_steps")}
            entry["adapt"]["cpu_seconds"] = round(_cpu_seconds() - cpu0, 1)
            if verdict["adopt"]:
                running = verdict["candidate"]
                engines["adapting"].stage_revision(running)
        report["windows"].append(entry)
        log(json.dumps({k: v for k, v in entry.items() if k != "revision"}))
    engines["adapting"].record_to(None)
    if other_rows > 0:
        report["other_cohorts"] = _other_cohorts(engines, every, cohort, other_rows)
        log(json.dumps({"other_cohorts": report["other_cohorts"]}))
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "adapt-bench.json", report)
    return report


def table(report: dict) -> str:
    """The report as a Markdown table: one row per window, tau at cycle starts and x plain per engine."""
    head = "| window | " + " | ".join(f"{e} tau / x plain" for e in ENGINES[1:]) + " | gate (running -> new) |"
    lines = [f"cohort {report['cohort']}, {report['cpu']}", "", head, "|---" * (len(ENGINES) + 1) + "|"]
    for w in report["windows"]:
        cells = [f"{w[e]['tau_cycle_starts']:.2f} / {w[e]['x_plain']:.2f}" for e in ENGINES[1:]]
        gate = w.get("adapt")
        verdict = (f"{gate['tau_running']:.2f} -> {gate['tau_candidate']:.2f} "
                   f"{'adopted' if gate['adopt'] else 'kept'} ({gate['cpu_seconds']} CPU-s)") if gate else ""
        lines.append(f"| {w['window']} | " + " | ".join(cells) + f" | {verdict} |")
    others = report.get("other_cohorts") or {}
    if others:
        lines += ["", "| other cohort (rows) | static tau | adapting tau | delta |", "|---|---:|---:|---:|"]
        lines += [f"| {c} ({o['rows']}) | {o['static']:.2f} | {o['adapting']:.2f} | {o['delta']:+.2f} |"
                  for c, o in others.items()]
    return "\n".join(lines)
