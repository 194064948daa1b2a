"""The target's side of a teacher-forced evaluation: prompts, the target's own continuations, one tapped forward.

- `encode_row`: a workload row -> prompt token ids (raw `prompt` with the tokenizer's special tokens, or
  `messages` through the target's chat template with the generation prompt).
- `continuations`: the target's own continuation of every row (greedy for T=0, sampled with a per-row fixed seed
  for T>0, no top-k/top-p), written by the bundled runtime with many rows sharing each target forward
  (`serving.batch_generate`, `evaluate.continuation_backend: engine`) or by HF `generate` one row at a time
  (`local`, how evaluation ran before); cached in `eval/continuations.json` per row (the row's content and
  temperature) under a key made of the target revision, the seed and the backend, so re-evaluating new checkpoints,
  or the live rows (a subset), never regenerates. With the runtime, the first `crosscheck_rows` greedy rows are
  also written by HF `generate` in the same process, timed and compared token for token (`crosscheck_record`).
  When the runtime cannot run the target's architecture (`runtime_support.runtime_refusal`), `engine` falls back
  to `local` with one log line naming why (the entries are cached under the `local` key: they are HF's).
- `teacher_pass`: one forward over prompt + continuation with `speculators.core.target.forward_with_taps` -> the
  features speculators ask for (taps of a union of layer ids, sliced per speculator) and the teacher logits.

This module does not score drafts (see `alpha.py`) and does not touch checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from speculators.core.atomic import write_text_atomic
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.core.target import cache_kwarg, eos_token_ids, forward_with_taps
from speculators.core.workloads import WorkloadRow
from speculators.runtime.batch_generate import EngineGenerator, crosscheck
from speculators.runtime.forward import support as runtime_support
from speculators.runtime.forward.memory import work_max_len

log = logging.getLogger(__name__)

CONTINUATIONS_FORMAT = "speculators.continuations/v2"
CONTINUATION_BACKENDS = ("engine", "local")
ENGINE_CONCURRENCY = 64  # requests sharing each target forward (as regeneration runs)
LOCAL_SAVE_EVERY = 16  # rows HF generate writes between two writes of the cache


def encode_row(tokenizer: Any, row: WorkloadRow) -> list[int]:
    """Prompt token ids of a workload row (what the target sees before it starts answering)."""
    if row.prompt is not None:
        return list(tokenizer(row.prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise SpeculatorsError(f"workload row {row.id} has 'messages' but the target tokenizer has no chat template; "
                               f"set target.chat_template in the recipe")
    out = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def row_seed(seed: int, row_id: str) -> int:
    """A per-row sampling seed independent of row order and batch composition."""
    return (seed * 1_000_003 + int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16)) % (2**31 - 1)


@dataclass
class EvalSequence:
    """One evaluated sequence: prompt + the target's continuation at one temperature."""

    row: WorkloadRow
    temperature: float
    token_ids: list[int]  # prompt + continuation
    prompt_len: int

    @property
    def continuation(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


def _cache_key(target_revision: str, seed: int, backend: str) -> str:
    return hashlib.sha256(f"{CONTINUATIONS_FORMAT}|{target_revision}|{seed}|{backend}".encode()).hexdigest()


def _entry_name(row: WorkloadRow, temperature: float) -> str:
    """A cache entry's name: the temperature and everything of the row that its continuation depends on."""
    content = json.dumps([row.id, row.prompt, row.messages, row.max_new_tokens], sort_keys=True)
    return f"{float(temperature)}:{hashlib.sha256(content.encode()).hexdigest()[:20]}"


def _load_cache(path: Path, key: str) -> tuple[dict[str, list[int]], dict | None]:
    """(the cached continuations, the crosscheck record) of `path` if it was written under `key`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}, None
    if data.get("format") != CONTINUATIONS_FORMAT or data.get("key") != key:
        return {}, None
    return {k: [int(t) for t in v] for k, v in data.get("sequences", {}).items()}, data.get("crosscheck")


def _save_cache(path: Path, key: str, sequences: dict[str, list[int]], check: dict | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"format": CONTINUATIONS_FORMAT, "key": key, "crosscheck": check,
                                        "sequences": sequences}))


def continuations_by_temperature(path: Path) -> dict[float, list[int]]:
    """Every cached continuation's tokens of a continuations cache, pooled per sampling temperature (the entry
    names' first part); {} for a missing file or another format."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CONTINUATIONS_FORMAT:
        return {}
    pooled: dict[float, list[int]] = {}
    for name, tokens in data.get("sequences", {}).items():
        pooled.setdefault(float(name.split(":", 1)[0]), []).extend(int(t) for t in tokens)
    return pooled


def crosscheck_record(path: Path) -> dict | None:
    """The side-by-side record (HF `generate` vs the runtime on the first greedy rows) of a continuations cache."""
    try:
        return json.loads(path.read_text()).get("crosscheck")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def generate_continuation(model: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                          seed: int, eos_token_id: Any, pad_token_id: int | None) -> list[int]:
    """The target's own continuation by HF `generate` (generated ids only; ends with EOS if the target stopped)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids),
                                  eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if temperature == 0:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    with torch.no_grad():
        out = model.generate(ids, **kwargs)  # [1, P + C]
    return [int(t) for t in out[0, len(prompt_ids):].tolist()]


def _stop_ids(model: Any, tokenizer: Any) -> tuple[list[int], int | None]:
    """(the EOS ids HF `generate` is given: the generation config's, else the tokenizer's; the pad id)."""
    gen_cfg = getattr(model, "generation_config", None)
    eos_ids = eos_token_ids(gen_cfg) or eos_token_ids(tokenizer)
    pad = getattr(gen_cfg, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    return eos_ids, pad


def continuations(target: Any, rows: Sequence[WorkloadRow], temperatures: Sequence[float], seed: int,
                  target_revision: str, cache_path: Path | None, backend: str = "engine", crosscheck_rows: int = 0,
                  progress: bool = True, concurrency: int = ENGINE_CONCURRENCY) -> dict[float, list[EvalSequence]]:
    """prompt + target continuation of every row at every temperature (cached; see module docstring). `target`
    is the loaded target (`speculators.core.target.LoadedTarget`); `engine` on a target the runtime cannot run writes
    them with HF `generate` (`local`) instead."""
    if backend not in CONTINUATION_BACKENDS:
        raise SpeculatorsError(f"evaluate.continuation_backend must be one of {CONTINUATION_BACKENDS}, got {backend!r}")
    if backend == "engine":
        refusal = runtime_support.runtime_refusal(target)
        if refusal is not None:
            log.warning("target continuations by HF generate instead of the bundled runtime: %s", refusal)
            backend = "local"
    key = _cache_key(target_revision, seed, backend)
    cache, check = _load_cache(cache_path, key) if cache_path is not None else ({}, None)
    prompts = {r.id: encode_row(target.tokenizer, r) for r in rows}
    todo = [(float(t), r) for t in temperatures for r in rows if _entry_name(r, t) not in cache]
    bar = tqdm(total=len(todo), desc="target continuations", unit="row", disable=not progress or not todo)
    eos_ids, pad = _stop_ids(target.model, target.tokenizer)
    work_len = work_max_len([len(prompts[r.id]) for _, r in todo], [r.max_new_tokens for _, r in todo])
    engine = EngineGenerator(target, "ngram", concurrency, work_len) if backend == "engine" and todo else None

    def hf(items: list[tuple[float, WorkloadRow]]) -> list[list[int]]:
        return [generate_continuation(target.model, prompts[r.id], r.max_new_tokens, t, row_seed(seed, r.id),
                                      eos_ids, pad) for t, r in items]

    def runtime(items: list[tuple[float, WorkloadRow]]) -> list[list[int]]:  # stops at the target's EOS ids itself
        assert engine is not None
        return engine.generate([prompts[r.id] for _, r in items],
                               [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=t,
                                               seed=row_seed(seed, r.id)) for t, r in items])

    start = time.perf_counter()
    # the side-by-side check on the first greedy rows (the runtime's outputs are kept), then the rest: the runtime
    # takes them all at once (a slot is refilled as soon as a row ends), HF generate one row at a time
    first = [(t, r) for t, r in todo if t == 0][:crosscheck_rows] if engine is not None else []
    if first:
        check, outs = crosscheck(partial(hf, first), partial(runtime, first), greedy=True)
        cache.update({_entry_name(r, t): out for (t, r), out in zip(first, outs, strict=True)})
        bar.update(len(first))
        done = {_entry_name(r, t) for t, r in first}
        todo = [(t, r) for t, r in todo if _entry_name(r, t) not in done]
    step = max(len(todo), 1) if engine is not None else LOCAL_SAVE_EVERY
    for a in range(0, len(todo), step):
        chunk = todo[a:a + step]
        outs = runtime(chunk) if engine is not None else hf(chunk)
        cache.update({_entry_name(r, t): out for (t, r), out in zip(chunk, outs, strict=True)})
        bar.update(len(chunk))
        if cache_path is not None and engine is None:  # HF, one row at a time: saved as it goes (resumable)
            _save_cache(cache_path, key, cache, check)
    bar.close()
    if cache_path is not None and engine is not None:  # (HF's rows were saved as they came)
        _save_cache(cache_path, key, cache, check)
    if engine is not None:
        log.info("target continuations: %d generated in %.1f s by the runtime (%s); side by side with HF generate "
                 "on the first %d greedy rows: %s", len(first) + len(todo), time.perf_counter() - start,
                 engine.report(), len(first), check if first else "not run")
    return {float(t): [EvalSequence(row=r, temperature=float(t), token_ids=prompts[r.id] + cache[_entry_name(r, t)],
                                    prompt_len=len(prompts[r.id])) for r in rows]
            for t in temperatures}


def greedy_tokens(model: Any, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The target's n greedy next tokens after the prompt, EOS included and NOT stopped at (an engine verifying k
    drafts judges them past the end of the output too). One token per forward with a KV cache, as `generate` runs."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, P]
    kv = {cache_kwarg(model): DynamicCache()}
    out: list[int] = []
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=True, **kv).logits  # [1, P, V]
        for _ in range(n):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if len(out) == n:
                break
            step = torch.tensor([[nxt]], dtype=torch.long, device=device)  # [1, 1]
            logits = model(input_ids=step, use_cache=True, **kv).logits
    return out


@dataclass
class TeacherPass:
    """The target's forward over one sequence (batch row 0 removed)."""

    logits: torch.Tensor  # [T, V] float32
    taps: torch.Tensor | None  # [T, n_union * H] residual stream entering `tap_layer_ids`
    last_hidden: torch.Tensor  # [T, H] post-norm final hidden state
    tap_layer_ids: list[int]
    hidden_size: int

    def features(self, tap_layer_ids: Sequence[int] | None, last_hidden: bool) -> dict[str, torch.Tensor]:
        """The batch features one speculator asks for (taps in ITS layer order), with a batch dim of 1."""
        feats: dict[str, torch.Tensor] = {}
        if tap_layer_ids:
            if self.taps is None:
                raise ValueError("this teacher pass recorded no taps")
            h = self.hidden_size
            cols = [self.taps[:, self.tap_layer_ids.index(i) * h:(self.tap_layer_ids.index(i) + 1) * h]
                    for i in tap_layer_ids]
            feats["taps"] = torch.cat(cols, dim=-1)[None]  # [1, T, n * H]
        if last_hidden:
            feats["last_hidden"] = self.last_hidden[None]  # [1, T, H]
        return feats


def teacher_pass(model: Any, token_ids: Sequence[int], tap_layer_ids: Sequence[int]) -> TeacherPass:
    """One target forward over the whole sequence with the union of the requested taps."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # [1, T]
    out = forward_with_taps(model, ids, torch.ones_like(ids), list(tap_layer_ids) or None)
    return TeacherPass(logits=out.logits[0].float(), taps=None if out.taps is None else out.taps[0].float(),
                       last_hidden=out.last_hidden[0].float(), tap_layer_ids=list(tap_layer_ids),
                       hidden_size=int(out.last_hidden.shape[-1]))
