"""`speculators prepare`: conversations -> the target's chat template -> `input_ids` + assistant-only `loss_mask`.

Reads every `data.sources` entry (hub id or local jsonl/json/parquet/arrow, schemas in `schemas.py`; `skip_rows`
then `max_rows` of it; the ids of `regenerate: false` sources go to the manifest's `kept_answer_ids`), encodes each
row with `chat.ChatEncoder` (the target's template, or `target.chat_template`), applies the length policy
(`data.max_length`, drop or truncate; both counted) and writes `prepared/` (token-dataset format, see
`artifacts.py`) with `manifest.json` last, listing every file's sha256. Malformed rows fail the stage with their id, or are skipped and listed
in the manifest when `data.on_bad_row: skip`. `is_complete` is true only when the manifest is complete, the
inputs (source contents, tokenizer + template, length policy) are unchanged and every file still matches its
checksum (an altered output is redone, never trusted).

This module does not generate text (regenerate.py) or run the target.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from speculators.core.atomic import replace_dir, write_json_atomic
from speculators.core.config import DataConfig, DataSource, Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target import load_tokenizer, saved_eos_token_ids, tokenizer_hash
from speculators.data import artifacts
from speculators.data.chat import ChatEncoder, RowEncodeError
from speculators.data.schemas import (
    Conversation,
    RowError,
    SourceInfo,
    detect_schema,
    iter_source,
    normalize_row,
    row_id_of,
    source_fingerprint,
    source_kind,
)

MAX_LISTED_BAD_ROWS = 100
KEPT_ANSWER_IDS = "kept_answer_ids"  # manifest key: ids of rows whose answers regeneration keeps as written


@dataclass
class EncodeTally:
    """Counts shared by prepare and regenerate."""

    rows: int = 0
    bad: list[RowError] = field(default_factory=list)
    dropped_too_long: int = 0
    truncated: int = 0
    dropped_no_answer: int = 0
    methods: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    masked: list[int] = field(default_factory=list)

    def counts(self) -> dict:
        return {"rows": self.rows, "bad_rows": len(self.bad), "dropped_too_long": self.dropped_too_long,
                "truncated": self.truncated, "dropped_no_answer_after_truncation": self.dropped_no_answer}


def make_encoder(recipe: Recipe, tokenizer: Any) -> ChatEncoder:
    kwargs = recipe.data.chat_template_kwargs
    if not isinstance(kwargs, dict):
        raise SpeculatorsError(f"data.chat_template_kwargs must be a mapping, got {kwargs!r}")
    return ChatEncoder(tokenizer, kwargs, saved_eos_token_ids(recipe.target))


class RowEncoder:
    """Encode conversations into token rows with the length policy; collects the tally."""

    def __init__(self, encoder: ChatEncoder, data: DataConfig) -> None:
        self.encoder = encoder
        self.data = data
        self.tally = EncodeTally()
        self.rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": [], "conversation": []}

    def add(self, conv: Conversation, *, require_answer: bool = True) -> RowError | None:
        """Encode one conversation and keep it (returns a RowError when it cannot be encoded)."""
        try:
            enc = self.encoder.encode(conv)
        except RowEncodeError as exc:
            return RowError(conv.id, str(exc))
        ids, mask = enc.input_ids, enc.loss_mask
        if require_answer and not any(mask):
            return RowError(conv.id, "no assistant tokens after applying the chat template")
        if len(ids) > self.data.max_length:
            if self.data.length_policy == "drop":
                self.tally.dropped_too_long += 1
                return None
            ids, mask = ids[: self.data.max_length], mask[: self.data.max_length]
            if require_answer and not any(mask):
                self.tally.dropped_no_answer += 1
                return None
            self.tally.truncated += 1
        self.tally.rows += 1
        self.tally.methods[enc.method] = self.tally.methods.get(enc.method, 0) + 1
        self.tally.lengths.append(len(ids))
        self.tally.masked.append(int(sum(mask)))
        self.rows["id"].append(conv.id)
        self.rows["input_ids"].append(ids)
        self.rows["loss_mask"].append(mask)
        self.rows["conversation"].append(conv.to_json())
        return None


def handle_bad_row(err: RowError, where: str, data: DataConfig, tally: EncodeTally) -> None:
    if data.on_bad_row == "fail":
        raise SpeculatorsError(f"bad row {err.id!r} in {where}: {err.reason} (fix the row, or set "
                               "data.on_bad_row=skip to skip and report such rows)")
    tally.bad.append(err)


def _require_answer(recipe: Recipe, source: DataSource | None = None) -> bool:
    """Prompt-only rows are useful when the target writes the answers itself (not for a source that keeps its
    answers)."""
    return not recipe.data.regenerate.enabled or (source is not None and not source.regenerate)


def _source_record(s: DataSource) -> dict:
    """What identifies a source's rows; skip_rows / regenerate only when set (earlier runs keep their hashes)."""
    if s.max_rows is not None and s.max_rows <= 0:
        raise SpeculatorsError(f"data source {s.path}: max_rows must be positive, got {s.max_rows}")
    if s.skip_rows < 0:
        raise SpeculatorsError(f"data source {s.path}: skip_rows must be >= 0, got {s.skip_rows}")
    return {"path": s.path, "split": s.split, "schema": s.schema, "max_rows": s.max_rows,
            **({"skip_rows": s.skip_rows} if s.skip_rows else {}),
            **({"regenerate": False} if not s.regenerate else {}),
            "fingerprint": source_fingerprint(s.path, s.split)}


