"""`speculators capture`: run the target over the training data and store what the speculator family needs.

- What is stored comes from the recipe (`features.feature_request`): EAGLE-3 -> taps = the residual stream ENTERING the
  decoder layers `capture.layer_ids` (default `[2, N//2, N-3]`, vLLM's semantics); Medusa / MTP -> the post-norm
  last hidden state. The teacher is either recomputed from a stored last hidden state (`capture.teacher: hidden`)
  or stored as the target's top-k next-token log-probs (`topk`). Storage: bf16, or int8 with one absmax scale
  per token and group of channels (`capture.storage`). Format: `shards.py`.
- Shards are planned from the row lengths alone (consecutive rows up to `capture.shard_tokens` tokens), so the
  shard contents do not depend on how many processes run: rank r of W writes shards r, r+W, ... Each shard is
  written atomically with a sidecar `shard-XXXXX.json` (sha256, rows, inputs hash); a re-run skips shards whose
  sidecar and checksum are valid (resume). Work happens in `features.partial/`; rank 0 then writes
  `token_freq.safetensors`, `vocab-<Vd>.safetensors` (EAGLE-3 with a reduced vocab), `manifest.json` (last) and
  moves the dir to `features/`, so an earlier complete output stays intact until the new one is complete.
- `capture.num_processes > 1` runs `accelerate launch` with `speculators worker-capture` (capture_worker.py).
- The target forward is `features.compute_features`, which the training loop also calls online (no disk); the
  draft-vocabulary token counts written at the end come from token_counts.py.

The job (validation, inputs hash, shard plan, resume bookkeeping) is capture_job.py; this module runs the target
over the shards, finalises the output and is the stage's entry point. What to store comes from the family's class
(`Speculator.capture_request`); this module never branches on the family name and trains nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from speculators.core import feature_codec
from speculators.core.atomic import replace_dir, write_json_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import dump_recipe
from speculators.core.target import load_target
from speculators.core.workers import accelerate_command, run_workers
from speculators.data import artifacts, shards, vocab
from speculators.data.capture_job import Job, job_dataset, make_job, setup_partial, sidecar_path, valid_shard
from speculators.data.features import HfFeatures, feature_request
from speculators.data.token_counts import always_included_ids, split_counts, workload_counts
from speculators.data.vllm_capture import VllmFeatures
from speculators.data.vllm_engine import require_vllm_python
from speculators.models import SPECULATORS

TOPK_MASS_WARNING = 0.9  # the summary says so when the stored top-k holds less of the target's mass on average


# ----------------------------------------------------------------------------------------------------------------
# per-rank work


def _capture_shard(job: Job, source: Any, i: int, bar: Any) -> dict:
    """Features of the rows of shard i from `source` (HfFeatures / VllmFeatures), written atomically (+ sidecar)."""
    ds = job_dataset(job)
    a, b = job.plan[i]
    rows = ds.select(range(a, b))
    ids_list = [list(map(int, x)) for x in rows["input_ids"]]
    mask_list = [list(map(int, x)) for x in rows["loss_mask"]]
    row_ids = list(rows["id"])
    cap = job.recipe.capture
    per_row: dict[int, dict[str, torch.Tensor]] = {}
    seconds_before = source.seconds
    err = {"taps": [0.0, 0.0], "last_hidden": [0.0, 0.0]}
    mass = [0.0, 0]
    for r, feats in source.rows(ids_list):
        mask = torch.tensor(mask_list[r], dtype=torch.int8)
        out: dict[str, torch.Tensor] = {}
        for name in job.stored:
            x = feats[name]  # [T, W]
            feature_codec.check_finite(name, x, f"row {row_ids[r]!r}")
            enc = feature_codec.encode_hidden(x, cap.storage, name, job.hidden_size)
            back = feature_codec.decode_hidden(enc, name)
            err[name][0] += float((back - x).pow(2).sum())
            err[name][1] += float(x.pow(2).sum())
            out.update(enc)
        if cap.teacher == "topk":
            pos = feature_codec.stored_teacher_positions(mask)
            lp = feats["teacher_topk_logprobs"][pos]  # [M_row, k]
            out["teacher_topk_ids"] = feats["teacher_topk_ids"][pos].to(feature_codec.topk_id_dtype(job.vocab_size))
            out["teacher_topk_logprobs"] = lp.to(torch.float16)
            mass[0] += float(lp.exp().sum())
            mass[1] += int(pos.sum())
        per_row[r] = out
        bar.update(len(ids_list[r]))
    t_fwd = source.seconds - seconds_before
    tensors: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([t for x in ids_list for t in x], dtype=torch.int32),
        "loss_mask": torch.tensor([t for x in mask_list for t in x], dtype=torch.int8),
        "offsets": torch.tensor([0] + list(_cumsum(len(x) for x in ids_list)), dtype=torch.int64),
    }
    for key in per_row[0]:
        tensors[key] = torch.cat([per_row[r][key] for r in range(len(ids_list))], dim=0)
    meta = {"format": feature_codec.FEATURES_FORMAT, "shard": i, "ids": row_ids}
    path = job.partial / shards.SHARD_PATTERN.format(i)
    digest, size = feature_codec.write_shard(path, tensors, meta)
    rec = {"index": i, "file": path.name, "rows": [a, b], "tokens": int(tensors["input_ids"].numel()),
           "masked": int(tensors["loss_mask"].sum()), "sha256": digest, "bytes": size,
           "inputs_hash": job.inputs_hash, "forward_seconds": round(t_fwd, 3),
           "quant_sq_err": {k: v for k, v in err.items() if v[1] > 0},
           "topk_mass": mass if cap.teacher == "topk" else None}
    write_json_atomic(sidecar_path(job.partial, i), rec)
    return rec


def _cumsum(values: Any) -> Any:
    acc = 0
    for v in values:
        acc += v
        yield acc


def _feature_source(job: Job, device: str | None) -> Any:
    """The recipe's capture backend as a context manager around an object with `rows()` and `seconds`."""
    cap = job.recipe.capture
    request = feature_request(job.recipe, job.num_layers)
    if cap.backend == "vllm":
        return VllmFeatures(job, request)
    target = load_target(job.recipe.target, device=device)
    return contextlib.nullcontext(HfFeatures(target, request, teacher=cap.teacher, topk=cap.teacher_topk,
                                             batch_size=cap.batch_size,
                                             need_last_hidden="last_hidden" in job.stored))


