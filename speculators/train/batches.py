"""Training batches: sequences -> padded batches in a deterministic, resumable, rank-sharded order, and the
features + teacher of each batch (offline from feature shards, or online from a target forward inside the step).

What it does:
- `PreparedSource` (online mode: the prepared/regenerated Arrow rows) and `FeatureSource` (offline mode: a
  `speculators.data.shards.FeatureStore`) give `len`, per-sequence lengths and `sequence(i) -> dict of tensors`.
- `train_val_indices`: the train / val split of a source's sequences (`speculators.data.shards.split_side_indices`, the
  split capture uses, for the Arrow rows of online mode too): the copies of one row regenerated at several
  temperatures stay on one side.
- `BatchPlan`: for epoch e, a seeded shuffle, grouped by length (windows of 16 batches, sorted) so padding stays
  small, cut into micro-batches, shuffled again, truncated to a multiple of the world size; rank r takes every
  world-th micro-batch. The plan depends only on (seed, epoch, lengths, batch size, world size), so the data
  position of a run is one integer: the number of micro-batches consumed.
- `collate`: right-padded `input_ids` / `attention_mask` / `loss_mask` [B, T] and padded float features;
  `micro_batch_loader`: a DataLoader over the plan from a data position on (`train.num_workers` prefetch workers).
- `OnlineFeatures` / `OfflineFeatures`: turn a collated batch into (model inputs, `loss.Teacher`).

What it does not do: compute losses, step optimizers, or write anything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow.compute as pc
import torch

from speculators.core.errors import SpeculatorsError
from speculators.data.artifacts import load_token_dataset
from speculators.data.features import compute_features
from speculators.data.shards import split_side_indices as split
from speculators.train.loss import (
    Teacher,
    TeacherShape,
    VocabMap,
    dense_teacher,
    hidden_teacher,
    loss_teacher_positions,
    sparse_teacher,
)

FLOAT_KEYS = ("taps", "last_hidden", "teacher_topk_logprobs")


class SequenceSource(Protocol):
    def __len__(self) -> int: ...
    def lengths(self) -> list[int]: ...
    def row_ids(self) -> list[str] | None: ...
    def sequence(self, i: int) -> dict[str, torch.Tensor]: ...


# ----------------------------------------------------------------------------------------------------------------
# sources


class PreparedSource:
    """Token rows of a prepared (or regenerated) Arrow dir: input_ids + loss_mask."""

    def __init__(self, directory: Path, max_length: int | None = None) -> None:
        self.directory = Path(directory)
        self.dataset, self.manifest = load_token_dataset(self.directory)
        self.max_length = max_length
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        if self._lengths is None:
            col = self.dataset.data.column("input_ids")
            lens = pc.list_value_length(col).to_pylist()
            self._lengths = [min(int(n), self.max_length) if self.max_length else int(n) for n in lens]
        return self._lengths

    def row_ids(self) -> list[str] | None:
        return [str(i) for i in self.dataset["id"]] if "id" in self.dataset.column_names else None

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        row = self.dataset[int(i)]
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"], dtype=torch.long)
        if self.max_length:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        return {"input_ids": ids, "loss_mask": mask}


class FeatureSource:
    """Sequences of an offline feature store (taps / last hidden / top-k teacher)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.store)

    def lengths(self) -> list[int]:
        if self._lengths is None:
            get = getattr(self.store, "lengths", None)
            if callable(get):
                self._lengths = [int(n) for n in get()]
            else:
                self._lengths = [int(self.store.sequence(i)["input_ids"].numel()) for i in range(len(self.store))]
        return self._lengths

    def row_ids(self) -> list[str] | None:
        get = getattr(self.store, "row_ids", None)
        return list(get()) if callable(get) else None

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        return self.store.sequence(int(i))


