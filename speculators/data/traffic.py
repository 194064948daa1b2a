"""The traffic stage: recordings of served traffic (runtime/recording.py) + a replay share of the running revision's
own training rows -> the feature shards training reads (`features/`), with per-position loss weights.

A recipe learns from traffic when its `data.sources` are recordings (`- traffic: DIR`); prepare, regenerate and
capture then do nothing (a recorded row already holds the target's answer, its taps and its teacher). This stage
- checks every recording (and the replay features) against the recipe's target: another target revision is refused
  in one line, as are other tap layers than the speculator's;
- holds back the newest `data.traffic.held_back` share of the recorded rows (listed in the manifest: the slice the
  adoption gate compares revisions on, evaluate/adoption.py), takes the rest (the newest `max_rows` of them), and
  `replay_share` times their tokens of rows drawn at random (seeded) from `data.traffic.replay`;
- weights each recorded training row: 1, plus `cycle_start_weight` at the row a server's cycle drafts from (its
  root's), plus `rejected_weight` at the row whose step-0 draft is the token the running revision drafted wrongly
  (when its draft went deeper than what was accepted: the on-policy correction); replayed rows weigh 1 everywhere;
- writes the rows as shards (int8 taps, top-k teacher, `position_weight`), the draft vocabulary of the revision it
  continues (`train.init_from`, else the replay's), and the manifest last, into `features/` atomically.

Not here: recording (the runtime), the loss that reads the weights (train/loss.py), adoption of the new revision.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from speculators.core.atomic import atomic_dir, write_json_atomic
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.feature_codec import (
    FEATURES_FORMAT,
    encode_hidden,
    group_size_for,
    stored_teacher_positions,
    topk_id_dtype,
    write_shard,
)
from speculators.core.target import fingerprint_target
from speculators.data import artifacts, vocab
from speculators.data.features import feature_request
from speculators.data.shards import SHARD_PATTERN, FeatureStore
from speculators.models import SPECULATORS
from speculators.runtime.recording import RECORDING_KIND

TRAFFIC_STAGE = "traffic"


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: when the recipe's sources are recordings of served traffic."""
    return bool(recipe.traffic_dirs)


def _recording(directory: str, fingerprint: dict) -> FeatureStore:
    store = FeatureStore(directory)
    if store.manifest.get("recording", {}).get("kind") != RECORDING_KIND:
        raise SpeculatorsError(f"data.sources traffic: {directory} is not a recording of served traffic (speculators "
                               "serve --record DIR writes one)")
    store.check_target(fingerprint)
    return store


def _inputs(recipe: Recipe) -> dict:
    """What the stage's output depends on: the recordings' and the replay's manifests, the weights, the revision."""
    cfg = recipe.data.traffic

    def listed(directory: str | None) -> Any:
        if directory is None:
            return None
        m = artifacts.read_manifest(Path(directory), FEATURES_FORMAT, "features")
        return [(e["file"], e["sha256"]) for e in m["shards"]]

    return {"stage": TRAFFIC_STAGE, "recordings": [listed(d) for d in recipe.traffic_dirs],
            "replay": listed(cfg.replay), "replay_share": cfg.replay_share, "max_rows": cfg.max_rows,
            "held_back": cfg.held_back,
            "weights": [cfg.cycle_start_weight, cfg.rejected_weight], "seed": recipe.seed,
            "init_from": recipe.train.init_from, "draft_vocab_size": recipe.speculator.draft_vocab_size,
            "storage": recipe.capture.storage, "shard_tokens": recipe.capture.shard_tokens}


def is_complete(recipe: Recipe) -> bool:
    m = artifacts.try_manifest(recipe.paths.features, FEATURES_FORMAT)
    if m is None or m.get("inputs_hash") != artifacts.hash_json(_inputs(recipe)):
        return False
    return all((recipe.paths.features / e["file"]).is_file() for e in m["shards"])


