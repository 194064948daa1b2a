"""`speculators regenerate`: the target writes the assistant turns itself, so the speculator learns the target's
own distribution (self-distillation).

For every prepared row, turn by turn: the conversation up to an assistant turn (with the turns regenerated so far)
goes through the chat template with the generation prompt, the target writes the answer (stopping at an
end-of-turn / special token or `data.regenerate.max_new_tokens`), and the answer replaces the original turn.
Rows that end with a user turn get a final answer. Assistant turns that are tool calls and tool results are kept
as they are. Rows of sources with `regenerate: false` (the prepared manifest's `kept_answer_ids`) are not rewritten:
they follow the regenerated rows once each, as prepared, and capture scores them with the target's teacher. Raw
prompt/completion rows get a new completion. The result is re-encoded exactly like `prepare`
(same masks, same length policy) into `regenerated/` (token-dataset format, `stage: regenerate`).

Backends (`data.regenerate.backend`):
- `engine` (default): in-process on the bundled runtime — up to `concurrency` requests sharing each target forward
  (continuous batching) and n-gram or speculator drafting (`runtime/batch_generate.py`); the first
  `crosscheck_rows` rows also run through HF `generate` (batches of `batch_size`, as `local` runs), timed and
  compared side by side (the manifest's `generation.crosscheck`); a target the runtime cannot run
  (`serving.runtime_support.runtime_refusal`) is regenerated as `local` runs, with one log line saying why;
- `local`: batched in-process `model.generate` (left padding) on the target's device;
- `openai`: any OpenAI-compatible server (vLLM, SGLang, `speculators serve`) at `data.regenerate.endpoint`, through
  the `openai` client (regen_openai.py; the endpoint and the model are checked before the first row);
- `vllm`: a vLLM engine this stage starts in the vLLM environment (regen_vllm.py, vllm_engine.py); with
  `capture.backend: vllm` too, `speculators run` keeps it up for capture, which then reuses the prompts and answers
  it just computed (prefix cache): one vLLM launch for both data stages.
Sampling: temperature / top_p / max_new_tokens from the recipe, seeded from `recipe.seed`. Several temperatures
(`data.regenerate.temperature: [0.0, 1.0]`): every row is regenerated once per temperature and written once per
temperature (ids `<id>@T=<t>`, `schemas.copy_id`), so the draft sees the contexts of greedy and of sampling
servers; capture and training keep a row's copies on one side of the train / val split.

No row is ever lost (regen_rows.py keeps every row's state in `regenerated.partial/` across runs): a row is
complete, rejected (it can never be regenerated: prompt longer than `data.max_length`, a request the server refuses
as invalid, text that cannot be re-encoded — listed with its reason) or failed (server error, timeout ...: pending,
tried again by every later run). When more than `data.regenerate.max_failed_fraction` of the rows failed, the stage
fails with one line and writes nothing (the results so far stay in `regenerated.partial/`; the next run tries only
the failed rows). At or below it, `regenerated/` is written without the failed rows, which stay pending:
`is_complete` is false until they succeed, so the next `regenerate` or `run` tries them again and rewrites the output.

This module does not capture hidden states and does not serve models.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import torch
from transformers import GenerationConfig

from speculators.core.atomic import replace_dir, write_json_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.core.target import fingerprint_target, load_target, load_tokenizer, tokenizer_hash
from speculators.data import artifacts
from speculators.data.prepare import KEPT_ANSWER_IDS, RowEncoder, make_encoder
from speculators.data.regen_openai import OpenAIBackend
from speculators.data.regen_progress import RegenProgress
from speculators.data.regen_rows import COMPLETE, FAILED, REJECTED, PartialStore, RowResult, RowState
from speculators.data.regen_tokens import TokenBackend
from speculators.data.regen_vllm import VllmBackend
from speculators.data.schemas import Conversation, RowError, copy_id
from speculators.data.vllm_engine import release
from speculators.runtime.batch_generate import EngineGenerator, crosscheck
from speculators.runtime.forward.support import runtime_refusal

log = logging.getLogger(__name__)

MAX_LISTED_FAILURES = 100


# ----------------------------------------------------------------------------------------------------------------
# backends


class LocalBackend(TokenBackend):
    """Batched `model.generate` with left padding on the target's device — or, with `backend: engine`, the
    bundled runtime (`runtime.batch_generate.EngineGenerator`) on the same loaded target."""

    def __init__(self, recipe: Recipe) -> None:
        self.target = load_target(recipe.target)
        super().__init__(recipe, self.target.tokenizer)
        self.engine: Any = None
        self.crosscheck: dict | None = None
        refusal = runtime_refusal(self.target) if recipe.data.regenerate.backend == "engine" else None
        if refusal:
            log.info("regeneration by HF generate instead of the bundled runtime: %s", refusal)
        elif recipe.data.regenerate.backend == "engine":
            rg = recipe.data.regenerate
            # a request's prompt + budget stay within data.max_length (run_chunk), so the KV caches need no more
            self.engine = EngineGenerator(self.target, rg.drafter, rg.concurrency, recipe.data.max_length)

    def generate_ids(self, prompts: list[list[int]], max_new: list[int], seed: int,
                     temperature: float) -> list[list[int]]:
        hf, engine = partial(self.hf_ids, temperature=temperature), partial(self.engine_ids, temperature=temperature)
        if self.engine is None:
            return hf(prompts, max_new, seed)
        n = min(self.recipe.data.regenerate.crosscheck_rows, len(prompts)) if self.crosscheck is None else 0
        gens = []
        if n > 0:  # the first rows run through both backends, side by side; the engine's answers are kept
            self.crosscheck, gens = crosscheck(
                partial(self.hf_batches, prompts[:n], max_new[:n], seed, temperature=temperature),
                partial(engine, prompts[:n], max_new[:n], seed), temperature == 0)
            self.crosscheck["temperature"] = temperature
        return gens + engine(prompts[n:], max_new[n:], seed + n)

    def engine_ids(self, prompts: list[list[int]], max_new: list[int], seed: int,
                   temperature: float) -> list[list[int]]:
        """The runtime's answers (ids up to and including the first stop token); request j samples with seed+j."""
        rg = self.recipe.data.regenerate
        params = [SamplingParams(max_new_tokens=m, temperature=temperature, top_p=rg.top_p,
                                 seed=(seed + j) % (2**63), stop_token_ids=self.stop_ids)
                  for j, m in enumerate(max_new)]
        return self.engine.generate(prompts, params, on_done=self.finished)

    def hf_batches(self, prompts: list[list[int]], max_new: list[int], seed: int,
                   temperature: float) -> list[list[int]]:
        """`hf_ids` in batches of `data.regenerate.batch_size` (how the `local` backend runs)."""
        size = self.recipe.data.regenerate.batch_size
        return [g for a in range(0, len(prompts), size)
                for g in self.hf_ids(prompts[a:a + size], max_new[a:a + size], seed + a, temperature)]

    def hf_ids(self, prompts: list[list[int]], max_new: list[int], seed: int, temperature: float) -> list[list[int]]:
        """HF `generate`'s answers (ids up to and including the first stop token), one left-padded batch."""
        rg = self.recipe.data.regenerate
        width = max(len(p) for p in prompts)
        inp = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):
            inp[j, width - len(p):] = torch.tensor(p)
            att[j, width - len(p):] = 1
        sample = temperature > 0
        gen_cfg = GenerationConfig(max_new_tokens=max(max_new), do_sample=sample,
                                   temperature=temperature if sample else None,
                                   top_p=rg.top_p if sample else None, top_k=0 if sample else None,
                                   eos_token_id=self.stop_ids, pad_token_id=self.pad)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.target.model.generate(input_ids=inp.to(self.target.device),
                                             attention_mask=att.to(self.target.device), generation_config=gen_cfg)
        gens = []
        for j in range(len(prompts)):
            gen = out[j, width:].tolist()[: max_new[j]]
            stop = next((t for t, x in enumerate(gen) if x in self.stop_ids), None)
            gens.append(gen if stop is None else gen[: stop + 1])
        self.finished(sum(len(g) for g in gens), len(gens))
        return gens