def capture_rank(job: Job, rank: int, world: int, device: str | None = None) -> dict:
    """Write this rank's shards (skipping complete ones); returns counts for the summary. With
    `capture.num_nodes` > 1 the ranks of every node count: node n's rank r is rank n * world + r."""
    cap = job.recipe.capture
    rank, world = cap.node_rank * world + rank, world * cap.num_nodes
    mine = [i for i in range(len(job.plan)) if i % world == rank]
    todo = [i for i in mine if valid_shard(job.partial, i, job) is None]
    stats = {"shards_written": 0, "shards_reused": len(mine) - len(todo), "tokens": 0, "forward_seconds": 0.0}
    if not todo:
        return stats
    lengths = job_dataset(job)["input_ids"]
    total = sum(len(lengths[r]) for i in todo for r in range(*job.plan[i]))
    with _feature_source(job, device) as source, \
            tqdm(total=total, desc=f"capture[{rank}/{world}]" if world > 1 else "capture", unit=" tok",
                 unit_scale=True, dynamic_ncols=True, position=rank % 8) as bar:
        for i in todo:
            rec = _capture_shard(job, source, i, bar)
            stats["shards_written"] += 1
            stats["tokens"] += rec["tokens"]
            stats["forward_seconds"] += rec["forward_seconds"]
    return stats


# ----------------------------------------------------------------------------------------------------------------
# finalisation (rank 0)


