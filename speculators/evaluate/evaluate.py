"""The `evaluate` stage: per-position acceptance of every kept checkpoint on HELD-OUT workloads, and the choice
of `checkpoints/best` by acceptance (never by loss).

For every row of `recipe.evaluate.workloads` and every temperature in `recipe.evaluate.temperatures`:
  1. the target writes its own continuation (`teacher.continuations`, cached in eval/continuations.json);
  2. one tapped target forward over prompt + continuation (`teacher.teacher_pass`) gives the features every
     speculator asks for (`required_features()`) and the teacher logits;
  3. every checkpoint's `forward_train` gives per-step draft logits, scored per position and depth by
     `alpha.speculator_alpha` (and at T > 0 by `alpha.speculator_block_alpha`: block verification of the same sampled
     chain); the n-gram baseline (the served prompt lookup, `NgramDrafter.lookup`) by `alpha.ngram_alpha`;
  4. per cohort: chain reach -> a_k -> simulated tau (`speculators.core.metrics`, via `alpha.summarize`).
Then `select.choose_best` picks the highest mean simulated tau at `evaluate.select_temperature`, the bundled
runtime measures live acceptance of that checkpoint and of the n-gram drafter (`evaluate.live`), and the stage
writes eval/<step>/{report.json, report.md, per_position.png, tau.png}, eval/selection.json, eval/report.md,
eval/selection.png and `checkpoints/best` (atomic); with W&B among `train.trackers`, the report (per-cohort tau,
the plots, the checkpoint choice) also goes to the training run's W&B run.

`evaluate.baselines` (speculators of other runs, `baselines.py`) are scored in the same pass on the same rows and
continuations, cached in eval/baselines.json and shown side by side with the best checkpoint in eval/report.md.

A target the bundled runtime cannot run (`runtime_support.runtime_refusal`: its `UnsupportedTargetError` message,
asked once) is still evaluated: the continuations are written by HF `generate`, the live / predicted-vs-live part is
skipped, one log line says why, and the reports and selection.json record the reason (`runtime_unavailable`, shown
as one line in report.md and eval/report.md). Teacher-forced acceptance and the checkpoint choice are unchanged.

Report record (eval/<step>/report.json, format "speculators.eval/v1"): checkpoint, step, family, draft_revision,
eval_key (what the numbers depend on: target revision, rows, temperatures, depth, seed), target, workloads,
rows, cohorts, depth (evaluate.depth), speculator_depth (min(depth, K)), temperatures {"<T>": {"speculator":
summary, "speculator_block": summary of block verification (T > 0 only), "ngram": summary at the speculator's depth
with its "cycle_starts" (the fair comparison: the same positions and depth as the speculator's), "ngram_full_depth":
summary at evaluate.depth}} where summary = {"cohorts": {cohort: {rows, positions, per_position_acceptance,
chain_reach, simulated_tau, tau_by_depth}}, "overall": pooled, "mean_tau": mean over cohorts}, live (or null), loss,
continuation_backend (who wrote the continuations), runtime_unavailable (why the runtime cannot run the target, or
null).

Checkpoints whose report already matches (same draft revision and eval_key) are not re-evaluated unless forced.
The same code evaluates every family: it never branches on a family name.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from speculators.core.atomic import atomic_dir, write_json_atomic
from speculators.core.checkpoints import describe_incomplete, list_checkpoints, read_pointer, step_number, write_pointer
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import temperature_key
from speculators.core.pairing import check_pairing, draft_revision, read_pairing
from speculators.core.recipes import to_dict
from speculators.core.sampling import SamplingParams
from speculators.core.target import fingerprint_target, load_target
from speculators.core.tracking import log_evaluation, wandb_options
from speculators.core.workloads import WorkloadRow, load_workloads
from speculators.evaluate import baselines as baseline_runs
from speculators.evaluate.agreement import serving_agreement
from speculators.evaluate.alpha import (
    AlphaAccumulator,
    ngram_alpha,
    per_sequence_memo,
    speculator_block_alpha,
    truncate,
)
from speculators.evaluate.drafts import draft_logits
from speculators.evaluate.live import pick_rows
from speculators.evaluate.replay import CycleCounts, proposer_chain_weights, replay_chain
from speculators.evaluate.report import write_checkpoint_report, write_overview
from speculators.evaluate.select import (
    SELECTION_FORMAT,
    checkpoint_family,
    checkpoint_loss,
    choose_best,
    selection_record,
)
from speculators.evaluate.tally import CeilingTally, SpeculatorTally, cycle_summary
from speculators.evaluate.teacher import EvalSequence, continuations, crosscheck_record, teacher_pass
from speculators.models.base import speculator_depth
from speculators.models.io import load_speculator, target_weights
from speculators.runtime.drafters.model_free import NgramDrafter
from speculators.runtime.forward import support as runtime_support

EVAL_FORMAT = "speculators.eval/v1"

log = logging.getLogger(__name__)


def eval_key(fingerprint: dict, rows: list[WorkloadRow], recipe: Recipe, backend: str | None = None) -> str:
    """Hash of everything the analytic numbers depend on besides the checkpoint itself; `backend`: who wrote the
    continuations (default the recipe's `evaluate.continuation_backend`)."""
    ev = recipe.evaluate
    h = hashlib.sha256(json.dumps({"format": EVAL_FORMAT, "target": [fingerprint["revision"],
                                   fingerprint["content_hash"]], "temperatures": [float(t) for t in ev.temperatures],
                                   "depth": ev.depth, "seed": recipe.seed,
                                   "continuations": backend or ev.continuation_backend}, sort_keys=True).encode())
    for r in rows:
        h.update(json.dumps([r.id, r.cohort, r.prompt, r.messages, r.max_new_tokens], sort_keys=True).encode())
    return h.hexdigest()[:32]


def _check_settings(recipe: Recipe) -> None:
    ev = recipe.evaluate
    if not ev.temperatures:
        raise SpeculatorsError("evaluate.temperatures is empty; give at least one, e.g. [0.0, 1.0]")
    if any(t < 0 for t in ev.temperatures):
        raise SpeculatorsError(f"evaluate.temperatures {ev.temperatures} must be >= 0 (0 = greedy)")
    if ev.depth < 1:
        raise SpeculatorsError(f"evaluate.depth must be >= 1, got {ev.depth}")
    if float(ev.select_temperature) not in [float(t) for t in ev.temperatures]:
        raise SpeculatorsError(f"evaluate.select_temperature {ev.select_temperature} is not one of "
                               f"evaluate.temperatures {ev.temperatures}")


def _checkpoints(recipe: Recipe) -> list[Path]:
    ckdir = recipe.paths.checkpoints
    found = list_checkpoints(ckdir)
    if not found:
        raise SpeculatorsError(f"no checkpoints to evaluate in {ckdir} (expected step-* directories written by "
                               f"`speculators train`); run the train stage first{describe_incomplete(ckdir)}")
    for c in found:
        fam = checkpoint_family(c)
        if fam != recipe.speculator.family:
            raise SpeculatorsError(f"checkpoint {c} is a {fam} speculator but the recipe says speculator.family="
                                   f"{recipe.speculator.family}; point run_dir at the right run or fix the recipe")
    return found


def _existing_report(eval_dir: Path, ckpt: Path, key: str) -> dict | None:
    path = eval_dir / ckpt.name / "report.json"
    try:
        rep = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rep.get("format") != EVAL_FORMAT or rep.get("eval_key") != key:
        return None
    if rep.get("draft_revision") != draft_revision(ckpt):
        return None
    return rep


# ----------------------------------------------------------------------------------------------------------------
# teacher-forced evaluation of many checkpoints at once (one target pass per sequence)


def evaluate_sequences(specs: dict[str, Any], sequences: dict[float, list[EvalSequence]], depth: int,
                       model: Any, progress: bool = True, teacher_topk: int = 20
                       ) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict], dict[str, int]]:
    """Teacher-forced acceptance of every speculator and of the n-gram baseline on the given sequences: every
    position ("cohorts"), at a server's cycle starts ("cycle_starts"; at T > 0 also with argmax drafts,
    "cycle_starts_argmax_drafts") and, at T > 0, the ceilings a top-k teacher / the draft vocabulary put on a
    sampled draft ("ceilings"); see `tally.py`. At T > 0 also the acceptance of block verification of the
    speculator's sampled chain (`alpha.speculator_block_alpha`).

    Returns (per-speculator {"<T>": summary}, per-speculator {"<T>": summary under block verification} for T > 0,
    n-gram {"<T>": summary}, per-speculator depth).
    """
    requests = {name: spec.required_features() for name, spec in specs.items()}
    union = sorted({i for r in requests.values() for i in (r.tap_layer_ids or ())})
    depths = {name: speculator_depth(depth, spec.num_steps) for name, spec in specs.items()}
    tallies = {name: SpeculatorTally(depths[name], spec.draft_to_target, list(sequences)) for name, spec in specs.items()}
    ceilings = CeilingTally(depth, teacher_topk, next(iter(specs.values())).draft_to_target, list(sequences))
    block_acc = {name: {temperature_key(t): AlphaAccumulator(depths[name]) for t in sequences if t > 0}
                 for name in specs}
    ngram_acc = {temperature_key(t): AlphaAccumulator(depth) for t in sequences}
    # the n-gram at a server's cycle starts, at each speculator's depth and at evaluate.depth: {T: {d: {cohort: ..}}}
    ngram_depths = sorted({depth, *depths.values()})
    lookup = NgramDrafter().lookup  # the prompt lookup the runtime serves (its n-gram lengths)
    ngram_cycles: dict[str, dict[int, dict[str, CycleCounts]]] = {
        temperature_key(t): {d: {} for d in ngram_depths} for t in sequences}
    bar = tqdm(total=sum(len(v) for v in sequences.values()), desc="teacher-forced acceptance", unit="seq",
               disable=not progress)
    for t, seqs in sequences.items():
        params = SamplingParams(temperature=float(t))
        for seq in seqs:
            tp = teacher_pass(model, seq.token_ids, union)
            teacher_logits = tp.logits.cpu()
            for name, spec in specs.items():
                req = requests[name]
                steps = draft_logits(spec, seq.token_ids, tp.features(req.tap_layer_ids, req.last_hidden),
                                     seq.prompt_len, depths[name])  # K x [T, Vd]
                tallies[name].add(seq, steps, teacher_logits, t)
                if t > 0:
                    block_acc[name][temperature_key(t)].add(seq.row.cohort, *speculator_block_alpha(
                        steps, teacher_logits, spec.draft_to_target.cpu(), seq.prompt_len, params, depths[name]))
            ceilings.add(seq, teacher_logits, t)
            propose = per_sequence_memo(lookup)  # one lookup per position, shared by both scores
            alpha, valid = ngram_alpha(seq.token_ids, teacher_logits, seq.prompt_len, params, depth, propose)
            ngram_acc[temperature_key(t)].add(seq.row.cohort, alpha, valid)
            w = proposer_chain_weights(seq.token_ids, seq.prompt_len, depth, propose)  # [N, D]; every d <= depth
            for d, store in ngram_cycles[temperature_key(t)].items():
                counts = replay_chain(w[:, :d], seq.prompt_len, len(seq.token_ids), seq.row.max_new_tokens, d)
                store.setdefault(seq.row.cohort, CycleCounts(d)).merge(counts)
            bar.update(1)
    bar.close()
    sums = {name: {temperature_key(t): tally.summary(temperature_key(t), ceilings) for t in sequences}
            for name, tally in tallies.items()}
    return (sums, {name: {t: a.summary() for t, a in accs.items()} for name, accs in block_acc.items()},
            {t: {**a.summary(), "cycle_starts_by_depth": {str(d): cycle_summary(c)
                                                          for d, c in ngram_cycles[t].items()}}
             for t, a in ngram_acc.items()}, depths)


