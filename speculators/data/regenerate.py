"""`speculators regenerate`: the target writes the assistant turns itself, so the speculator learns the target's
own distribution (self-distillation).

For every prepared row, turn by turn: the conversation up to an assistant turn (with the turns regenerated so far)
goes through the chat template with the generation prompt, the target writes the answer (stopping at an
end-of-turn / special token or `data.regenerate.max_new_tokens`), and the answer replaces the original turn.
Rows that end with a user turn get a final answer. Assistant turns that are tool calls and tool results are kept
as they are. Raw prompt/completion rows get a new completion. The result is re-encoded exactly like `prepare`
(same masks, same length policy) into `regenerated/` (token-dataset format, `stage: regenerate`).

Backends (`data.regenerate.backend`):
- `engine` (default): in-process on the bundled runtime — up to `concurrency` requests sharing each target forward
  (continuous batching) and n-gram or speculator drafting (`regenerate_engine.py`); the first `crosscheck_rows` rows
  also run through HF `generate` (batches of `batch_size`, as `local` runs), timed and compared side by side (the
  manifest's `generation.crosscheck`);
- `local`: batched in-process `model.generate` (left padding) on the target's device;
- `openai`: any OpenAI-compatible server (vLLM, SGLang, `speculators serve`) at `data.regenerate.endpoint`,
  `POST {endpoint}/chat/completions` (raw rows: `/completions`) from a pool of `concurrency` threads, with
  retries (timeouts, 429, 5xx).
Sampling: temperature / top_p / max_new_tokens from the recipe, seeded from `recipe.seed`. Resumable: finished
chunks of rows live in `regenerated.partial/`; a re-run skips the rows done and retries the rows that failed
(e.g. while the server was down). Rows that fail (server errors, prompts
longer than `data.max_length`, generated text that cannot be re-encoded) are listed by id in the summary and the
manifest, never dropped silently.

This module does not capture hidden states and does not serve models.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.config import Recipe
from speculators.data import artifacts
from speculators.data.prepare import RowEncoder, make_encoder
from speculators.data.schemas import Conversation, RowError
from speculators.errors import SpeculatorsError

MAX_LISTED_FAILURES = 100


@dataclass
class Turn:
    """One generated answer."""

    text: str
    finished: bool  # stopped on an end-of-turn token (not max tokens / another special token)
    tokens: int
    reasoning: str | None = None
    retokenized_same: bool | None = None  # local backend: decode -> encode gives back the generated ids


class RowFailed(Exception):
    """A row that could not be regenerated (one-line reason)."""


@dataclass
class RowResult:
    index: int
    id: str
    ok: bool
    conversation: str | None = None
    error: str | None = None
    stats: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(vars(self), ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------------
# turn-by-turn driver (backend-independent)


class RowState:
    """Walks one conversation, asking for a generation at each assistant turn to rewrite."""

    def __init__(self, index: int, conv: Conversation) -> None:
        self.index, self.conv = index, conv
        self.history: list[dict] = []
        self.pos = 0
        self.done = False
        self.failed: str | None = None
        self.stats = {"turns": 0, "unfinished": 0, "kept_tool_turns": 0, "generated_tokens": 0,
                      "retokenization_mismatch": 0, "cut_at_max_length": 0}
        self.completion: str | None = None
        if conv.is_chat:
            self._advance()

    def _advance(self) -> None:
        msgs = self.conv.messages
        while self.pos < len(msgs):
            m = msgs[self.pos]
            if m["role"] == "assistant" and not m.get("tool_calls"):
                return  # generation needed here
            if m["role"] == "assistant":
                self.stats["kept_tool_turns"] += 1
            self.history.append(dict(m))
            self.pos += 1
        if self.history and self.history[-1]["role"] != "assistant":
            return  # a final answer is needed
        self.done = True

    @property
    def needs_generation(self) -> bool:
        return not self.done and self.failed is None

    def accept(self, turn: Turn) -> None:
        self.stats["turns"] += 1
        self.stats["generated_tokens"] += turn.tokens
        self.stats["unfinished"] += int(not turn.finished)
        self.stats["retokenization_mismatch"] += int(turn.retokenized_same is False)
        if not self.conv.is_chat:
            self.completion = turn.text
            self.done = True
            return
        msg: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if turn.reasoning:
            msg["reasoning_content"] = turn.reasoning
        self.history.append(msg)
        if self.pos < len(self.conv.messages):
            self.pos += 1
            self._advance()
        else:
            self.done = True

    def cut(self) -> None:
        """The prompt no longer fits data.max_length: keep what was regenerated so far."""
        if self.stats["turns"] == 0:
            self.failed = "the prompt is longer than data.max_length (nothing left to generate)"
            return
        while self.history and self.history[-1]["role"] != "assistant":
            self.history.pop()
        self.stats["cut_at_max_length"] += 1
        self.done = True

    def result(self) -> RowResult:
        if self.failed:
            return RowResult(self.index, self.conv.id, False, error=self.failed, stats=self.stats)
        if self.conv.is_chat:
            out = Conversation(id=self.conv.id, messages=self.history, tools=self.conv.tools)
        else:
            out = Conversation(id=self.conv.id, prompt=self.conv.prompt, completion=self.completion)
        return RowResult(self.index, self.conv.id, True, conversation=out.to_json(), stats=self.stats)


# ----------------------------------------------------------------------------------------------------------------
# backends


class LocalBackend:
    """Batched `model.generate` with left padding on the target's device — or, with `backend: engine`, the
    bundled runtime (`regenerate_engine.EngineGenerator`) on the same loaded target."""

    def __init__(self, recipe: Recipe) -> None:
        from speculators.target import load_target

        self.recipe = recipe
        self.target = load_target(recipe.target)
        self.tok = self.target.tokenizer
        self.encoder = make_encoder(recipe, self.tok)
        self.encoder._probe_terminator()
        self.terminators = set(self.encoder.terminators)
        self.stop_ids = sorted(self.terminators | {int(i) for i in self.tok.all_special_ids if i is not None})
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop_ids[0]
        self.engine: Any = None
        self.crosscheck: dict | None = None
        if recipe.data.regenerate.backend == "engine":
            from speculators.data.regenerate_engine import EngineGenerator

            rg = recipe.data.regenerate
            self.engine = EngineGenerator(self.target, rg.drafter, rg.concurrency)

    def prompt_ids(self, st: RowState) -> list[int]:
        if st.conv.is_chat:
            return self.encoder.prompt_ids(st.history, st.conv.tools)
        ids = list(self.tok(st.conv.prompt, add_special_tokens=True)["input_ids"])
        return ids[:-1] if ids and ids[-1] == self.tok.eos_token_id else ids

    def generate(self, prompts: list[list[int]], max_new: list[int], seed: int) -> list[Turn]:
        if self.engine is None:
            gens = self.hf_ids(prompts, max_new, seed)
        else:
            from speculators.data.regenerate_engine import crosscheck

            n = min(self.recipe.data.regenerate.crosscheck_rows, len(prompts)) if self.crosscheck is None else 0
            gens = []
            if n > 0:  # the first rows run through both backends, side by side; the engine's answers are kept
                self.crosscheck, gens = crosscheck(self.hf_batches, self.engine_ids, prompts[:n], max_new[:n], seed,
                                                   self.recipe.data.regenerate.temperature == 0)
            gens += self.engine_ids(prompts[n:], max_new[n:], seed + n)
        turns = []
        for gen in gens:
            stop = next((t for t, x in enumerate(gen) if x in self.stop_ids), None)
            body = gen if stop is None else gen[:stop]
            finished = stop is not None and gen[stop] in self.terminators
            text = self.tok.decode(body, skip_special_tokens=False)
            same = list(self.tok(text, add_special_tokens=False)["input_ids"]) == body
            turns.append(Turn(text=text, finished=finished, tokens=len(body) + int(stop is not None),
                              retokenized_same=same))
        return turns

    def engine_ids(self, prompts: list[list[int]], max_new: list[int], seed: int) -> list[list[int]]:
        """The runtime's answers (ids up to and including the first stop token); request j samples with seed+j."""
        from speculators.serving.sampling import SamplingParams

        rg = self.recipe.data.regenerate
        params = [SamplingParams(max_new_tokens=m, temperature=rg.temperature, top_p=rg.top_p,
                                 seed=(seed + j) % (2**63), stop_token_ids=self.stop_ids)
                  for j, m in enumerate(max_new)]
        return self.engine.generate(prompts, params)

    def hf_batches(self, prompts: list[list[int]], max_new: list[int], seed: int) -> list[list[int]]:
        """`hf_ids` in batches of `data.regenerate.batch_size` (how the `local` backend runs)."""
        size = self.recipe.data.regenerate.batch_size
        return [g for a in range(0, len(prompts), size) for g in self.hf_ids(prompts[a:a + size], max_new[a:a + size],
                                                                             seed + a)]

    def hf_ids(self, prompts: list[list[int]], max_new: list[int], seed: int) -> list[list[int]]:
        """HF `generate`'s answers (ids up to and including the first stop token), one left-padded batch."""
        import torch
        from transformers import GenerationConfig

        rg = self.recipe.data.regenerate
        width = max(len(p) for p in prompts)
        inp = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):
            inp[j, width - len(p):] = torch.tensor(p)
            att[j, width - len(p):] = 1
        sample = rg.temperature > 0
        gen_cfg = GenerationConfig(max_new_tokens=max(max_new), do_sample=sample,
                                   temperature=rg.temperature if sample else None,
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
        return gens

    def run_chunk(self, states: list[RowState], seed: int) -> None:
        rg, max_len = self.recipe.data.regenerate, self.recipe.data.max_length
        round_ = 0
        while True:
            active = [st for st in states if st.needs_generation]
            if not active:
                return
            prompts, budgets, ready = [], [], []
            for st in active:
                try:
                    p = self.prompt_ids(st)
                except Exception as exc:  # noqa: BLE001 - template errors on a regenerated history
                    st.failed = f"cannot render the conversation: {(str(exc).splitlines() or ['?'])[0]}"
                    continue
                budget = min(rg.max_new_tokens, max_len - len(p) - 1)  # room for the end-of-turn token
                if budget < 1:
                    st.cut()
                    continue
                prompts.append(p)
                budgets.append(budget)
                ready.append(st)
            if ready:
                for st, turn in zip(ready, self.generate(prompts, budgets, seed * 1_000_003 + round_), strict=True):
                    st.accept(turn)
            round_ += 1


class OpenAIBackend:
    """An OpenAI-compatible server: /chat/completions (chat rows) and /completions (raw rows)."""

    def __init__(self, recipe: Recipe) -> None:
        rg = recipe.data.regenerate
        if not rg.endpoint:
            raise SpeculatorsError("data.regenerate.backend=openai needs data.regenerate.endpoint "
                                   "(e.g. http://127.0.0.1:8000/v1)")
        if not rg.endpoint.startswith(("http://", "https://")):
            raise SpeculatorsError(f"data.regenerate.endpoint {rg.endpoint!r} must start with http:// or https://")
        self.recipe = recipe
        self.base = rg.endpoint.rstrip("/")
        self.model = rg.model or recipe.target.name_or_path
        self.key = os.environ.get(rg.api_key_env) if rg.api_key_env else None

    def _post(self, path: str, body: dict) -> dict:
        rg = self.recipe.data.regenerate
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        last = "no attempt"
        for attempt in range(rg.max_retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            req = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=rg.request_timeout) as resp:
                    return json.loads(resp.read().decode())
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:200].replace("\n", " ")
                last = f"HTTP {exc.code} from {self.base}{path}: {detail}"
                if exc.code != 429 and exc.code < 500:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as exc:
                last = f"{self.base}{path}: {getattr(exc, 'reason', exc)}"
        raise RowFailed(last)

    def _turn(self, st: RowState) -> Turn:
        rg = self.recipe.data.regenerate
        body: dict[str, Any] = {"model": self.model, "max_tokens": rg.max_new_tokens, "temperature": rg.temperature,
                                "top_p": rg.top_p, "seed": self.recipe.seed * 1_000_003 + st.index + st.stats["turns"]}
        if st.conv.is_chat:
            body["messages"] = st.history
            if st.conv.tools:
                body["tools"] = st.conv.tools
            if self.recipe.data.chat_template_kwargs:
                body["chat_template_kwargs"] = self.recipe.data.chat_template_kwargs
            out = self._post("/chat/completions", body)
        else:
            body["prompt"] = st.conv.prompt
            out = self._post("/completions", body)
        try:
            choice = out["choices"][0]
            if st.conv.is_chat:
                msg = choice["message"]
                text, reasoning = msg.get("content") or "", msg.get("reasoning_content") or msg.get("reasoning")
            else:
                text, reasoning = choice["text"], None
        except (KeyError, IndexError, TypeError):
            raise RowFailed(f"unexpected response from {self.base}: {json.dumps(out)[:200]}") from None
        usage = out.get("usage") or {}
        return Turn(text=text, finished=choice.get("finish_reason") != "length", reasoning=reasoning,
                    tokens=int(usage.get("completion_tokens", 0)))

    def _row(self, st: RowState) -> None:
        try:
            while st.needs_generation:
                st.accept(self._turn(st))
        except RowFailed as exc:
            st.failed = str(exc)

    def run_chunk(self, states: list[RowState], seed: int) -> None:
        del seed  # per-request seeds come from the row index
        with ThreadPoolExecutor(max_workers=max(1, self.recipe.data.regenerate.concurrency)) as pool:
            list(pool.map(self._row, states))