def train_val_indices(source: SequenceSource, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) indices of the source's sequences: the same deterministic split capture uses for the features
    (grouped by source row, so the temperature copies of one regenerated row are never on both sides)."""
    ids, n = source.row_ids(), len(source)
    return split(n, "train", val_fraction, seed, ids), split(n, "val", val_fraction, seed, ids)


# ----------------------------------------------------------------------------------------------------------------
# order


@dataclass
class BatchPlan:
    """Which sequences form each micro-batch of each epoch, for one rank."""

    indices: list[int]  # the training split
    lengths: list[int]  # lengths of ALL sequences (indexed by sequence id)
    batch_size: int
    seed: int
    rank: int = 0
    world: int = 1
    window: int = 16  # micro-batches per length-sorted window

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SpeculatorsError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if len(self.indices) < self.batch_size * self.world:
            raise SpeculatorsError(
                f"only {len(self.indices)} training sequences for {self.world} process(es) x batch_size "
                f"{self.batch_size}; lower train.batch_size or add data")

    def global_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(f"plan:{self.seed}:{epoch}")
        order = list(self.indices)
        rng.shuffle(order)
        span = self.batch_size * self.window
        batches: list[list[int]] = []
        for start in range(0, len(order), span):
            window = sorted(order[start:start + span], key=lambda i: (-self.lengths[i], i))
            batches.extend(window[j:j + self.batch_size] for j in range(0, len(window), self.batch_size))
        rng.shuffle(batches)
        keep = len(batches) // self.world * self.world
        return batches[:keep]

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch for one rank."""
        n_batches = -(-len(self.indices) // self.batch_size)
        return n_batches // self.world

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        cached = getattr(self, "_cache", None)
        if cached is None or cached[0] != epoch:
            cached = (epoch, self.global_batches(epoch)[self.rank::self.world])
            self._cache = cached
        return cached[1]

    def batch_at(self, micro_step: int) -> list[int]:
        """The micro-batch this rank trains on at global micro-step `micro_step` (epochs repeat, reshuffled)."""
        per = self.batches_per_epoch
        epoch, i = divmod(micro_step, per)
        return self.epoch_batches(epoch)[i]


# ----------------------------------------------------------------------------------------------------------------
# collation


def collate(seqs: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into a batch: ints [B, T], floats [B, T, ...]."""
    b = len(seqs)
    t = max(int(s["input_ids"].numel()) for s in seqs)
    out: dict[str, torch.Tensor] = {
        "input_ids": torch.full((b, t), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.long),
    }
    for i, s in enumerate(seqs):
        n = int(s["input_ids"].numel())
        out["input_ids"][i, :n] = s["input_ids"]
        out["attention_mask"][i, :n] = 1
        out["loss_mask"][i, :n] = s["loss_mask"]
    for key in seqs[0]:
        if key in ("input_ids", "loss_mask"):
            continue
        first = seqs[0][key]
        if key == "teacher_topk_ids":
            buf = torch.full((b, t, first.shape[-1]), -1, dtype=torch.long)
        elif key == "teacher_topk_logprobs":
            buf = torch.full((b, t, first.shape[-1]), float("-inf"), dtype=torch.float32)
        else:
            buf = torch.zeros((b, t, *first.shape[1:]), dtype=first.dtype)
        for i, s in enumerate(seqs):
            v = s[key]
            buf[i, : v.shape[0]] = v
        out[key] = buf
    return out


def load_batch(source: SequenceSource, indices: list[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    return collate([source.sequence(i) for i in indices], pad_id)


class MicroBatches(torch.utils.data.Dataset):
    """Item m = (sequence indices, collated batch) of this rank's micro-step m, so a `DataLoader` with
    `sampler=range(start, stop)` and `num_workers` workers prefetches exactly the batches of the plan, in order."""

    def __init__(self, source: SequenceSource, plan: BatchPlan, pad_id: int = 0) -> None:
        self.source, self.plan, self.pad_id = source, plan, pad_id

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, micro_step: int) -> tuple[list[int], dict[str, torch.Tensor]]:
        indices = self.plan.batch_at(int(micro_step))
        return indices, load_batch(self.source, indices, self.pad_id)


def _identity(x: Any) -> Any:
    return x


def micro_batch_loader(source: SequenceSource, plan: BatchPlan, start: int, count: int, num_workers: int = 0,
                       pad_id: int = 0) -> Any:
    """Micro-batches start .. start+count-1 of this rank (the data position is `start`)."""
    return torch.utils.data.DataLoader(MicroBatches(source, plan, pad_id), batch_size=None,
                                       sampler=range(start, start + count), num_workers=num_workers,
                                       collate_fn=_identity, prefetch_factor=2 if num_workers else None)


# ----------------------------------------------------------------------------------------------------------------
# features + teacher per batch


class OnlineFeatures:
    """Online mode: one target forward per batch (no grad, `speculators.data.features.compute_features`, the same
    code offline capture runs) gives taps, last hidden and the dense teacher."""

    def __init__(self, target_model: Any, request: Any, vocab: VocabMap, shape: TeacherShape = TeacherShape()) -> None:
        self.model = target_model
        self.request = request  # models.base.FeatureRequest of the speculator
        self.vocab = vocab
        self.shape = shape

    def __call__(self, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[dict[str, torch.Tensor],
                                                                                      Teacher]:
        ids = batch["input_ids"].to(device)  # [B, T]
        am = batch["attention_mask"].to(device)  # [B, T]
        with torch.no_grad():
            feats = compute_features(self.model, ids, am, self.request, teacher="logits")
        teacher = dense_teacher(feats.pop("logits"), self.vocab, self.shape)  # [B, T, V] -> draft-vocab log-probs
        return {"input_ids": ids, "attention_mask": am, **feats}, teacher


class OfflineFeatures:
    """Offline mode: stored taps / last hidden; teacher = stored top-k, or recomputed from the stored last hidden
    state with the target's lm_head."""

    def __init__(self, lm_head: torch.Tensor | None, need_taps: bool, need_last: bool, vocab: VocabMap,
                 shape: TeacherShape = TeacherShape()) -> None:
        self.lm_head = lm_head  # [V, H] on the training device (only for a "hidden" teacher)
        self.need_taps = need_taps
        self.need_last = need_last
        self.vocab = vocab
        self.shape = shape

    def __call__(self, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[dict[str, torch.Tensor],
                                                                                      Teacher]:
        inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
        for key, needed in (("taps", self.need_taps), ("last_hidden", self.need_last)):
            if needed:
                if key not in batch:
                    raise SpeculatorsError(f"the feature shards hold no '{key}', which this speculator needs; "
                                           "re-run capture for this recipe")
                inputs[key] = batch[key].to(device, non_blocking=True)
        if "teacher_topk_ids" in batch:
            teacher = sparse_teacher(batch["teacher_topk_ids"].to(device), batch["teacher_topk_logprobs"].to(device),
                                     self.vocab, self.shape)
        elif "last_hidden" in batch and self.lm_head is not None:
            needed = loss_teacher_positions(batch["loss_mask"].to(device), inputs["attention_mask"])  # [B, T]
            teacher = hidden_teacher(batch["last_hidden"].to(device), self.lm_head, self.vocab, shape=self.shape,
                                     needed=needed)
        else:
            raise SpeculatorsError("the feature shards hold neither a top-k teacher nor the last hidden state; "
                                   "re-run capture (capture.teacher: topk | hidden)")
        return inputs, teacher