def ngram_at_depth(summary: dict, depth: int) -> dict:
    """The n-gram entry of one temperature at a speculator's depth: every position (`truncate`) and a server's
    cycle starts ("cycle_starts", the same walk as the speculator's), so both drafters are compared at the same
    positions and depth."""
    cyc = (summary.get("cycle_starts_by_depth") or {}).get(str(depth))
    return {**truncate(summary, depth), **({"cycle_starts": cyc} if cyc is not None else {})}


# ----------------------------------------------------------------------------------------------------------------
# the stage


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: always."""
    return True


def run(recipe: Recipe, *, force: bool = False, progress: bool = True) -> dict:
    _check_settings(recipe)
    ev = recipe.evaluate
    ckpts = _checkpoints(recipe)
    rows = load_workloads(ev.workloads, ev.max_rows_per_cohort)
    eval_dir = recipe.paths.eval
    target = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=target.tokenizer, model_config=target.model.config).to_dict()
    for c in ckpts:
        check_pairing(read_pairing(c), fp, allow_revision_mismatch=recipe.serve.allow_revision_mismatch)
    refusal, backend = _runtime_plan(recipe, target)
    key = eval_key(fp, rows, recipe, backend)

    baselines = baseline_runs.resolve(recipe)
    for b in baselines:
        if b.path is not None:
            check_pairing(read_pairing(b.path), fp, allow_revision_mismatch=recipe.serve.allow_revision_mismatch)
    cache = baseline_runs.read_cache(eval_dir)
    stale = [] if not baselines else baseline_runs.stale(baselines, cache, key)

    reports: dict[str, dict] = {}
    todo = []
    for c in ckpts:
        rep = None if force else _existing_report(eval_dir, c, key)
        if rep is None:
            todo.append(c)
        else:
            reports[c.name] = rep
    if todo or stale:
        weights = target_weights(target.model)
        specs = {}
        for name, path in [*((c.name, c) for c in todo), *((b.spec_name, b.path) for b in stale)]:
            spec = load_speculator(path, weights)
            spec.to(target.device).float().eval()
            specs[name] = spec
        seqs = continuations(target, rows, ev.temperatures, recipe.seed, fp["revision"] + fp["content_hash"],
                             eval_dir / "continuations.json", backend, ev.crosscheck_rows, progress,
                             ev.concurrency)
        spec_sums, block_sums, ngram_sums, depths = evaluate_sequences(specs, seqs, ev.depth, target.model, progress,
                                                                       recipe.capture.teacher_topk)
        for c in todo:
            reports[c.name] = {
                "format": EVAL_FORMAT, "checkpoint": c.name, "step": step_number(c),
                "family": checkpoint_family(c), "draft_revision": draft_revision(c), "eval_key": key,
                "target": {"name_or_path": fp["name_or_path"], "revision": fp["revision"]},
                "workloads": list(ev.workloads), "rows": len(rows),
                "cohorts": sorted({r.cohort for r in rows}), "depth": ev.depth,
                "speculator_depth": depths[c.name],
                "temperatures": {t: {"speculator": spec_sums[c.name][t],
                                     **({"speculator_block": block_sums[c.name][t]} if t in block_sums[c.name] else {}),
                                     "ngram": ngram_at_depth(ngram_sums[t], depths[c.name]),
                                     "ngram_full_depth": ngram_sums[t]}
                                 for t in spec_sums[c.name]},
                "live": None, "live_rows_per_cohort": None, "loss": checkpoint_loss(c),
                "continuation_backend": backend, "runtime_unavailable": refusal,
            }
        for b in stale:
            cache[b.label] = baseline_runs.cache_entry(b, key, depths[b.spec_name], spec_sums[b.spec_name])
        del specs
    best = choose_best(reports, ev.select_temperature)
    todo_names = _live_step(recipe, target, fp, rows, reports[best], {c.name for c in todo}, refusal, force, progress)
    if baselines:
        eval_dir.mkdir(parents=True, exist_ok=True)
        baseline_runs.write_cache(eval_dir, cache, baselines)
    selection = _write_outputs(recipe, reports, best, todo_names, baseline_runs.record(baselines, cache))
    if "wandb" in recipe.train.trackers:  # the report joins the training run in W&B (when training had one)
        eval_dir = recipe.paths.eval
        log_evaluation(recipe.paths.logs, wandb_options(recipe.train), selection,
                       {"selection": eval_dir / "selection.png", "per_position": eval_dir / best / "per_position.png",
                        "tau": eval_dir / best / "tau.png"})
    return _summary(recipe, reports, best, len(todo))


def _runtime_plan(recipe: Recipe, target: Any) -> tuple[str | None, str]:
    """(why the bundled runtime cannot run the target, or None; who writes the continuations). The runtime is asked
    only when evaluation would use it (continuations by `engine`, or live acceptance); a refusal means HF `generate`
    and no live columns, said in one log line."""
    ev = recipe.evaluate
    refusal = runtime_support.runtime_refusal(target) if ev.continuation_backend == "engine" or ev.live else None
    if refusal is None:
        return None, ev.continuation_backend
    log.warning("evaluating without the bundled runtime (target continuations by HF generate, no live or "
                "predicted-vs-live columns): %s", refusal)
    return refusal, "local"


def _live_step(recipe: Recipe, target: Any, fp: dict, rows: list[WorkloadRow], report: dict, changed: set[str],
               refusal: str | None, force: bool, progress: bool) -> set[str]:
    """Measure (or, for a target the runtime cannot run, record why not) the live acceptance of the best
    checkpoint's `report` when it is new or missing; -> the names of the reports to (re)write."""
    ev = recipe.evaluate
    name = report["checkpoint"]
    if not ev.live:
        return changed
    if refusal is not None:
        if report.get("live") is None and report.get("runtime_unavailable") == refusal:
            return changed
        report.update(live=None, live_rows_per_cohort=None, runtime_unavailable=refusal)
        return changed | {name}
    if force or report.get("live") is None or name in changed:
        report["live"] = _live(recipe, target, fp, rows, name, progress)
        report["live_rows_per_cohort"] = ev.live_rows_per_cohort
        report["runtime_unavailable"] = None
        return changed | {name}
    return changed