# ----------------------------------------------------------------------------------------------------------------
# stage


def _check_enabled(recipe: Recipe) -> None:
    if not recipe.data.regenerate.enabled:
        raise SpeculatorsError("regeneration is disabled in the recipe; set data.regenerate.enabled=true (capture "
                               "then reads regenerated/ instead of prepared/)")
    rg = recipe.data.regenerate
    temps = rg.temperatures
    if rg.max_new_tokens < 1 or rg.batch_size < 1 or rg.concurrency < 1 or not temps or min(temps) < 0 or \
            not 0 < rg.top_p <= 1:
        raise SpeculatorsError("data.regenerate: max_new_tokens, batch_size, concurrency must be >= 1, "
                               "temperature >= 0 (one, or a non-empty list) and 0 < top_p <= 1")
    if len({f"{t:g}" for t in temps}) != len(temps):
        raise SpeculatorsError(f"data.regenerate.temperature lists a temperature twice: {rg.temperature}")
    if not 0 <= rg.max_failed_fraction < 1:
        raise SpeculatorsError(f"data.regenerate.max_failed_fraction must be in [0, 1), got {rg.max_failed_fraction}")
    if recipe.data.sources and not any(src.regenerate for src in recipe.data.sources):
        raise SpeculatorsError("every data source keeps its answers (regenerate: false): nothing to regenerate; set "
                               "data.regenerate.enabled=false instead")


