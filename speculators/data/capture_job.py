"""The capture job: everything `speculators capture` validates before touching any output, and the shard bookkeeping.

- `make_job(recipe)`: reads the target config and the training data (checksums, values), checks the tokenizer
  matches, computes the inputs hash and the shard plan (`shard_plan`: consecutive rows up to
  `capture.shard_tokens` tokens, independent of how many processes run).
- `setup_partial(job, force)`: creates (or keeps, for resume) `features.partial/`, linking in the valid shards of
  an earlier `features/` output made from the same inputs.
- `valid_shard` / `sidecar_path`: a shard counts as done when its sidecar matches the job and its checksum holds.
- `job_dataset(job)`: the training token dataset, loaded once per process.

It runs no target forward and writes no shard (capture.py does both), and decides nothing about the stage's flow.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from transformers import AutoConfig

from speculators.core import feature_codec
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target import check_target_location, fingerprint_target, load_tokenizer, text_config
from speculators.data import artifacts, shards
from speculators.data.features import feature_request, stored_features


@dataclass
class Job:
    recipe: Recipe
    data_dir: Path
    partial: Path
    final: Path
    inputs: dict
    inputs_hash: str
    plan: list[tuple[int, int]]  # shard -> [row_start, row_end)
    stored: list[str]
    layer_ids: list[int] | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: dict
    data_manifest: dict


def shard_plan(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    plan, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            plan.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def row_lengths(ds: Any) -> list[int]:
    """Token count of every row of a token dataset (Arrow metadata only, no Python lists of ids)."""
    return [int(n) for n in pc.list_value_length(ds.data.column("input_ids")).to_pylist()]


def _validate_capture_cfg(recipe: Recipe, vocab_size: int) -> None:
    c = recipe.capture
    if c.shard_tokens < 1 or c.batch_size < 1 or c.num_processes < 1:
        raise SpeculatorsError("capture.shard_tokens, capture.batch_size and capture.num_processes must be >= 1")
    if c.teacher == "topk" and not 1 <= c.teacher_topk <= vocab_size:
        raise SpeculatorsError(f"capture.teacher_topk={c.teacher_topk} must be in [1, {vocab_size}]")
    if not 0 <= c.node_rank < c.num_nodes:
        raise SpeculatorsError(f"capture.node_rank={c.node_rank} must be in [0, capture.num_nodes={c.num_nodes})")
    if c.backend == "vllm" and c.num_processes != 1:
        raise SpeculatorsError("capture.backend=vllm runs one vLLM engine per node; set its parallelism with "
                               "capture.vllm.tensor_parallel_size / data_parallel_size, not capture.num_processes")
    v = c.vllm
    if min(v.tensor_parallel_size, v.data_parallel_size, v.max_num_seqs, v.rows_per_request, v.threads) < 1 or \
            v.kv_cache_gb <= 0:
        raise SpeculatorsError("capture.vllm: tensor_parallel_size, data_parallel_size, max_num_seqs, "
                               "rows_per_request and threads must be >= 1, kv_cache_gb > 0")
    if c.mode != "offline":
        raise SpeculatorsError("capture.mode is 'online': taps are computed inside the training step, there is "
                               "nothing to capture (set capture.mode=offline to write shards)")


def _data_identity(manifest: dict) -> str:
    return artifacts.hash_json([manifest.get("inputs_hash"), manifest.get("counts"), manifest.get("tokens"),
                                manifest.get("stage")])


def make_job(recipe: Recipe) -> Job:
    """Validate everything capture needs (before any output is touched) and compute the inputs hash + plan."""
    data_dir = recipe.training_data_dir
    stage = "regenerate" if recipe.data.regenerate.enabled else "prepare"
    check_target_location(recipe.target.name_or_path)
    try:
        config = text_config(AutoConfig.from_pretrained(recipe.target.name_or_path, revision=recipe.target.revision,
                                                        trust_remote_code=recipe.target.trust_remote_code))
    except (OSError, ValueError) as exc:
        raise SpeculatorsError(f"cannot read the config of {recipe.target.name_or_path}: "
                               f"{str(exc).splitlines()[0]}") from None
    num_layers, hidden, vsize = int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size)
    # checksums and values (masks in {0, 1}, ids < vocab) before any output is touched
    ds, data_manifest = artifacts.load_token_dataset(data_dir, f"training data (`speculators {stage}`)", vsize, stage)
    _validate_capture_cfg(recipe, vsize)
    request = feature_request(recipe, num_layers)
    tokenizer = load_tokenizer(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=tokenizer).to_dict()
    data_tok = data_manifest.get("inputs", {}).get("tokenizer_hash")
    if data_tok != fp["tokenizer_hash"]:
        raise SpeculatorsError(f"the training data in {data_dir} was tokenized with another tokenizer/template "
                               f"({str(data_tok)[:12]}) than target {recipe.target.name_or_path} "
                               f"({fp['tokenizer_hash'][:12]}); re-run prepare (and regenerate) for this target")
    stored = stored_features(request, recipe.capture.teacher)
    # what the features are made of, not where they sit or who reads them: a copy of the data, or a family storing
    # the same features (EAGLE-3 and DFlash: the same taps), finds the capture complete
    inputs = {
        "format": feature_codec.FEATURES_FORMAT, "data": _data_identity(data_manifest),
        "target_content_hash": fp["content_hash"], "tokenizer_hash": fp["tokenizer_hash"],
        "dtype": recipe.target.dtype,
        "layer_ids": list(request.tap_layer_ids) if request.tap_layer_ids else None, "stored": stored,
        "storage": recipe.capture.storage, "teacher": recipe.capture.teacher,
        "teacher_topk": recipe.capture.teacher_topk if recipe.capture.teacher == "topk" else None,
        "shard_tokens": recipe.capture.shard_tokens, "batch_size": recipe.capture.batch_size,
        "group_size": feature_codec.group_size_for(hidden) if recipe.capture.storage == "int8" else None,
    }
    if recipe.capture.backend != "hf":  # the engine that ran the target (absent = HF, as before this key existed)
        inputs["backend"] = recipe.capture.backend
    lengths = row_lengths(ds)
    final = recipe.paths.features
    return Job(recipe=recipe, data_dir=data_dir, partial=final.with_name(final.name + ".partial"), final=final,
               inputs=inputs, inputs_hash=artifacts.hash_json(inputs),
               plan=shard_plan(lengths, recipe.capture.shard_tokens), stored=stored,
               layer_ids=inputs["layer_ids"], num_layers=num_layers, hidden_size=hidden, vocab_size=vsize,
               fingerprint=fp, data_manifest=data_manifest)


def sidecar_path(directory: Path, i: int) -> Path:
    """The sidecar `shard-XXXXX.json` (sha256, rows, inputs hash) of shard i."""
    return directory / f"shard-{i:05d}.json"


def valid_shard(directory: Path, i: int, job: Job, check_sha: bool = True) -> dict | None:
    """The sidecar record of shard i in `directory` when the shard is complete for `job` (else None)."""
    side = sidecar_path(directory, i)
    f = directory / shards.SHARD_PATTERN.format(i)
    if not side.is_file() or not f.is_file():
        return None
    try:
        rec = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("inputs_hash") != job.inputs_hash or rec.get("rows") != list(job.plan[i]) or \
            f.stat().st_size != rec.get("bytes"):
        return None
    if check_sha and shards.sha256_file(f) != rec.get("sha256"):
        return None
    return rec


def setup_partial(job: Job, force: bool) -> None:
    """Create (or keep, for resume) `features.partial/`; reuse valid shards of an earlier `features/` output."""
    if artifacts.partial_dir(job.partial, job.inputs_hash, job.inputs, force):
        if not force and job.final.is_dir():  # an earlier output with the same inputs: keep its valid shards
            for i in range(len(job.plan)):
                if valid_shard(job.final, i, job) is not None:
                    for p in (job.final / shards.SHARD_PATTERN.format(i), sidecar_path(job.final, i)):
                        try:
                            os.link(p, job.partial / p.name)
                        except OSError:
                            shutil.copy2(p, job.partial / p.name)


_DATASETS: dict[str, Any] = {}


def job_dataset(job: Job) -> Any:
    """The training token dataset of `job` (loaded once per process and data dir)."""
    key = str(job.data_dir)
    if key not in _DATASETS:
        _DATASETS.clear()
        _DATASETS[key] = artifacts.load_token_dataset(job.data_dir, "training data", job.vocab_size)[0]
    return _DATASETS[key]