def _live(recipe: Recipe, target: Any, fp: dict, rows: list[WorkloadRow], best: str, progress: bool) -> dict:
    """Predicted vs live acceptance of the best checkpoint on `evaluate.live_rows_per_cohort` rows per cohort
    (`agreement.serving_agreement`: the same chain / tree / n-gram chain on the same rows)."""
    ev = recipe.evaluate
    chosen = pick_rows(rows, ev.live_rows_per_cohort)
    seqs = continuations(target, chosen, ev.temperatures, recipe.seed, fp["revision"] + fp["content_hash"],
                         recipe.paths.eval / "continuations.json", ev.continuation_backend, ev.crosscheck_rows,
                         progress, ev.concurrency)
    spec_dir = recipe.paths.checkpoints / best
    spec = load_speculator(spec_dir, target_weights(target.model))
    spec.to(target.device).float().eval()
    k = ev.serving_chain_depth or recipe.export.speculative_tokens
    return serving_agreement(target, spec, str(spec_dir), seqs, k, recipe.seed, recipe.serve.allow_revision_mismatch,
                             progress)


def _write_outputs(recipe: Recipe, reports: dict[str, dict], best: str, changed: set[str],
                   baselines: list[dict]) -> dict:
    eval_dir = recipe.paths.eval
    eval_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(changed):
        with atomic_dir(eval_dir / name) as tmp:
            write_checkpoint_report(tmp, reports[name])
    selection = selection_record(reports, best, recipe.evaluate.select_temperature, recipe.paths.checkpoints)
    selection["eval_key"] = reports[best]["eval_key"]
    selection["recipe"] = to_dict(recipe.evaluate)
    selection["continuation_backend"] = reports[best].get("continuation_backend", recipe.evaluate.continuation_backend)
    selection["runtime_unavailable"] = reports[best].get("runtime_unavailable")
    selection["baselines"] = baselines
    write_overview(eval_dir, selection, reports)
    if recipe.evaluate.select_best:
        write_pointer(recipe.paths.checkpoints, "best", recipe.paths.checkpoints / best)
    write_json_atomic(eval_dir / "selection.json", selection)  # the manifest: written last
    return selection