def position_weights(store: FeatureStore, i: int, cycle_start_weight: float, rejected_weight: float
                     ) -> torch.Tensor:
    """[T] float32 loss weights of recorded row i from its feedback (see the module docstring)."""
    start = store.token_tensor(i, "cycle_start")
    depth, accepted = store.token_tensor(i, "draft_depth"), store.token_tensor(i, "draft_accepted")
    if start is None or depth is None or accepted is None:
        raise SpeculatorsError(f"{store.dir}: row {store.row_id(i)} has no verification feedback; it is not a "
                               "recording of served traffic")
    # training row t drafts from the taps of t and token t+1 (train/loss.py: step k at t predicts token t+2+k), so a
    # cycle rooted at r (its first draft predicts token r+1) is row r-1, and its draft rejected after `a` accepted
    # tokens is corrected at step 0 of row r-1+a
    weight = torch.ones(start.shape[0])  # [T]
    roots = start.nonzero().flatten()
    rows = roots - 1
    weight[rows[rows >= 0]] += cycle_start_weight
    missed = roots[depth[roots].long() > accepted[roots].long()]  # cycles whose draft was cut short
    at = missed - 1 + accepted[missed].long()
    weight[at[(at >= 0) & (at < weight.shape[0])]] += rejected_weight
    return weight


def _row_tensors(seq: dict[str, torch.Tensor], weight: torch.Tensor, k: int, storage: str, hidden: int,
                 vocab_size: int) -> dict[str, torch.Tensor]:
    """One row of `FeatureStore.sequence` -> its shard tensors (teacher at the stored positions, top `k`)."""
    pos = stored_teacher_positions(seq["loss_mask"])
    return {"input_ids": seq["input_ids"].to(torch.int32), "loss_mask": seq["loss_mask"].to(torch.int8),
            **encode_hidden(seq["taps"], storage, "taps", hidden),
            "teacher_topk_ids": seq["teacher_topk_ids"][pos][:, :k].to(topk_id_dtype(vocab_size)),
            "teacher_topk_logprobs": seq["teacher_topk_logprobs"][pos][:, :k].to(torch.float16),
            "position_weight": weight.float()}


def _drawn_replay_rows(store: FeatureStore | None, tokens: int, seed: int) -> list[int]:
    """Rows of the replay features, drawn at random (seeded) until they hold `tokens` tokens."""
    if store is None or tokens <= 0:
        return []
    lengths = store.lengths()
    out, total = [], 0
    for i in torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist():
        if total >= tokens:
            break
        out.append(i)
        total += lengths[i]
    return out


def _draft_vocab(recipe: Recipe, replay: FeatureStore | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t offsets, t2d) of the draft vocabulary the new revision keeps: the one it continues from."""
    vd = int(recipe.speculator.draft_vocab_size)
    if recipe.train.init_from:
        for path in sorted(Path(recipe.train.init_from).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                if "d2t" in fh.keys() and "t2d" in fh.keys():  # noqa: SIM118 - a safetensors handle
                    d2t, t2d = fh.get_tensor("d2t").long(), fh.get_tensor("t2d").bool()
                    break
        else:
            raise SpeculatorsError(f"train.init_from {recipe.train.init_from} holds no reduced draft vocabulary (d2t, "
                                   f"t2d) but speculator.draft_vocab_size is {vd}; unset it")
        if d2t.shape[0] != vd or t2d.shape[0] != vocab_size:
            raise SpeculatorsError(f"train.init_from {recipe.train.init_from} drafts over {d2t.shape[0]} tokens but "
                                   f"speculator.draft_vocab_size is {vd}; set it to {d2t.shape[0]}")
        return d2t, t2d
    if replay is not None and vocab.vocab_file(replay.dir, vd).is_file():
        return vocab.load_vocab(replay.dir, vd)
    raise SpeculatorsError("a traffic recipe keeps the draft vocabulary of the revision it continues: set "
                           "train.init_from (or data.traffic.replay to features that hold that vocabulary)")


def _check(recipe: Recipe, stores: list[FeatureStore], num_layers: int) -> list[int]:
    """The tap layers every store holds and the recipe's speculator reads (else one line)."""
    if recipe.capture.mode != "offline":
        raise SpeculatorsError("a traffic recipe trains offline on the recorded features: set capture.mode: offline")
    request = feature_request(recipe, num_layers)
    if request.last_hidden or not request.tap_layer_ids:
        raise SpeculatorsError(f"recordings hold the taps EAGLE-3 reads; speculator.family {recipe.speculator.family} "
                               "needs other features")
    want = list(request.tap_layer_ids)
    for store in stores:
        if list(store.layer_ids or []) != want:
            raise SpeculatorsError(f"{store.dir} holds taps of layers {store.layer_ids}, but the speculator reads "
                                   f"{want}; record with a drafter of these layers (or set capture.layer_ids)")
    return want