def finalize(job: Job, seconds: float, rank_stats: dict | None = None) -> dict:
    """Check every shard, write token_freq / vocab / manifest into the partial dir, move it into place."""
    recs = []
    for i in range(len(job.plan)):
        rec = valid_shard(job.partial, i, job, check_sha=False)
        if rec is None:
            raise SpeculatorsError(f"capture did not complete shard {i} in {job.partial}; re-run capture to resume")
        recs.append(rec)
    train_c, val_c = split_counts(job_dataset(job), job.vocab_size, job.recipe.data.val_fraction, job.recipe.seed)
    forced = always_included_ids(job.recipe, job.data_manifest, job.vocab_size)
    vocab.save_token_freq(job.partial, train_c, forced, {"split": "train", "val_fraction":
                                                         job.recipe.data.val_fraction, "seed": job.recipe.seed})
    coverage: dict[str, Any] = {}
    vd = job.recipe.speculator.draft_vocab_size
    if _uses_draft_vocab(job.recipe) and vd is not None:
        d2t, t2d = vocab.build_vocab(train_c, vd, forced)
        coverage = {"draft_vocab_size": vd,
                    "train_assistant_tokens": round(vocab.coverage(t2d, train_c), 4),
                    "val_assistant_tokens (held-out rows)": round(vocab.coverage(t2d, val_c), 4) if int(
                        val_c.sum()) else None}
        try:
            coverage["workload_prompt_tokens"] = {k: round(vocab.coverage(t2d, c), 4)
                                                  for k, c in sorted(workload_counts(job.recipe, job.vocab_size).items())}
        except SpeculatorsError as exc:
            coverage["workload_prompt_tokens"] = f"unavailable: {exc}"
        vocab.save_vocab(job.partial, d2t, t2d, {"draft_vocab_size": vd, "coverage": coverage})
    tokens = sum(r["tokens"] for r in recs)
    masked = sum(r["masked"] for r in recs)
    shard_bytes = sum(r["bytes"] for r in recs)
    h = job.hidden_size
    fwd = sum(r["forward_seconds"] for r in recs)
    quality: dict[str, Any] = {}
    for name in job.stored:
        e = [sum(r["quant_sq_err"].get(name, [0, 0])[0] for r in recs),
             sum(r["quant_sq_err"].get(name, [0, 0])[1] for r in recs)]
        quality[f"{name}_relative_rmse"] = round(math.sqrt(e[0] / e[1]), 6) if e[1] else 0.0
    if job.recipe.capture.teacher == "topk":
        m = [sum(r["topk_mass"][0] for r in recs), sum(r["topk_mass"][1] for r in recs)]
        quality["teacher_topk_mean_mass"] = round(m[0] / m[1], 6) if m[1] else None
    manifest = {
        "format": feature_codec.FEATURES_FORMAT, "complete": True, "created": artifacts.now(),
        "output": str(job.final),
        "target": job.fingerprint, "data_dir": str(job.data_dir), "data_stage": job.data_manifest.get("stage"),
        "family": job.recipe.speculator.family, "layer_ids": job.layer_ids, "num_layers": job.num_layers,
        "hidden_size": h, "vocab_size": job.vocab_size, "stored": job.stored, "storage": job.recipe.capture.storage,
        "group_size": job.inputs["group_size"], "teacher": job.recipe.capture.teacher,
        "teacher_topk": job.inputs["teacher_topk"], "compute_dtype": job.recipe.target.dtype,
        "inputs": job.inputs, "inputs_hash": job.inputs_hash,
        "counts": {"sequences": sum(r["rows"][1] - r["rows"][0] for r in recs), "tokens": tokens,
                   "masked_tokens": masked, "masked_share": round(masked / tokens, 4) if tokens else 0.0,
                   "shards": len(recs)},
        "storage_report": {"shard_bytes": shard_bytes, "bytes_per_token": round(shard_bytes / tokens, 2),
                           "reference_bytes_per_token (bf16 taps + last hidden, 8H)": 8 * h,
                           "ratio_to_reference": round(shard_bytes / tokens / (8 * h), 4)},
        "quality": quality, "vocab": coverage,
        "throughput": {"forward_tokens_per_s": round(tokens / fwd, 1) if fwd else None,
                       "wall_seconds": round(seconds, 2), **(rank_stats or {})},
        "shards": [{"file": r["file"], "rows": r["rows"][1] - r["rows"][0], "tokens": r["tokens"],
                    "bytes": r["bytes"], "sha256": r["sha256"]} for r in recs],
    }
    write_json_atomic(job.partial / artifacts.MANIFEST, manifest)
    (job.partial / "inputs.json").unlink(missing_ok=True)
    replace_dir(job.partial, job.final)
    return manifest


# ----------------------------------------------------------------------------------------------------------------
# stage entry points