def inputs_fingerprint(recipe: Recipe, prepared_manifest: dict, tokenizer: Any) -> dict:
    rg = recipe.data.regenerate
    generator = (f"{rg.endpoint}|{rg.model or recipe.target.name_or_path}" if rg.backend == "openai"
                 else fingerprint_target(recipe.target, tokenizer=tokenizer).content_hash)
    extra = {"drafter": rg.drafter} if rg.backend == "engine" else {}  # drafts change sampled paths (T > 0)
    return {**extra, "prepared": artifacts.hash_json([prepared_manifest.get("inputs_hash"), prepared_manifest.get("counts")]),
            "backend": rg.backend, "generator": generator, "temperature": rg.temperature, "top_p": rg.top_p,
            "max_new_tokens": rg.max_new_tokens, "seed": recipe.seed,
            "chunk": {"local": rg.batch_size, "engine": max(rg.concurrency * 4, rg.batch_size)}.get(rg.backend),
            "max_length": recipe.data.max_length, "length_policy": recipe.data.length_policy,
            "chat_template_kwargs": recipe.data.chat_template_kwargs, "tokenizer_hash": tokenizer_hash(tokenizer)}


def _finished(m: dict | None, inputs_hash: str, out_dir: Any) -> bool:
    """A complete output of these inputs, intact, with no row left to try."""
    return bool(m) and m.get("inputs_hash") == inputs_hash and not m.get("counts", {}).get("failed") and \
        artifacts.intact(out_dir, m)


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: when the recipe turns regeneration on (for conversations)."""
    return recipe.data.regenerate.enabled and not recipe.traffic_dirs


def is_complete(recipe: Recipe) -> bool:
    m = artifacts.try_manifest(recipe.paths.regenerated, artifacts.PREPARED_FORMAT)
    if m is None or not recipe.data.regenerate.enabled:
        return False

    try:
        prepared = artifacts.read_manifest(recipe.paths.prepared, artifacts.PREPARED_FORMAT, "prepared data")
        fp = inputs_fingerprint(recipe, prepared, load_tokenizer(recipe.target))
    except SpeculatorsError:
        return False
    return _finished(m, artifacts.hash_json(fp), recipe.paths.regenerated)


def summary_of(m: dict, status: str) -> dict:
    c, t, g = m["counts"], m["tokens"], m["generation"]
    kept = {"kept_answer_rows": c["kept_answers"]} if c.get("kept_answers") else {}
    return {"status": status, "output": m.get("output"), "rows": c["rows"], "failed_rows": c["failed"],
            "rejected_rows": c.get("rejected", 0), **kept, "tokens": t["total"], "masked_share": t["masked_share"],
            "turns_regenerated": g["turns"], "unfinished_turns": g["unfinished"],
            "generated_tokens": g["generated_tokens"], "tokens_per_s": g["tokens_per_s"],
            "bytes_per_token": m.get("bytes_per_token"), "dropped_too_long": c["dropped_too_long"],
            "truncated": c["truncated"], "failed_ids": [f["id"] for f in m.get("failed_rows", [])[:10]],
            "rejected_ids": [f["id"] for f in m.get("rejected_rows", [])[:10]]}


def engine_report(backend: Any) -> dict:
    """The engine backend's counters and its side-by-side check against HF `generate` (empty for others)."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        return {}
    return {"engine": engine.report(), "crosscheck": backend.crosscheck}


def split_rows(ds: Any, prepared_manifest: dict) -> tuple[list[int], list[int]]:
    """(rows the target rewrites, rows whose answers are kept as written: the sources with `regenerate: false`),
    as indices into the prepared dataset."""
    kept_ids = set(prepared_manifest.get(KEPT_ANSWER_IDS) or ())
    rewrite: list[int] = []
    kept: list[int] = []
    for i, row_id in enumerate(ds["id"]):
        (kept if row_id in kept_ids else rewrite).append(i)
    return rewrite, kept