def run(recipe: Recipe, *, force: bool = False) -> dict:
    if not force and is_complete(recipe):
        m = artifacts.read_manifest(recipe.paths.features, FEATURES_FORMAT, "features")
        return {"status": "complete (skipped)", **m["traffic"]}
    t0 = time.time()
    cfg = recipe.data.traffic
    if cfg.replay_share < 0 or cfg.cycle_start_weight < 0 or cfg.rejected_weight < 0:
        raise SpeculatorsError("data.traffic.replay_share, cycle_start_weight and rejected_weight must be >= 0")
    fp = fingerprint_target(recipe.target).to_dict()
    recordings = [_recording(d, fp) for d in recipe.traffic_dirs]
    replay = FeatureStore(cfg.replay) if cfg.replay else None
    if replay is not None:
        replay.check_target(fp)
    layers = _check(recipe, recordings + ([replay] if replay is not None else []), int(fp["num_layers"]))
    recorded = [(store, i) for store in recordings for i in range(len(store))]
    if not 0.0 <= cfg.held_back < 1.0:
        raise SpeculatorsError(f"data.traffic.held_back must be in [0, 1), got {cfg.held_back}")
    n_held = int(round(len(recorded) * cfg.held_back))
    held = recorded[len(recorded) - n_held:] if n_held else []
    recorded = recorded[:len(recorded) - n_held]
    if cfg.max_rows is not None:
        recorded = recorded[-cfg.max_rows:]
    if not recorded:
        raise SpeculatorsError(f"the recordings {', '.join(recipe.traffic_dirs)} hold no rows yet; serve with --record")
    recorded_tokens = sum(int(s.token_tensor(i, "loss_mask").shape[0]) for s, i in recorded)
    replayed = [(replay, i) for i in _drawn_replay_rows(replay, int(cfg.replay_share * recorded_tokens), recipe.seed)]
    k = min(int(s.manifest["teacher_topk"]) for s in recordings + ([replay] if replay is not None else []))
    vocab_size, hidden = int(fp["vocab_size"]), int(fp["hidden_size"])
    with atomic_dir(recipe.paths.features) as out:
        shards, rows, weights = _write_rows(recorded + replayed, out, recipe, k, hidden, vocab_size)
        if SPECULATORS[recipe.speculator.family].USES_DRAFT_VOCAB and recipe.speculator.draft_vocab_size:
            d2t, t2d = _draft_vocab(recipe, replay, vocab_size)
            vocab.save_vocab(out, d2t, t2d, {"draft_vocab_size": int(d2t.shape[0]), "from": "the continued revision"})
        summary = {"recorded_rows": len(recorded), "recorded_tokens": recorded_tokens, "replayed_rows": len(replayed),
                   "replayed_tokens": sum(len(r) for r in rows[len(recorded):]),
                   "mean_recorded_weight": round(weights, 4),
                   "held_back_rows": [[str(s.dir), i] for s, i in held],
                   "draft_revisions": sorted({str(v) for s in recordings
                                              for v in s.manifest["recording"].get("draft_revisions", [])})}
        _write_manifest(out, recipe, fp, layers, k, shards, rows, summary, time.time() - t0)
    return {"status": "done", **summary, "features": str(recipe.paths.features)}