def _summary(recipe: Recipe, reports: dict[str, dict], best: str, evaluated: int) -> dict:
    t = temperature_key(recipe.evaluate.select_temperature)
    entry = reports[best]["temperatures"][t]
    out: dict[str, Any] = {
        "checkpoints": len(reports), "evaluated": evaluated, "best": best,
        f"tau@T={t} (best)": {c: s["simulated_tau"] for c, s in entry["speculator"]["cohorts"].items()},
        f"tau@T={t} (n-gram)": {c: s["simulated_tau"] for c, s in entry["ngram"]["cohorts"].items()},
        "mean tau (best / n-gram)": f"{entry['speculator']['mean_tau']:.3f} / {entry['ngram']['mean_tau']:.3f}",
    }
    cyc = entry["speculator"].get("cycle_starts") or {}
    if cyc.get("mean_tau") is not None:
        out["mean tau at cycle starts (best, predicted serving)"] = f"{cyc['mean_tau']:.3f}"
    live = (reports[best].get("live") or {}).get(t)
    if live:
        out[f"live tau@T={t} (best / n-gram)"] = (f"{live['speculator']['overall']['tau']:.3f} / "
                                                   f"{live['ngram_live']['overall']['tau']:.3f}")
        for name in ("chain", "tree"):
            o = live[name]["cohorts"].get("overall") or {}
            if o:
                out[f"{name} tau@T={t} predicted / live"] = (f"{o['predicted']['tau']:.3f} / {o['live']['tau']:.3f}"
                                                             f" ({'agree' if o['agree'] else 'DISAGREE'})")
    if reports[best].get("runtime_unavailable"):
        out["without the bundled runtime (continuations by HF generate, no live columns)"] = (
            reports[best]["runtime_unavailable"])
    check = crosscheck_record(recipe.paths.eval / "continuations.json")
    if check:
        out["target continuations: runtime vs HF generate (first greedy rows)"] = (
            f"{check['identical']}/{check['rows']} identical · {check['speedup']}x wall · {check['speedup_cpu']}x CPU")
    out["report"] = str(recipe.paths.eval / "report.md")
    return out