def _job(recipe: Recipe, ds: Any, rows: list[int], j: int) -> RowState:
    """Job j of the stage: row rows[j % n] at the (j // n)-th temperature (temperature-major, so a chunk of jobs
    mostly shares one temperature); with one temperature, job j is that row with its own id."""
    temps, n = recipe.data.regenerate.temperatures, len(rows)
    row, t = ds[rows[j % n]], temps[j // n]
    conv = Conversation.from_json(row["id"] if len(temps) == 1 else copy_id(row["id"], t), row["conversation"])
    return RowState(j, conv, t)


def _generate(recipe: Recipe, ds: Any, rows: list[int], store: PartialStore, backend: Any) -> float:
    """Run the backend over every job still to try, chunk by chunk; returns the generation seconds."""
    seconds = 0.0
    jobs = len(rows) * len(recipe.data.regenerate.temperatures)
    with RegenProgress(jobs, jobs - store.pending()) as progress:
        backend.progress = progress
        for ci, (a, b) in enumerate(store.chunks):
            todo = store.todo(a, b)  # new rows + rows that failed before
            if not todo:
                continue
            states = [_job(recipe, ds, rows, j) for j in todo]
            progress.chunk_started(len(todo))
            t0 = time.time()
            backend.run_chunk(states, recipe.seed * 7919 + ci)
            seconds += time.time() - t0
            store.record(a, b, [st.result() for st in states])
            progress.rows_recorded(jobs - store.pending())
    backend.progress = None
    return seconds


def _check_failures(recipe: Recipe, store: PartialStore, n: int) -> list[RowResult]:
    """The failed rows; SpeculatorsError (nothing written) when there are more than max_failed_fraction of them."""
    failed = store.by_status(FAILED)
    limit = recipe.data.regenerate.max_failed_fraction
    if len(failed) > limit * n:
        done = len(store.by_status(COMPLETE))
        raise SpeculatorsError(f"regenerate: {len(failed)} of {n} rows failed ({len(failed) / n:.1%} > "
                               f"data.regenerate.max_failed_fraction {limit:.1%}); first: {failed[0].id}: "
                               f"{failed[0].error}. The {done} finished rows are kept in {store.dir}: re-run to try "
                               f"the failed ones again")
    return failed


def run(recipe: Recipe, *, force: bool = False) -> dict:
    _check_enabled(recipe)
    ds, prepared_manifest = artifacts.load_token_dataset(recipe.paths.prepared, "prepared data")
    if "conversation" not in ds.column_names:
        raise SpeculatorsError(f"{recipe.paths.prepared} has no 'conversation' column; re-run prepare --force")
    tokenizer = load_tokenizer(recipe.target)
    inputs = inputs_fingerprint(recipe, prepared_manifest, tokenizer)
    inputs_hash = artifacts.hash_json(inputs)
    out_dir = recipe.paths.regenerated
    existing = artifacts.try_manifest(out_dir, artifacts.PREPARED_FORMAT)
    if not force and _finished(existing, inputs_hash, out_dir):
        return summary_of(existing, "complete (skipped)")

    rg = recipe.data.regenerate
    if rg.backend in ("local", "engine"):
        backend: Any = LocalBackend(recipe)
    elif rg.backend == "vllm":
        backend = VllmBackend(recipe)
    else:
        backend = OpenAIBackend(recipe)
        backend.check()  # the endpoint and the model, before the first row
    chunk = rg.batch_size if rg.backend == "local" else max(rg.concurrency * 4, rg.batch_size)
    rows, kept = split_rows(ds, prepared_manifest)
    jobs = len(rows) * len(rg.temperatures)  # one per rewritten row and temperature
    store = PartialStore(out_dir, inputs_hash, inputs, jobs, chunk, force)
    gen_seconds = _generate(recipe, ds, rows, store, backend)
    failed = _check_failures(recipe, store, jobs)
    kept_ds = ds.select(kept).select_columns(["id", "conversation"])  # one columnar read, not a row at a time
    kept_rows = [Conversation.from_json(i, c) for i, c in zip(kept_ds["id"], kept_ds["conversation"], strict=True)]
    manifest = _assemble(recipe, tokenizer, store, (len(ds), kept_rows), (inputs, inputs_hash, prepared_manifest),
                         gen_seconds, engine_report(backend))
    if failed:  # within the tolerance: written without them; they stay pending for the next run
        log.warning("%d of %d rows failed (<= data.regenerate.max_failed_fraction); they are left out of %s and "
                    "will be tried again by the next regenerate / run (first: %s: %s)", len(failed), jobs,
                    out_dir, failed[0].id, failed[0].error)
    else:
        store.remove()
    if rg.backend == "vllm":  # the engine stays up for capture when capture runs through vLLM too
        release(backend.vllm_engine, keep=recipe.capture.backend == "vllm")
    return summary_of(manifest, "done")


def _assemble(recipe: Recipe, tokenizer: Any, store: PartialStore, source: tuple[int, list[Conversation]],
              identity: tuple[dict, str, dict], gen_seconds: float, engine_info: dict) -> dict:
    """Re-encode every complete row exactly like prepare, then the rows kept as written, and write `regenerated/`
    (manifest last); `source`: (prepared rows, the kept rows); `identity`: (inputs, inputs hash, the prepared
    data's manifest); `engine_info`: the engine backend's report."""
    inputs, inputs_hash, prepared_manifest = identity
    n, kept_rows = source
    out_dir = recipe.paths.regenerated
    writer = RowEncoder(make_encoder(recipe, tokenizer), recipe.data)
    rejected: list[RowError] = [RowError(r.id, r.error or "unknown error") for r in store.by_status(REJECTED)]
    failed = [RowError(r.id, f"{r.error} (tried {r.attempts}x; pending)") for r in store.by_status(FAILED)]
    gen = {"turns": 0, "unfinished": 0, "kept_tool_turns": 0, "generated_tokens": 0, "retokenization_mismatch": 0,
           "cut_at_max_length": 0}
    for res in store.by_status(COMPLETE):
        for k in gen:
            gen[k] += int(res.stats.get(k, 0))
        err = writer.add(Conversation.from_json(res.id, res.conversation))
        if err is not None:
            rejected.append(RowError(res.id, f"generated text cannot be re-encoded: {err.reason}"))
    for conv in kept_rows:  # encoded by prepare already: the same encoder and policy keep them as they were
        err = writer.add(conv)
        if err is not None:
            rejected.append(RowError(conv.id, f"kept row cannot be re-encoded: {err.reason}"))
    tally = writer.tally
    if tally.rows == 0:
        first = (rejected + failed)[0] if rejected or failed else None
        raise SpeculatorsError(f"regeneration produced no usable rows ({len(rejected)} rejected, {len(failed)} "
                               "failed" + (f"; first: {first.id}: {first.reason}" if first else "")
                               + f"); partial results are kept in {store.dir}")
    tmp_dir = artifacts.temp_dir_for(out_dir)
    files = artifacts.save_token_dataset(writer.rows, tmp_dir)
    stats = artifacts.token_stats(tally.lengths, tally.masked)
    manifest = {
        "format": artifacts.PREPARED_FORMAT, "stage": "regenerate", "complete": True, "created": artifacts.now(),
        "output": str(out_dir), "files": files, "inputs": inputs, "inputs_hash": inputs_hash,
        "source": {"prepared": str(recipe.paths.prepared), "rows": n,
                   "temperatures": recipe.data.regenerate.temperatures},
        "tokenizer": prepared_manifest.get("tokenizer", {}), "mask_methods": tally.methods,
        "max_length": recipe.data.max_length, "length_policy": recipe.data.length_policy,
        "counts": {"rows_in": (n - len(kept_rows)) * len(recipe.data.regenerate.temperatures) + len(kept_rows),
                   **tally.counts(), "failed": len(failed), "rejected": len(rejected), "kept_answers": len(kept_rows)},
        "failed_rows": [vars(f) for f in failed[:MAX_LISTED_FAILURES]],
        "rejected_rows": [vars(f) for f in rejected[:MAX_LISTED_FAILURES]],
        "generation": {**gen, "backend": recipe.data.regenerate.backend, "seconds_this_run": round(gen_seconds, 2),
                       "tokens_per_s": round(gen["generated_tokens"] / gen_seconds, 1) if gen_seconds else None,
                       **engine_info},
        "tokens": stats, "bytes_per_token": round(artifacts.dir_bytes(tmp_dir) / max(stats["total"], 1), 2),
    }
    write_json_atomic(tmp_dir / artifacts.MANIFEST, manifest)
    replace_dir(tmp_dir, out_dir)
    return manifest