def summary_of(manifest: dict, status: str) -> dict:
    c, st, q = manifest["counts"], manifest["storage_report"], manifest.get("quality", {})
    out = {"status": status, "output": manifest.get("output"),
           "rows": c["sequences"], "tokens": c["tokens"], "masked_share": c["masked_share"], "shards": c["shards"],
           "stored": "+".join(manifest["stored"]) + f" ({manifest['storage']}), teacher={manifest['teacher']}",
           "layer_ids": manifest["layer_ids"], "bytes_per_token": st["bytes_per_token"],
           "vs_8H_reference": f"{st['ratio_to_reference']:.3f}x of {8 * manifest['hidden_size']} B/token",
           "tokens_per_s": manifest["throughput"].get("forward_tokens_per_s"), **q}
    if manifest.get("vocab"):
        v = manifest["vocab"]
        out["draft_vocab"] = {k: v[k] for k in v if k != "workload_prompt_tokens"}
    mass = q.get("teacher_topk_mean_mass")
    if mass is not None and mass < TOPK_MASS_WARNING:
        out["note"] = (f"the top-{manifest['teacher_topk']} teacher keeps {mass:.0%} of the target's probability "
                       "mass; for sampling (T>0) raise capture.teacher_topk or use capture.teacher=hidden")
    return out


def _uses_draft_vocab(recipe: Recipe) -> bool:
    return bool(SPECULATORS[recipe.speculator.family].USES_DRAFT_VOCAB)


def _vocab_ready(recipe: Recipe, features: Path) -> bool:
    vd = recipe.speculator.draft_vocab_size
    return not _uses_draft_vocab(recipe) or vd is None or vocab.vocab_file(features, vd).is_file()


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: offline training (online training runs the target itself) of
    conversations (recorded traffic holds its features already: data/traffic.py)."""
    return recipe.capture.mode == "offline" and not recipe.traffic_dirs


def is_complete(recipe: Recipe) -> bool:
    m = artifacts.try_manifest(recipe.paths.features, feature_codec.FEATURES_FORMAT)
    if m is None:
        return False
    try:
        job = make_job(recipe)
    except SpeculatorsError:
        return False
    if m.get("inputs_hash") != job.inputs_hash:
        return False
    for rec in m["shards"]:
        p = recipe.paths.features / rec["file"]
        if not p.is_file() or p.stat().st_size != rec["bytes"]:
            return False
    return _vocab_ready(recipe, recipe.paths.features)


def _launch(recipe: Recipe, force: bool) -> None:
    """Run `capture.num_processes` workers through accelerate (CPU: gloo; GPUs: one per process)."""
    logs = recipe.paths.logs
    logs.mkdir(parents=True, exist_ok=True)
    recipe_file = logs / "capture-recipe.yaml"
    recipe_file.write_text(dump_recipe(recipe))
    n = recipe.capture.num_processes
    cmd = accelerate_command(["worker-capture", str(recipe_file)] + (["--force"] if force else []), n)
    returncode = run_workers(cmd, n)
    if returncode != 0:
        raise SpeculatorsError(f"capture workers failed (exit {returncode}); see the messages above. Complete "
                               f"shards are kept in {recipe.paths.features}.partial: re-run to resume")


def run(recipe: Recipe, *, force: bool = False) -> dict:
    t0 = time.time()
    job = make_job(recipe)
    existing = artifacts.try_manifest(job.final, feature_codec.FEATURES_FORMAT)
    if not force and existing and existing.get("inputs_hash") == job.inputs_hash and \
            is_complete(recipe):
        return summary_of(existing, "complete (skipped)")
    if not force and existing and existing.get("inputs_hash") == job.inputs_hash and \
            not _vocab_ready(recipe, job.final) and all(
                (job.final / r["file"]).is_file() for r in existing["shards"]):
        vocab.load_vocab(job.final, recipe.speculator.draft_vocab_size)  # only the draft vocab size changed
        return summary_of(existing, "complete (built draft vocab)")
    if recipe.capture.num_processes > 1:
        _launch(recipe, force)
        manifest = artifacts.read_manifest(job.final, feature_codec.FEATURES_FORMAT, "features")
        return summary_of(manifest, "done")
    if recipe.capture.backend == "vllm":
        require_vllm_python(recipe)  # the vLLM environment exists, before anything is written
    setup_partial(job, force)
    stats = capture_rank(job, 0, 1)
    missing = missing_shards(job)
    if missing:  # other nodes' shards (capture.num_nodes > 1): the last node to finish writes the manifest
        return {"status": f"partial: this node's shards done, {len(missing)} of {len(job.plan)} shards from other "
                          f"nodes still missing; run capture again once every node has finished", **stats}
    manifest = finalize(job, time.time() - t0, stats)
    return summary_of(manifest, "done")


def missing_shards(job: Job) -> list[int]:
    """Shards of the plan with no complete file in the partial dir yet (another node's, or not yet written)."""
    return [i for i in range(len(job.plan)) if valid_shard(job.partial, i, job, check_sha=False) is None]
