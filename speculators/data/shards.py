"""The feature-shard format (`features/`) and `FeatureStore`, the only way training reads it.

A shard `shard-XXXXX.safetensors` packs consecutive sequences (rows of the prepared data, in order):
    input_ids      [N] int32            loss_mask [N] int8            offsets [S+1] int64 (row boundaries)
    taps           [N, n*H] int8|bf16   taps_scale [N, n*H/g] float32 (int8 only; one absmax scale per token and
                                        group of g channels)                      -- EAGLE-3 (residual stream
                                        entering the tap layers, in layer-id order)
    last_hidden    [N, H] int8|bf16     last_hidden_scale [N, H/g] float32        -- Medusa / MTP, teacher=hidden
    teacher_topk_ids [M, k] int16|int32 teacher_topk_logprobs [M, k] float16      -- teacher=topk
    position_weight [N] float32         per-position loss weights (optional: rows built from traffic, data/traffic.py)
A recording of served traffic (runtime/recording.py) is a directory of this format too, one row per shard, with the
verification feedback beside it (`cycle_start`, `draft_depth`, `draft_accepted`, `draft_nodes`: `token_tensor`).
The teacher (top-k of the target's next-token log-probs) is stored only at the M positions p whose next token is
an assistant token (loss_mask[p+1] == 1): no loss ever reads the others. Metadata: one key, "speculators" (JSON:
format, shard index, row ids), so the bytes are deterministic. Bytes/token are reported against the EAGLE /
SpecForge layout (bf16 taps + bf16 last hidden = 8·H bytes/token).

`manifest.json` (format `speculators.features/v1`, written last) lists every shard with its sha256, rows and
tokens. `FeatureStore` validates the manifest eagerly, every shard's checksum when asked (`verify_checksums`:
training does before step 1) and each shard's contents lazily on first use (offsets, shapes, NaN/Inf), then reads
sequences as memory-mapped slices and returns float32 (dequantised) tensors.

This module does not run the target (capture.py does).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from speculators.core.errors import PairingError, SpeculatorsError
from speculators.core.feature_codec import FEATURES_FORMAT, check_finite, decode_hidden, stored_teacher_positions
from speculators.core.hashing import sha256_file
from speculators.data.artifacts import read_manifest
from speculators.data.schemas import source_row_id

SHARD_PATTERN = "shard-{:05d}.safetensors"


# ----------------------------------------------------------------------------------------------------------------
# reading


def split_side_indices(n: int, name: str, val_fraction: float, seed: int,
                       row_ids: Sequence[str] | None = None) -> list[int]:
    """The indices of side `name` ("train" or "val") of the deterministic train/val split of n sequences (the same
    for capture's vocab and for training). With `row_ids` (one per sequence) the split is made over source rows
    (`schemas.source_row_id`): the temperature copies of one regenerated row land on the same side; with every
    source row distinct it is the plain split of n."""
    if name not in ("train", "val"):
        raise SpeculatorsError(f"split must be 'train' or 'val', got {name!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise SpeculatorsError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if row_ids is not None and len(row_ids) != n:
        raise SpeculatorsError(f"split: {len(row_ids)} row ids for {n} sequences")
    groups = [source_row_id(str(i)) for i in row_ids] if row_ids is not None else None
    keys = list(dict.fromkeys(groups)) if groups is not None else None  # first-appearance order
    units = n if keys is None else len(keys)
    n_val = int(round(units * val_fraction))
    if val_fraction > 0 and units >= 2:
        n_val = min(max(n_val, 1), units - 1)
    perm = torch.randperm(units, generator=torch.Generator().manual_seed(int(seed))).tolist()
    chosen = perm[:n_val] if name == "val" else perm[n_val:]
    if keys is None or units == n:
        return sorted(chosen)
    picked = {keys[u] for u in chosen}
    assert groups is not None
    return [i for i, g in enumerate(groups) if g in picked]


class _OpenShard:
    """An open, verified shard: its safetensors handle (reads are memory-mapped slices) and small row index."""

    def __init__(self, handle: Any, offsets: torch.Tensor, loss_mask: torch.Tensor, ids: list[str]) -> None:
        self.handle = handle
        self.keys = set(handle.keys())
        self.offsets = offsets  # [S+1] long
        self.loss_mask = loss_mask  # [N] int8
        self.ids = ids
        self.teacher_starts: list[int] = [0]
        for r in range(len(offsets) - 1):
            seg = loss_mask[int(offsets[r]):int(offsets[r + 1])]
            self.teacher_starts.append(self.teacher_starts[-1] + int(stored_teacher_positions(seg).sum()))

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.handle.get_slice(name)[a:b]


class FeatureStore:
    """Read-only access to a features dir: `len(store)`, `store.sequence(i)`, `store.split(...)`.

    Each shard is verified (size, sha256, offsets, shapes, NaN/Inf) the first time it is used; afterwards a
    sequence is read as memory-mapped slices of the shard, so random access costs only the bytes of that sequence.
    """

    def __init__(self, features_dir: str | Path, cache_shards: int = 16) -> None:
        self.dir = Path(features_dir)
        self.manifest: dict = read_manifest(self.dir, FEATURES_FORMAT, "features")
        shards = self.manifest.get("shards")
        if not isinstance(shards, list) or not shards:
            raise SpeculatorsError(f"features manifest {self.dir / 'manifest.json'} lists no shards; re-run capture")
        self._index: list[tuple[int, int]] = []  # sequence -> (shard, row within shard)
        for s, rec in enumerate(shards):
            for r in range(int(rec["rows"])):
                self._index.append((s, r))
        if len(self._index) != int(self.manifest["counts"]["sequences"]):
            raise SpeculatorsError(f"features manifest {self.dir} is inconsistent (shard rows do not add up to "
                                   f"{self.manifest['counts']['sequences']} sequences); re-run capture --force")
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._cache_size = max(1, cache_shards)
        self._verified: set[int] = set()  # shards fully validated (checksum, offsets, shapes, finite values)
        self._checksummed: set[int] = set()  # shards whose size and sha256 were checked
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self._index)

    @property
    def layer_ids(self) -> list[int] | None:
        return self.manifest.get("layer_ids")

    @property
    def teacher(self) -> str:
        return self.manifest["teacher"]

    def lengths(self) -> list[int]:
        """Token count of every sequence, read from the shards' offsets only (no checksum pass)."""
        if self._lengths is None:
            out: list[int] = []
            for s in range(len(self.manifest["shards"])):
                off = self._handle(s).get_tensor("offsets")
                if off.shape[0] != int(self.manifest["shards"][s]["rows"]) + 1:
                    raise SpeculatorsError(f"feature shard {self.shard_path(s)} does not match the manifest; "
                                           "re-run capture")
                out.extend((off[1:] - off[:-1]).tolist())
            self._lengths = out
        return list(self._lengths)

    def row_ids(self) -> list[str]:
        """The row id of every sequence, read from the shards' metadata only (no checksum pass)."""
        out: list[str] = []
        for s in range(len(self.manifest["shards"])):
            meta = json.loads((self._handle(s).metadata() or {}).get("speculators", "{}"))
            ids = [str(i) for i in meta.get("ids", [])]
            if len(ids) != int(self.manifest["shards"][s]["rows"]):
                raise SpeculatorsError(f"feature shard {self.shard_path(s)} does not match the manifest; re-run capture")
            out.extend(ids)
        return out

    def split(self, name: str, val_fraction: float, seed: int) -> list[int]:
        return split_side_indices(len(self), name, val_fraction, seed, self.row_ids())

    def check_target(self, fingerprint: dict) -> None:
        """Raise if these features were captured from another target (or tokenizer) than `fingerprint`."""
        mine = self.manifest["target"]
        if fingerprint.get("tokenizer_hash") != mine.get("tokenizer_hash"):
            raise PairingError(f"features in {self.dir} were captured with another tokenizer "
                               f"({mine.get('name_or_path')}, tokenizer {str(mine.get('tokenizer_hash'))[:12]}) than "
                               f"the target {fingerprint.get('name_or_path')} (tokenizer "
                               f"{str(fingerprint.get('tokenizer_hash'))[:12]}); re-run capture for this target")
        if fingerprint.get("content_hash") != mine.get("content_hash"):
            raise PairingError(f"features in {self.dir} come from target {mine.get('name_or_path')} revision "
                               f"{mine.get('revision')}, not {fingerprint.get('name_or_path')} revision "
                               f"{fingerprint.get('revision')}; re-run capture for this target")

    def row_id(self, i: int) -> str:
        s, r = self._locate(i)
        return self._shard(s).ids[r]

    def _locate(self, i: int) -> tuple[int, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range (store has {len(self)})")
        return self._index[i]

    def shard_path(self, s: int) -> Path:
        return self.dir / self.manifest["shards"][s]["file"]

    def verify_shard(self, s: int) -> None:
        """Size and sha256 of shard s against the manifest (SpeculatorsError naming the file and the fix)."""
        rec = self.manifest["shards"][s]
        path = self.shard_path(s)
        if not path.is_file():
            raise SpeculatorsError(f"feature shard {path} is missing; re-run capture (complete shards are kept)")
        size = path.stat().st_size
        if size != int(rec["bytes"]):
            raise SpeculatorsError(f"feature shard {path} is truncated or altered ({size} bytes, manifest says "
                                   f"{rec['bytes']}); re-run capture to rewrite it")
        if sha256_file(path) != rec["sha256"]:
            raise SpeculatorsError(f"feature shard {path} fails its checksum; re-run capture to rewrite it")
        self._checksummed.add(s)

    def verify_checksums(self) -> None:
        """Size and sha256 of every shard against the manifest (training runs this before its first step, so a
        damaged shard fails at once instead of when an epoch reaches it)."""
        for s in range(len(self.manifest["shards"])):
            if s not in self._checksummed:
                self.verify_shard(s)

    def verify(self) -> None:
        """Check every shard (checksums and contents)."""
        for s in range(len(self.manifest["shards"])):
            self._shard(s)

    def _handle(self, s: int) -> Any:
        path = self.shard_path(s)
        if not path.is_file():
            raise SpeculatorsError(f"feature shard {path} is missing; re-run capture (complete shards are kept)")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types on corrupt headers
            raise SpeculatorsError(f"feature shard {path} is unreadable ({exc}); re-run capture") from None

    def _shard(self, s: int) -> _OpenShard:
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        if s not in self._verified and s not in self._checksummed:
            self.verify_shard(s)
        handle = self._handle(s)
        try:
            meta = json.loads((handle.metadata() or {}).get("speculators", "{}"))
            offsets = handle.get_tensor("offsets").long()
            loss_mask = handle.get_tensor("loss_mask")
        except Exception as exc:  # noqa: BLE001
            raise SpeculatorsError(f"feature shard {self.shard_path(s)} is invalid ({exc}); re-run capture --force") \
                from None
        if s not in self._verified:
            self._validate(s, handle, offsets, loss_mask, meta)
            self._verified.add(s)
        shard = _OpenShard(handle, offsets, loss_mask, list(meta["ids"]))
        self._open[s] = shard
        if len(self._open) > self._cache_size:
            self._open.popitem(last=False)
        return shard

    def _validate(self, s: int, h: Any, off: torch.Tensor, loss_mask: torch.Tensor, meta: dict) -> None:
        path = self.shard_path(s)
        rec = self.manifest["shards"][s]

        def bad(what: str) -> SpeculatorsError:
            return SpeculatorsError(f"feature shard {path} is invalid: {what}; re-run capture --force")

        keys = set(h.keys())

        def shape(name: str) -> tuple[int, ...] | None:
            return tuple(h.get_slice(name).get_shape()) if name in keys else None

        if "input_ids" not in keys:
            raise bad("missing tensor 'input_ids'")
        n = shape("input_ids")[0]
        if off.shape[0] != int(rec["rows"]) + 1 or int(off[0]) != 0 or int(off[-1]) != n or \
                bool((off[1:] <= off[:-1]).any()) or len(meta.get("ids", [])) != int(rec["rows"]):
            raise bad("row offsets do not match the manifest")
        if loss_mask.shape[0] != n:
            raise bad("loss_mask length differs from input_ids")
        h_size = int(self.manifest["hidden_size"])
        expect = {}
        if "taps" in self.manifest["stored"]:
            expect["taps"] = len(self.manifest.get("layer_ids") or []) * h_size
        if "last_hidden" in self.manifest["stored"]:
            expect["last_hidden"] = h_size
        for name, width in expect.items():
            if shape(name) != (n, width):
                raise bad(f"{name} has shape {shape(name)}, expected ({n}, {width})")
            scale = f"{name}_scale"
            check_finite(name, h.get_tensor(scale if scale in keys else name), str(path))
        if self.manifest["teacher"] == "topk":
            m = sum(int(stored_teacher_positions(loss_mask[int(off[r]):int(off[r + 1])]).sum())
                    for r in range(len(off) - 1))
            k = int(self.manifest["teacher_topk"])
            for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
                if shape(name) != (m, k):
                    raise bad(f"{name} has shape {shape(name)}, expected ({m}, {k})")
            check_finite("teacher_topk_logprobs", h.get_tensor("teacher_topk_logprobs"), str(path))
        if "position_weight" in keys:
            weight = h.get_tensor("position_weight")
            if tuple(weight.shape) != (n,) or not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
                raise bad("position_weight must be [N] finite and >= 0")

    def token_tensor(self, i: int, name: str) -> torch.Tensor | None:
        """Sequence i's rows of a per-token tensor `name` stored beside the features (a recording's feedback,
        `cycle_start` ...), as stored; None when its shard has no such tensor."""
        s, r = self._locate(i)
        sh = self._shard(s)
        return sh.rows(name, int(sh.offsets[r]), int(sh.offsets[r + 1])) if name in sh.keys else None

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        """One sequence: input_ids/loss_mask [T] long, features [T, *] float32, the teacher (see module doc), and the
        per-position loss weights [T] float32 where the shard has them (`position_weight`: rows from traffic)."""
        s, r = self._locate(i)
        sh = self._shard(s)
        a, b = int(sh.offsets[r]), int(sh.offsets[r + 1])
        out: dict[str, torch.Tensor] = {"input_ids": sh.rows("input_ids", a, b).long(),
                                        "loss_mask": sh.loss_mask[a:b].long()}
        if "position_weight" in sh.keys:
            out["position_weight"] = sh.rows("position_weight", a, b).float()
        for name in ("taps", "last_hidden"):
            if name in sh.keys:
                part = {name: sh.rows(name, a, b)}
                if f"{name}_scale" in sh.keys:
                    part[f"{name}_scale"] = sh.rows(f"{name}_scale", a, b)
                out[name] = decode_hidden(part, name)
        if "teacher_topk_ids" in sh.keys:
            pos = stored_teacher_positions(out["loss_mask"])  # [T] bool
            start, stop = sh.teacher_starts[r], sh.teacher_starts[r + 1]
            k = int(self.manifest["teacher_topk"])
            ids = torch.arange(k).repeat(b - a, 1)  # [T, k] placeholder where no loss reads the teacher
            logprobs = torch.full((b - a, k), -math.log(k))  # uniform over the placeholder ids: finite
            ids[pos] = sh.rows("teacher_topk_ids", start, stop).long()
            logprobs[pos] = sh.rows("teacher_topk_logprobs", start, stop).float()
            out["teacher_topk_ids"] = ids
            out["teacher_topk_logprobs"] = logprobs
            out["teacher_mask"] = pos.long()
        return out