# ----------------------------------------------------------------------------------------------------------------
# stage


def _check_enabled(recipe: Recipe) -> None:
    if not recipe.data.regenerate.enabled:
        raise SpeculatorsError("regeneration is disabled in the recipe; set data.regenerate.enabled=true (capture "
                               "then reads regenerated/ instead of prepared/)")
    rg = recipe.data.regenerate
    if rg.max_new_tokens < 1 or rg.batch_size < 1 or rg.concurrency < 1 or rg.temperature < 0 or \
            not 0 < rg.top_p <= 1:
        raise SpeculatorsError("data.regenerate: max_new_tokens, batch_size, concurrency must be >= 1, "
                               "temperature >= 0 and 0 < top_p <= 1")


def inputs_fingerprint(recipe: Recipe, prepared_manifest: dict, tokenizer: Any) -> dict:
    from speculators.target import fingerprint_target, tokenizer_hash

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


def is_complete(recipe: Recipe) -> bool:
    m = artifacts.try_manifest(recipe.paths.regenerated, artifacts.PREPARED_FORMAT)
    if m is None or not recipe.data.regenerate.enabled:
        return False
    from speculators.target import load_tokenizer

    try:
        prepared = artifacts.read_manifest(recipe.paths.prepared, artifacts.PREPARED_FORMAT, "prepared data")
        fp = inputs_fingerprint(recipe, prepared, load_tokenizer(recipe.target))
    except SpeculatorsError:
        return False
    return m.get("inputs_hash") == artifacts.hash_json(fp)