def is_complete(recipe: Recipe) -> bool:
    """selection.json matches the current checkpoints, eval settings and target; best pointer and reports exist."""
    eval_dir = recipe.paths.eval
    try:
        selection = json.loads((eval_dir / "selection.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if selection.get("format") != SELECTION_FORMAT or not selection.get("complete"):
        return False
    ckpts = list_checkpoints(recipe.paths.checkpoints)
    recorded = {row["checkpoint"]: row.get("draft_revision") for row in selection.get("checkpoints", [])}
    if sorted(recorded) != sorted(c.name for c in ckpts):
        return False
    for c in ckpts:
        if recorded[c.name] != draft_revision(c) or not (eval_dir / c.name / "report.json").is_file():
            return False
    if recipe.evaluate.select_best:
        try:
            best = read_pointer(recipe.paths.checkpoints, "best")
        except SpeculatorsError:
            return False
        if best is None or best.name != selection.get("best"):
            return False
    unavailable = selection.get("runtime_unavailable")  # the runtime cannot run the target: no live part, HF's tokens
    if recipe.evaluate.live and selection.get("live") is None and not unavailable:
        return False
    try:
        if not baseline_runs.matches(selection.get("baselines"), baseline_runs.resolve(recipe)):
            return False
    except SpeculatorsError:
        return False
    backend = selection.get("continuation_backend") or recipe.evaluate.continuation_backend
    if backend != recipe.evaluate.continuation_backend and not (unavailable and backend == "local"):
        return False
    try:
        rows = load_workloads(recipe.evaluate.workloads, recipe.evaluate.max_rows_per_cohort)
        fp = fingerprint_target(recipe.target).to_dict()
    except SpeculatorsError:
        return False
    return selection.get("eval_key") == eval_key(fp, rows, recipe, backend)