def _write_rows(rows: list[tuple[FeatureStore, int]], out: Path, recipe: Recipe, k: int, hidden: int,
                vocab_size: int) -> tuple[list[dict], list[list[int]], float]:
    """Rows in shards of about `capture.shard_tokens` tokens; returns (shard records, row ids per row, mean weight of
    the recorded tokens)."""
    cfg = recipe.data.traffic
    shards: list[dict] = []
    ids: list[list[int]] = []
    pending: list[tuple[str, dict[str, torch.Tensor]]] = []
    pending_tokens = 0  # tokens of the rows in `pending`
    weight_sum, weight_n = 0.0, 0

    def flush() -> None:
        tensors = {key: torch.cat([t[key] for _, t in pending]) for key in pending[0][1]}
        lengths = [int(t["input_ids"].shape[0]) for _, t in pending]
        tensors["offsets"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        index = len(shards)
        path = out / SHARD_PATTERN.format(index)
        meta = {"format": FEATURES_FORMAT, "shard": index, "ids": [row_id for row_id, _ in pending]}
        digest, size = write_shard(path, tensors, meta)
        shards.append({"file": path.name, "rows": len(pending), "tokens": sum(lengths),
                       "masked": int(tensors["loss_mask"].sum()), "bytes": size, "sha256": digest})
        pending.clear()

    for store, i in rows:
        seq = store.sequence(i)
        if store.manifest.get("recording"):
            weight = position_weights(store, i, cfg.cycle_start_weight, cfg.rejected_weight)
            weight_sum += float(weight[seq["loss_mask"].bool()].sum())
            weight_n += int(seq["loss_mask"].sum())
        else:
            weight = torch.ones(seq["input_ids"].shape[0])
        pending.append((store.row_id(i), _row_tensors(seq, weight, k, recipe.capture.storage, hidden, vocab_size)))
        ids.append(seq["input_ids"].tolist())
        pending_tokens += len(ids[-1])
        if pending_tokens >= recipe.capture.shard_tokens:
            flush()
            pending_tokens = 0
    if pending:
        flush()
    return shards, ids, weight_sum / weight_n if weight_n else 1.0


def _write_manifest(out: Path, recipe: Recipe, fp: dict, layers: list[int], k: int, shards: list[dict],
                    rows: list[list[int]], summary: dict, seconds: float) -> None:
    tokens = sum(s["tokens"] for s in shards)
    masked = sum(s["masked"] for s in shards)
    size = sum(s["bytes"] for s in shards)
    inputs = _inputs(recipe)
    manifest = {
        "format": FEATURES_FORMAT, "complete": True, "created": artifacts.now(), "output": str(recipe.paths.features),
        "target": fp, "family": recipe.speculator.family, "layer_ids": layers, "num_layers": fp["num_layers"],
        "hidden_size": fp["hidden_size"], "vocab_size": fp["vocab_size"], "stored": ["taps"],
        "storage": recipe.capture.storage, "group_size": group_size_for(int(fp["hidden_size"])), "teacher": "topk",
        "teacher_topk": k, "inputs": inputs, "inputs_hash": artifacts.hash_json(inputs), "traffic": summary,
        "counts": {"sequences": len(rows), "tokens": tokens, "masked_tokens": masked,
                   "masked_share": round(masked / tokens, 4) if tokens else 0.0, "shards": len(shards)},
        "storage_report": {"shard_bytes": size, "bytes_per_token": round(size / tokens, 2) if tokens else 0.0},
        "throughput": {"wall_seconds": round(seconds, 2)},
        "shards": [{k_: s[k_] for k_ in ("file", "rows", "tokens", "bytes", "sha256")} for s in shards],
    }
    write_json_atomic(out / artifacts.MANIFEST, manifest)