def summary_of(m: dict, status: str) -> dict:
    c, t, g = m["counts"], m["tokens"], m["generation"]
    return {"status": status, "output": m.get("output"), "rows": c["rows"], "failed_rows": c["failed"],
            "tokens": t["total"], "masked_share": t["masked_share"], "turns_regenerated": g["turns"],
            "unfinished_turns": g["unfinished"], "generated_tokens": g["generated_tokens"],
            "tokens_per_s": g["tokens_per_s"], "bytes_per_token": m.get("bytes_per_token"),
            "dropped_too_long": c["dropped_too_long"],
            "truncated": c["truncated"], "failed_ids": [f["id"] for f in m.get("failed_rows", [])[:10]]}


def engine_report(backend: Any) -> dict:
    """The engine backend's counters and its side-by-side check against HF `generate` (empty for others)."""
    engine = getattr(backend, "engine", None)
    if engine is None:
        return {}
    return {"engine": engine.report(), "crosscheck": backend.crosscheck}


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _part_file(partial: Path, a: int, b: int) -> Path:
    return partial / f"part-{a:08d}-{b:08d}.jsonl"


def _read_part(partial: Path, a: int, b: int) -> dict[int, RowResult]:
    path = _part_file(partial, a, b)
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            res = RowResult(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            return {}  # unreadable part: redo the chunk
        out[res.index] = res
    return out


def run(recipe: Recipe, *, force: bool = False) -> dict:
    from tqdm import tqdm

    from speculators.target import load_tokenizer

    _check_enabled(recipe)
    ds, prepared_manifest = artifacts.load_token_dataset(recipe.paths.prepared, "prepared data")
    if "conversation" not in ds.column_names:
        raise SpeculatorsError(f"{recipe.paths.prepared} has no 'conversation' column; re-run prepare --force")
    tokenizer = load_tokenizer(recipe.target)
    inputs = inputs_fingerprint(recipe, prepared_manifest, tokenizer)
    inputs_hash = artifacts.hash_json(inputs)
    out_dir = recipe.paths.regenerated
    existing = artifacts.try_manifest(out_dir, artifacts.PREPARED_FORMAT)
    if not force and existing and existing.get("inputs_hash") == inputs_hash:
        return summary_of(existing, "complete (skipped)")

    rg = recipe.data.regenerate
    backend: LocalBackend | OpenAIBackend = OpenAIBackend(recipe) if rg.backend == "openai" else LocalBackend(recipe)
    partial = out_dir.with_name(out_dir.name + ".partial")
    marker = partial / "inputs.json"
    if partial.exists():
        try:
            same = json.loads(marker.read_text()).get("inputs_hash") == inputs_hash
        except (OSError, json.JSONDecodeError):
            same = False
        if force or not same:
            shutil.rmtree(partial)
    if not partial.exists():
        partial.mkdir(parents=True)
        artifacts.write_json_atomic(marker, {"inputs_hash": inputs_hash, "inputs": inputs})

    n = len(ds)
    chunk = rg.batch_size if rg.backend == "local" else max(rg.concurrency * 4, rg.batch_size)
    chunks = _chunks(n, chunk)
    done: dict[tuple[int, int], dict[int, RowResult]] = {c: _read_part(partial, *c) for c in chunks}
    left = sum(1 for a, b in chunks for i in range(a, b) if not (i in done[(a, b)] and done[(a, b)][i].ok))
    gen_seconds = 0.0
    with tqdm(total=n, initial=n - left, desc="regenerate", unit=" rows", dynamic_ncols=True) as bar:
        for ci, (a, b) in enumerate(chunks):
            results = done[(a, b)]
            todo = [i for i in range(a, b) if not (i in results and results[i].ok)]  # new rows + earlier failures
            if not todo:
                continue
            states = [RowState(i, Conversation.from_json(ds[i]["id"], ds[i]["conversation"])) for i in todo]
            t0 = time.time()
            backend.run_chunk(states, recipe.seed * 7919 + ci)
            gen_seconds += time.time() - t0
            for st in states:
                results[st.index] = st.result()
            tmp = _part_file(partial, a, b).with_suffix(".tmp")
            tmp.write_text("".join(results[i].to_json() + "\n" for i in range(a, b)))
            os.replace(tmp, _part_file(partial, a, b))
            bar.update(len(todo))

    # assemble: every row from the parts, re-encoded exactly like prepare
    writer = RowEncoder(make_encoder(recipe, tokenizer), recipe.data)
    failed: list[RowError] = []
    gen = {"turns": 0, "unfinished": 0, "kept_tool_turns": 0, "generated_tokens": 0, "retokenization_mismatch": 0,
           "cut_at_max_length": 0}
    for a, b in chunks:
        for i in range(a, b):
            res = done[(a, b)][i]
            for k in gen:
                gen[k] += int(res.stats.get(k, 0))
            if not res.ok:
                failed.append(RowError(res.id, res.error or "unknown error"))
                continue
            err = writer.add(Conversation.from_json(res.id, res.conversation))
            if err is not None:
                failed.append(RowError(res.id, f"generated text cannot be re-encoded: {err.reason}"))
    tally = writer.tally
    if tally.rows == 0:
        first = failed[0] if failed else None
        raise SpeculatorsError(f"regeneration produced no usable rows ({len(failed)} failed"
                               + (f"; first: {first.id}: {first.reason}" if first else "")
                               + f"); partial results are kept in {partial}")
    total_gen_seconds = gen_seconds or 1e-9
    tmp_dir = artifacts.temp_dir_for(out_dir)
    artifacts.save_token_dataset(writer.rows, tmp_dir)
    stats = artifacts.token_stats(tally.lengths, tally.masked)
    manifest = {
        "format": artifacts.PREPARED_FORMAT, "stage": "regenerate", "complete": True, "created": artifacts.now(),
        "output": str(out_dir), "inputs": inputs, "inputs_hash": inputs_hash,
        "source": {"prepared": str(recipe.paths.prepared), "rows": n},
        "tokenizer": prepared_manifest.get("tokenizer", {}), "mask_methods": tally.methods,
        "max_length": recipe.data.max_length, "length_policy": recipe.data.length_policy,
        "counts": {"rows_in": n, **tally.counts(), "failed": len(failed)},
        "failed_rows": [vars(f) for f in failed[:MAX_LISTED_FAILURES]],
        "generation": {**gen, "backend": rg.backend, "seconds_this_run": round(gen_seconds, 2),
                       "tokens_per_s": round(gen["generated_tokens"] / total_gen_seconds, 1) if gen_seconds else None,
                       **engine_report(backend)},
        "tokens": stats, "bytes_per_token": round(artifacts.dir_bytes(tmp_dir) / max(stats["total"], 1), 2),
    }
    artifacts.write_json_atomic(tmp_dir / artifacts.MANIFEST, manifest)
    artifacts.replace_dir(tmp_dir, out_dir)
    shutil.rmtree(partial, ignore_errors=True)
    if failed:
        print(f"warning: {len(failed)} of {n} rows could not be regenerated; they are listed in "
              f"{out_dir / artifacts.MANIFEST} (failed_rows)")
    return summary_of(manifest, "done")