def inputs_fingerprint(recipe: Recipe, tokenizer: Any) -> dict:
    if not recipe.data.sources:
        raise SpeculatorsError("the recipe has no data.sources; add e.g. data.sources: [{path: data.jsonl}]")
    sources = [_source_record(s) for s in recipe.data.sources]
    if recipe.data.max_length < 8:
        raise SpeculatorsError(f"data.max_length={recipe.data.max_length} is too small (at least 8 tokens)")
    return {"sources": sources, "max_length": recipe.data.max_length, "length_policy": recipe.data.length_policy,
            "on_bad_row": recipe.data.on_bad_row, "chat_template_kwargs": recipe.data.chat_template_kwargs,
            "require_answer": _require_answer(recipe), "tokenizer_hash": tokenizer_hash(tokenizer)}


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: unless the recipe learns from recorded traffic (data/traffic.py)."""
    return not recipe.traffic_dirs


def is_complete(recipe: Recipe) -> bool:
    manifest = artifacts.try_manifest(recipe.paths.prepared, artifacts.PREPARED_FORMAT)
    if manifest is None:
        return False

    try:
        tok = load_tokenizer(recipe.target)
        same = manifest.get("inputs_hash") == artifacts.hash_json(inputs_fingerprint(recipe, tok))
    except SpeculatorsError:
        return False
    return same and artifacts.intact(recipe.paths.prepared, manifest)


def summary_of(manifest: dict, status: str) -> dict:
    c, t = manifest["counts"], manifest["tokens"]
    return {"status": status, "output": manifest.get("output"), "rows": c["rows"], "tokens": t["total"],
            "masked_share": t["masked_share"], "mean_length": t["mean_length"], "bad_rows": c["bad_rows"],
            "dropped_too_long": c["dropped_too_long"], "truncated": c["truncated"],
            "bytes_per_token": manifest.get("bytes_per_token"), "tokens_per_s": manifest.get("tokens_per_s")}


def run(recipe: Recipe, *, force: bool = False) -> dict:
    out_dir = recipe.paths.prepared
    tokenizer = load_tokenizer(recipe.target)
    inputs = inputs_fingerprint(recipe, tokenizer)
    existing = artifacts.try_manifest(out_dir, artifacts.PREPARED_FORMAT)
    if not force and existing and existing.get("inputs_hash") == artifacts.hash_json(inputs) and \
            artifacts.intact(out_dir, existing):
        return summary_of(existing, "complete (skipped)")
    encoder = make_encoder(recipe, tokenizer)
    writer = RowEncoder(encoder, recipe.data)
    seen: set[str] = set()
    kept_answer_ids: list[str] = []  # rows of sources with regenerate: false (regenerate.py passes them through)
    infos: list[SourceInfo] = []
    t0 = time.time()
    with tqdm(desc="prepare", unit=" rows", dynamic_ncols=True) as bar:
        for src, fp in zip(recipe.data.sources, inputs["sources"], strict=True):
            info = SourceInfo(path=src.path, split=src.split, kind=source_kind(src.path), fingerprint=fp["fingerprint"])
            infos.append(info)
            require_answer = _require_answer(recipe, src)
            for n, (location, raw) in enumerate(iter_source(src.path, src.split)):
                if n < src.skip_rows:
                    continue
                if src.max_rows is not None and info.rows_read >= src.max_rows:
                    break
                info.rows_read += 1
                bar.update(1)
                row_id = row_id_of(raw, location)
                schema = (detect_schema(raw) if isinstance(raw, dict) else None) if src.schema == "auto" else src.schema
                info.schemas[str(schema)] = info.schemas.get(str(schema), 0) + 1
                conv = normalize_row(row_id, raw, src.schema, require_answer=require_answer)
                if isinstance(conv, Conversation) and conv.id in seen:
                    conv = RowError(conv.id, "duplicate row id")
                if isinstance(conv, Conversation):
                    seen.add(conv.id)
                    written = writer.tally.rows
                    conv = writer.add(conv, require_answer=require_answer) or conv
                    if not src.regenerate and writer.tally.rows > written:
                        kept_answer_ids.append(conv.id)
                if isinstance(conv, RowError):
                    handle_bad_row(conv, f"{src.path} ({location})", recipe.data, writer.tally)
    tally = writer.tally
    if tally.rows == 0:
        raise SpeculatorsError(f"no usable rows in {', '.join(s.path for s in recipe.data.sources)} "
                               f"({len(tally.bad)} bad, {tally.dropped_too_long} too long for data.max_length="
                               f"{recipe.data.max_length}); check the data and the recipe")
    seconds = max(time.time() - t0, 1e-6)
    tmp = artifacts.temp_dir_for(out_dir)
    files = artifacts.save_token_dataset(writer.rows, tmp)
    stats = artifacts.token_stats(tally.lengths, tally.masked)
    manifest = {
        "format": artifacts.PREPARED_FORMAT, "stage": "prepare", "files": files, "complete": True, "created": artifacts.now(),
        "output": str(out_dir), "inputs": inputs, "inputs_hash": artifacts.hash_json(inputs),
        "sources": [vars(i) for i in infos],
        "tokenizer": {"name_or_path": recipe.target.name_or_path, "tokenizer_hash": inputs["tokenizer_hash"],
                      "chat_template_sha256": hashlib.sha256((encoder.template or "").encode()).hexdigest(),
                      "chat_template_kwargs": recipe.data.chat_template_kwargs,
                      "end_of_turn_ids": sorted(encoder.terminators)},
        "mask_methods": tally.methods, "max_length": recipe.data.max_length,
        "length_policy": recipe.data.length_policy,
        "counts": {"rows_read": sum(i.rows_read for i in infos), **tally.counts()},
        "bad_rows": [vars(b) for b in tally.bad[:MAX_LISTED_BAD_ROWS]],
        **({KEPT_ANSWER_IDS: kept_answer_ids} if kept_answer_ids and recipe.data.regenerate.enabled else {}),
        "tokens": stats, "tokens_per_s": round(stats["total"] / seconds, 1),
        "bytes_per_token": round(artifacts.dir_bytes(tmp) / max(stats["total"], 1), 2),
    }
    write_json_atomic(tmp / artifacts.MANIFEST, manifest)
    replace_dir(tmp, out_dir)
    return summary_of(manifest, "done")
