"""`speculators bench`: speculative vs plain decoding vs Hugging Face, on the same prompts, in one run.

Cohorts come from the held-out workloads (`rows_per_cohort` rows each, each row with its own max_new_tokens).
For every temperature, every method generates every row once after one unmeasured warm-up row:
  plain        this runtime without a drafter (root-only cycles)
  ngram        this runtime with prompt lookup
  <dir name>   this runtime with each speculator given (its pairing is checked)
  +ngram       the same speculator with `ngram_graft` prompt-lookup nodes grafted onto its trees (graft.py)
  <m>+record   with `record`: plain and each speculator again, recording their traffic (runtime/recording.py):
               the recorder's cost beside the same method without it
  hf           Hugging Face `generate` (greedy, or do_sample with top_k=0 / top_p=1 at T > 0, seeded per row)
  hf-assisted  Hugging Face assisted decoding with prompt lookup (`prompt_lookup_num_tokens`)
  <dir name> chain token|block, <dir name> sampled token|traversal   (with `compare_verify`, T > 0 only)
               each speculator at a FIXED tree (the engine's default depth / top-k / budget, adaptive off): a chain
               sampled from the draft law verified token by token ("iid") vs by block verification, and a sampled
               tree (spine + sibling draws without replacement) verified token by token ("without_replacement") vs
               by traversal verification. The sequence-verified rows also report a PAIRED comparison: on each of
               their cycles the exact expected accepted drafts of both verifiers on that very tree and target rows
               (`verify_expect.expected_accepted`), as "paired_tau" {token, sequence} — free of the coin noise that
               makes live tau of two separate runs differ by several percent
The tree flags (`speculators bench --tree chain --depth K --no-adaptive`) replace the speculators' own drafting
settings, e.g. the fixed-depth chains `speculators profile` predicts; `--no-hf` leaves out the HF rows.
With `batch` B > 1, every runtime method also generates all rows once more with up to B requests sharing each
target forward (`<method>@batchB` rows, cohort "all" only: throughput of the whole set, as a server under
concurrent load sees it; at T = 0 their tokens are checked against `plain` too).
Runtime requests are unseeded (as served by default: adaptive depth). It reports generated tokens/s per cohort
and overall (wall clock including prefill, generated tokens only; also per CPU-second of this process, which other
processes sharing the cores do not inflate),
the ratios to `plain` and to `hf`, and for runtime methods tau and per-position acceptance
(`metrics.AcceptanceStats`) and where their cycles went: a cycle's and its forward's milliseconds, drafting's per
drafted token (each also in plain steps under the table), and per plan the cycle seconds the controller predicted
against those measured, start to next start. At T = 0 it also counts rows whose tokens differ from `plain` (lossless check).
Returns the report and its Markdown table (cli.py prints it); with `out` writes `bench.json` and `bench.md` there
(atomically).

Not here: option parsing and printing (cli.py), generation itself (engine.py), evaluation of checkpoints
(speculators.evaluate).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speculators.core.atomic import write_text_atomic
from speculators.core.config import TargetConfig, TreeConfig, tree_config
from speculators.core.errors import SpeculatorsError
from speculators.core.machine import device_name
from speculators.core.metrics import AcceptanceStats
from speculators.core.options import BenchOptions, floats
from speculators.core.sampling import SamplingParams
from speculators.core.target import load_target
from speculators.core.trees import TOKEN_WISE_MODES
from speculators.core.workloads import load_workloads
from speculators.runtime.batch_generate import TREE_ROOM
from speculators.runtime.batching import generate_batch
from speculators.runtime.drafters.load import paired_target
from speculators.runtime.engine import Engine
from speculators.runtime.forward.memory import work_max_len
from speculators.runtime.recording import RecordingSpec
from speculators.runtime.requests import encode_prompt
from speculators.runtime.verify.expect import expected_accepted

HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass
class _Cell:
    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (not inflated by other processes sharing the cores)
    rows: int = 0
    acceptance: AcceptanceStats | None = None
    mismatched_rows: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # speculative cycles per drafted tree kind (runtime)
    plans: dict[str, int] = field(default_factory=dict)  # cycles per plan: plain, lookup, model, model+lookup
    # plan -> [timed cycles, predicted seconds, measured seconds] (adaptive requests: the controller's own timing)
    plan_seconds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_cpu_second(self) -> float:
        return self.tokens / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


@dataclass
class Method:
    name: str
    kind: str  # "runtime" | "hf" | "hf-assisted"
    engine: Any = None
    cells: dict[str, _Cell] = field(default_factory=dict)
    sampled_only: bool = False  # verifier comparisons: the same rows as greedy decoding at T = 0

# verifier comparisons (`compare_verify`): (row suffix, tree kind, TreeConfig.verify)
VERIFY_ROWS = (("chain token", "chain", "token"), ("chain block", "chain", "sequence"),
               ("sampled token", "sampled", "token"), ("sampled traversal", "sampled", "sequence"))


def _paired_engine_class() -> type:
    class PairedEngine(Engine):
        """An engine that, before verifying each sampled draft by block / traversal, adds the exact expected accepted
        drafts of that draft under this mode and under the token-wise mode to `paired` (same tree, same rows)."""

        paired: dict[str, float]

        def _verify(self, tree: Any, target_row: Any, params: Any, generator: Any) -> tuple[list[int], int]:
            if not params.greedy and tree.mode in TOKEN_WISE_MODES and tree.size > 1:
                t0, c0 = time.perf_counter(), time.process_time()
                totals = self.__dict__.setdefault("paired", dict.fromkeys(("cycles", "token", "sequence", "seconds",
                                                                           "cpu_seconds"), 0.0))
                totals["cycles"] += 1
                for key, mode in (("sequence", tree.mode), ("token", TOKEN_WISE_MODES[tree.mode])):
                    totals[key] += expected_accepted(tree.tokens, tree.parents, target_row, tree.draft_probs, mode)
                totals["seconds"] += time.perf_counter() - t0  # left out of the row's measured time
                totals["cpu_seconds"] += time.process_time() - c0
            return super()._verify(tree, target_row, params, generator)

    return PairedEngine


def _verify_methods(loaded: Any, path: str, name: str, tree: TreeConfig | None, max_len: int) -> list[Method]:
    """The `compare_verify` rows of one speculator: fixed trees of the engine's default shape (or `tree`'s),
    adaptive off; the sequence-verified ones also measure the paired expectations."""
    out = []
    for suffix, kind, verify in VERIFY_ROWS:
        cls = _paired_engine_class() if verify == "sequence" else Engine
        engine = cls.from_pretrained(loaded, path, ngram_graft=0, tree=tree, max_len=max_len)
        engine.set_tree(dataclasses.replace(engine.tree, kind=kind, verify=verify), adaptive=False)
        out.append(Method(f"{name} {suffix}", "runtime", engine, sampled_only=True))
    return out


def _paired(method: Method, key: str) -> float:
    """Seconds (`key`: "seconds" or "cpu_seconds") a paired-comparison engine spent on its expectations."""
    return float(getattr(method.engine, "paired", {}).get(key, 0.0))


def _hf_generate(model: Any, ids: list[int], max_new: int, temperature: float, seed: int, assisted: bool) -> list[int]:
    inp = torch.tensor([ids], device=model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new, "attention_mask": torch.ones_like(inp),
                              "pad_token_id": model.generation_config.pad_token_id}
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if assisted:
        kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
    with torch.no_grad():
        out = model.generate(inp, **kwargs)
    return out[0, len(ids):].tolist()


def run_methods(methods: list[Method], rows: list[tuple[str, list[int], int]], temperature: float, seed: int,
                model: Any) -> list[list[list[int]]]:
    """Every method on every row, row by row (each row runs all methods back to back, so a machine whose speed
    drifts during the run slows every method alike); fills `method.cells`; returns outputs[method][row]."""
    def one(method: Method, ids: list[int], max_new: int, row_seed: int) -> tuple[list[int], Any]:
        if method.kind == "runtime":
            # unseeded: a seeded sampled request drafts at a fixed depth (reproducibility), and the bench
            # measures what serving does by default (adaptive depth)
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature)
            out = method.engine.generate(ids, params)
            return out.token_ids, out.stats
        return _hf_generate(model, ids, max_new, temperature, row_seed, method.kind == "hf-assisted"), None

    outputs: list[list[list[int]]] = [[] for _ in methods]
    for method in methods:
        method.cells = {}
        one(method, rows[0][1], min(rows[0][2], 16), seed)  # warm-up (and the engine's calibration), not measured
        if method.engine is not None:
            method.engine.__dict__.pop("paired", None)  # paired expectations count the measured rows only
    for i, (cohort, ids, max_new) in enumerate(rows):
        for method, outs in zip(methods, outputs, strict=True):
            p0, pc0 = _paired(method, "seconds"), _paired(method, "cpu_seconds")
            t0, c0 = time.perf_counter(), time.process_time()
            tokens, stats = one(method, ids, max_new, seed + i)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            seconds -= _paired(method, "seconds") - p0  # a paired comparison's expectations are not decoding
            cpu -= _paired(method, "cpu_seconds") - pc0
            outs.append(tokens)
            for key in (cohort, "all"):
                cell = method.cells.setdefault(
                    key, _Cell(acceptance=AcceptanceStats() if method.kind == "runtime" else None))
                cell.tokens += len(tokens)
                cell.seconds += seconds
                cell.cpu_seconds += cpu
                cell.rows += 1
                if stats is not None and cell.acceptance is not None:
                    cell.acceptance.merge(stats.acceptance)
                    for kind, n in stats.adaptive.get("kind_histogram", {}).items():
                        cell.kinds[kind] = cell.kinds.get(kind, 0) + n
                    for plan, n in stats.adaptive.get("plan_histogram", {}).items():
                        cell.plans[plan] = cell.plans.get(plan, 0) + n
                    for plan, t in stats.adaptive.get("cycle_seconds_by_plan", {}).items():
                        row = cell.plan_seconds.setdefault(plan, [0, 0.0, 0.0])
                        row[0], row[1], row[2] = row[0] + t["cycles"], row[1] + t["predicted"], row[2] + t["measured"]
    return outputs


def _run_batched(methods: list[Method], rows: list[tuple[str, list[int], int]], temperature: float,
                 batch: int) -> list[tuple[Method, list[list[int]]]]:
    """Every runtime method on all rows at once, `batch` requests sharing each target forward; returns the new
    `<method>@batchB` methods (cell "all") with their outputs in row order."""
    params = [SamplingParams(max_new_tokens=max_new, temperature=temperature) for _, _, max_new in rows]
    done = []
    for method in [m for m in methods if m.kind == "runtime" and not m.sampled_only]:  # comparisons: batch 1 only
        t0 = time.perf_counter()
        outs = generate_batch(method.engine, [ids for _, ids, _ in rows], params, max_batch=batch)
        seconds = time.perf_counter() - t0
        cell = _Cell(tokens=sum(len(o.token_ids) for o in outs), seconds=seconds, rows=len(outs),
                     acceptance=AcceptanceStats())
        for o in outs:
            cell.acceptance.merge(o.stats.acceptance)
        batched = Method(f"{method.name}@batch{batch}", "runtime", method.engine, cells={"all": cell})
        done.append((batched, [o.token_ids for o in outs]))
    return done


def bench_rows(engine: Any, workloads: str, rows_per_cohort: int) -> list[tuple[str, list[int], int]]:
    """(cohort, prompt token ids, max_new_tokens) of the first `rows_per_cohort` rows of every cohort (`engine`: an
    `Engine` or anything with its `tokenizer`)."""
    return [(r.cohort, encode_prompt(engine.tokenizer, r.prompt if r.prompt is not None else r.messages),
             r.max_new_tokens) for r in load_workloads([workloads], max_rows_per_cohort=rows_per_cohort)]


def bench_target(target: str | None, speculators: list[str]) -> TargetConfig:
    """The target to bench: `target` when given, else the one the first speculator's pairing.json names (the house
    target when there is no speculator)."""
    if target:
        return TargetConfig(name_or_path=target)
    return paired_target(speculators[0] if speculators else None)


def bench_command(opts: BenchOptions) -> tuple[dict, str]:
    """Run the benchmark `opts` describes, write `bench.json` / `bench.md` to `opts.out` if given; (the report, its
    Markdown table). The tree flags replace each speculator's default drafting settings (e.g. a fixed-depth chain
    with adaptive off, as `speculators profile` predicts); `hf=False` leaves out the Hugging Face rows;
    `compare_verify` adds the verifier comparisons at T > 0."""
    temperatures = floats(opts.temperatures, "--temperatures")
    tree = tree_config(opts.tree, opts.depth, opts.topk, opts.budget, opts.adaptive)
    if opts.rows_per_cohort < 1:
        raise SpeculatorsError(f"--rows-per-cohort must be >= 1, got {opts.rows_per_cohort}")
    if opts.batch < 0:
        raise SpeculatorsError(f"--batch must be >= 0 (0 or 1: no batched rows), got {opts.batch}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise SpeculatorsError(f"--temperatures must be non-negative numbers, got {temperatures}")
    speculators = opts.speculator or []
    threads = torch.get_num_threads()  # set by the caller (`speculators bench --threads`); every method shares it
    target_cfg = bench_target(opts.target, speculators)
    loaded = load_target(dataclasses.replace(target_cfg, device=opts.device, dtype=opts.dtype))
    rows = bench_rows(loaded, opts.workloads, opts.rows_per_cohort)
    # every engine's KV caches hold the longest row and its draft trees, not the target's whole context
    max_len = work_max_len([len(ids) for _, ids, _ in rows], [n for _, _, n in rows], TREE_ROOM)
    methods = _methods(loaded, speculators, tree, opts, temperatures, max_len)
    report: dict[str, Any] = {
        "target": target_cfg.name_or_path, "device": loaded.device, "dtype": str(loaded.dtype).replace("torch.", ""),
        "threads": threads, "machine": device_name(loaded.device),
        "rows_per_cohort": opts.rows_per_cohort, "rows": len(rows), "workloads": opts.workloads, "seed": opts.seed,
        "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS, "batch": opts.batch, "results": {},
        "speculator_tree": None if tree is None else dataclasses.asdict(tree),
    }
    for temperature in temperatures:
        report["results"][str(temperature)] = _run_temperature(methods, rows, temperature, opts.seed, opts.batch,
                                                               loaded.model)
    text = format_bench_report(report)
    if opts.out is not None:
        write_json_and_markdown(opts.out, "bench", report, text)
    return report, text


def _methods(loaded: Any, speculators: list[str], tree: TreeConfig | None, opts: BenchOptions,
             temperatures: list[float], max_len: int) -> list[Method]:
    """plain, ngram, each speculator (and its grafted and verifier-comparison variants), then the HF rows."""
    methods = [Method("plain", "runtime", Engine.from_pretrained(loaded, None, max_len=max_len)),
               Method("ngram", "runtime", Engine.from_pretrained(loaded, "ngram", max_len=max_len))]
    for path in speculators:
        engine = Engine.from_pretrained(loaded, path, ngram_graft=0, tree=tree, max_len=max_len)  # the speculator
        methods.append(Method(f"{engine.info.family}:{Path(path).name}", "runtime", engine))
        if opts.ngram_graft:  # the same speculator with prompt-lookup nodes grafted onto its trees
            grafted = Engine.from_pretrained(loaded, path, ngram_graft=opts.ngram_graft, tree=tree, max_len=max_len)
            methods.append(Method(f"{engine.info.family}+ngram:{Path(path).name}", "runtime", grafted))
        if opts.compare_verify and any(t > 0 for t in temperatures):
            methods += _verify_methods(loaded, path, f"{engine.info.family}:{Path(path).name}", tree, max_len)
    if opts.record is not None:  # plain and each speculator recording their traffic: the recorder's cost
        for path in [None, *speculators]:
            engine = Engine.from_pretrained(loaded, path, ngram_graft=0, tree=tree, max_len=max_len)
            name = "plain" if path is None else f"{engine.info.family}:{Path(path).name}"
            engine.record_to(RecordingSpec(Path(opts.record) / name.replace(":", "-")))
            methods.append(Method(f"{name}+record", "runtime", engine))
    for method in methods:  # --cost-cache: each starts from the costs an engine like it left on this machine
        method.engine.cost_cache = opts.cost_cache
    if opts.hf:
        methods += [Method("hf", "hf"), Method("hf-assisted", "hf-assisted")]
    return methods


def _run_temperature(all_methods: list[Method], rows: list[tuple[str, list[int], int]], temperature: float,
                     seed: int, batch: int, model: Any) -> dict:
    """Every method at one temperature (the verifier comparisons at T > 0 only), checked against `plain` at
    T = 0; the summary per cohort."""
    methods = [m for m in all_methods if temperature > 0 or not m.sampled_only]
    outputs = run_methods(methods, rows, temperature, seed, model)
    batched = _run_batched(methods, rows, temperature, batch) if batch > 1 else []
    if temperature == 0:  # greedy: every method must produce plain decoding's tokens
        for method, outs in zip(methods[1:], outputs[1:], strict=True):
            for (cohort, _, _), got, want in zip(rows, outs, outputs[0], strict=True):
                if got != want:
                    method.cells[cohort].mismatched_rows += 1
                    method.cells["all"].mismatched_rows += 1
        for method, outs in batched:
            method.cells["all"].mismatched_rows = sum(got != want for got, want in zip(outs, outputs[0], strict=True))
    return _summarise(methods + [m for m, _ in batched])


def _summarise(methods: list[Method]) -> dict:
    base = {m.name: m for m in methods}
    out: dict[str, dict] = {}
    for m in methods:
        for cohort, cell in m.cells.items():
            plain = base["plain"].cells[cohort].tokens_per_second
            hf = base["hf"].cells[cohort].tokens_per_second if "hf" in base else None
            tps = cell.tokens_per_second
            entry = {"tokens": cell.tokens, "seconds": round(cell.seconds, 4), "tokens_per_second": round(tps, 2),
                     "tokens_per_cpu_second": round(cell.tokens_per_cpu_second, 2),
                     "vs_plain": round(tps / plain, 3) if plain else None,
                     "vs_hf": round(tps / hf, 3) if hf else None, "mismatched_rows": cell.mismatched_rows}
            if cell.acceptance is not None:
                entry["tau"] = round(cell.acceptance.tau, 3)
                entry["per_position_acceptance"] = [round(a, 3) for a in cell.acceptance.per_position_acceptance]
                if cell.kinds:  # what the adaptive controller drafted (speculative cycles per tree kind)
                    entry["drafted_kinds"] = dict(sorted(cell.kinds.items()))
                if cell.plans:  # the controller's choices: share of cycles per plan
                    total = sum(cell.plans.values())
                    entry["plan_share"] = {k: round(v / total, 3) for k, v in sorted(cell.plans.items())}
                entry.update(_cycle_costs(cell.acceptance))
                if cell.plan_seconds:  # per plan: mean predicted and measured ms of a cycle, start to next start
                    entry["plan_cycle_ms"] = {k: {"cycles": int(n), "predicted": round(1e3 * p / n, 3),
                                                  "measured": round(1e3 * m / n, 3)}
                                              for k, (n, p, m) in sorted(cell.plan_seconds.items()) if n}
            paired = getattr(m.engine, "paired", None) if cohort == "all" else None
            if paired and paired["cycles"]:
                token, seq = (1 + paired[k] / paired["cycles"] for k in ("token", "sequence"))
                entry["paired_tau"] = {"token": round(token, 4), "sequence": round(seq, 4),
                                       "gain": round(seq / token - 1, 4), "cycles": int(paired["cycles"])}
            out.setdefault(cohort, {})[m.name] = entry
    return out


def _cycle_costs(acc: AcceptanceStats) -> dict:
    """Where a method's cycles went (ms): per cycle (drafting + target forward + verification and commits), and
    drafting per drafted token (plan choice, absorbing features and proposing)."""
    if not acc.target_calls:
        return {}
    out = {"cycle_ms": round(1e3 * (acc.draft_seconds + acc.verify_seconds + acc.accept_seconds) / acc.target_calls,
                             3),
           "forward_ms": round(1e3 * acc.verify_seconds / acc.target_calls, 3)}
    if acc.drafted_tokens:
        out["draft_ms_per_drafted_token"] = round(1e3 * acc.draft_seconds / acc.drafted_tokens, 3)
    return out


def cost_lines(cohorts: dict) -> list[str]:
    """One line per speculative method (cohort "all"): its cycle and drafting costs in plain steps."""
    step = cohorts.get("all", {}).get("plain", {}).get("cycle_ms")
    lines = []
    for name, e in cohorts.get("all", {}).items():
        if not step or "draft_ms_per_drafted_token" not in e:
            continue
        timed = "; ".join(f"{PLAN_LABELS.get(k, k)} {t['predicted']:.1f} / {t['measured']:.1f} ms"
                          for k, t in e.get("plan_cycle_ms", {}).items())
        lines.append(f"`{name}`: a cycle {e['cycle_ms']:.1f} ms = {e['cycle_ms'] / step:.2f} plain steps (its "
                     f"forward {e['forward_ms'] / step:.2f}); drafting {e['draft_ms_per_drafted_token']:.2f} ms per "
                     f"drafted token = {e['draft_ms_per_drafted_token'] / step:.3f} of a plain step ({step:.1f} ms)"
                     + (f"; cycle predicted / measured per plan: {timed}." if timed else "."))
    return lines + [""] if lines else []


def format_bench_report(report: dict) -> str:
    """The Markdown table (also what the terminal shows)."""
    lines = [f"# speculators bench — {report['target']} on {report['device']} ({report['dtype']}, "
             f"{report['threads']} threads), {report['rows']} rows ({report['rows_per_cohort']} per cohort)", "",
             f"Machine: {report.get('machine', '?')}. Plans: share of cycles drafting nothing (plain), the prompt "
             "lookup alone (L), the model drafter (M) or both (M+L).", ""]
    for temperature, cohorts in report["results"].items():
        lines += [f"## T = {temperature}", "",
                  "| cohort | method | tok/s | × plain | × HF generate | tau | per-position acceptance | "
                  "plans | rows ≠ plain |", "|---|---|---:|---:|---:|---:|---|---|---:|"]
        order = sorted(cohorts, key=lambda c: (c == "all", c))
        for cohort in order:
            for name, e in cohorts[cohort].items():
                acc = " ".join(f"{a:.2f}" for a in e.get("per_position_acceptance", [])) or "-"
                tau = f"{e['tau']:.2f}" if "tau" in e else "-"
                mism = str(e["mismatched_rows"]) if float(temperature) == 0 else "-"
                vs_hf = "-" if e["vs_hf"] is None else f"{e['vs_hf']:.2f}"
                lines.append(f"| {cohort} | {name} | {e['tokens_per_second']:.1f} | {e['vs_plain']:.2f} | "
                             f"{vs_hf} | {tau} | {acc} | {plan_shares(e.get('plan_share', {}))} | {mism} |")
        lines.append("")
        lines += cost_lines(cohorts)
        for name, e in cohorts.get("all", {}).items():
            if "paired_tau" in e:
                pt = e["paired_tau"]
                lines.append(f"Paired on the {pt['cycles']} cycles of `{name}` (same drafts and target rows, exact "
                             f"expectation over the verifier's coins): tau {pt['token']:.3f} token-wise -> "
                             f"{pt['sequence']:.3f} ({100 * pt['gain']:+.1f}%).")
                lines.append("")
    return "\n".join(lines)


PLAN_LABELS = {"plain": "plain", "lookup": "L", "model": "M", "model+lookup": "M+L"}


def plan_shares(share: dict[str, float]) -> str:
    """'M 80% · L 15% · plain 5%': the plans' shares of a method's cycles, largest first ('-' when none)."""
    parts = sorted(share.items(), key=lambda kv: -kv[1])
    return " · ".join(f"{PLAN_LABELS.get(k, k)} {100 * v:.0f}%" for k, v in parts if v > 0) or "-"


def write_json_and_markdown(out: Path, stem: str, report: dict, text: str) -> None:
    """`out/<stem>.json` and `out/<stem>.md`, each written atomically (core/atomic.py)."""
    for name, content in ((f"{stem}.json", json.dumps(report, indent=2) + "\n"), (f"{stem}.md", text + "\n")):
        write_text_atomic(Path(out) / name, content)
