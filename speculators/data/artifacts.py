"""Small shared pieces of the data stages: temp dirs (put in place by `core.atomic.replace_dir`), manifests, the
token-dataset format, token statistics.

The token-dataset format (`prepared/` and `regenerated/`): a `datasets` Arrow dir (`save_to_disk`) with columns
`id` (string), `input_ids` (int32 list), `loss_mask` (int8 list, 1 = assistant token incl. its end-of-turn token)
and `conversation` (the normalised conversation as JSON, so regenerate can re-render it), plus `manifest.json`
(format `speculators.prepared/v1`, written last; `complete: true`; `files`: every file of the dir with its size and
sha256). `load_token_dataset` verifies those checksums and the values (loss_mask in {0, 1}, token ids in
[0, vocab), one mask per id) before anything reads a row, so a dataset altered after it was written fails with one
line naming the file (or the row) instead of flowing into feature shards.

This module does not tokenize, run models or decide stage policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from speculators.core.atomic import write_json_atomic
from speculators.core.errors import SpeculatorsError
from speculators.core.hashing import sha256_file

PREPARED_FORMAT = "speculators.prepared/v1"
MANIFEST = "manifest.json"


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def read_stage_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpeculatorsError(f"{what} not found: {path}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpeculatorsError(f"{what} {path} is unreadable ({exc}); delete it and re-run the stage") from None
    if not isinstance(data, dict):
        raise SpeculatorsError(f"{what} {path} is not a JSON object; delete it and re-run the stage")
    return data


def read_manifest(directory: Path, fmt: str, what: str) -> dict:
    """The complete manifest of a stage output dir, or a one-line error naming the fix."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise SpeculatorsError(f"{what} at {directory} is missing or incomplete (no {MANIFEST}); run that stage first")
    m = read_stage_json(path, f"{what} manifest")
    if m.get("format") != fmt:
        raise SpeculatorsError(f"{path} has format {m.get('format')!r}, expected {fmt!r}; re-run that stage")
    if not m.get("complete"):
        raise SpeculatorsError(f"{what} at {directory} is incomplete; re-run that stage")
    return m


def try_manifest(directory: Path, fmt: str) -> dict | None:
    try:
        return read_manifest(directory, fmt, "output")
    except SpeculatorsError:
        return None


def partial_dir(directory: Path, inputs_hash: str, inputs: dict, force: bool) -> bool:
    """Keep `directory` (a stage's resumable work dir) when it was made for the same inputs, else start it over
    (also when forced); returns True when it was (re)created empty."""
    directory = Path(directory)
    marker = directory / "inputs.json"
    if directory.exists():
        try:
            same = json.loads(marker.read_text()).get("inputs_hash") == inputs_hash
        except (OSError, json.JSONDecodeError):
            same = False
        if force or not same:
            shutil.rmtree(directory)
    if directory.exists():
        return False
    directory.mkdir(parents=True)
    write_json_atomic(marker, {"inputs_hash": inputs_hash, "inputs": inputs})
    return True


def temp_dir_for(final: Path) -> Path:
    tmp = Path(final).with_name(f".{Path(final).name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def token_stats(lengths: list[int], masked: list[int]) -> dict:
    total, m = int(sum(lengths)), int(sum(masked))
    s = sorted(lengths)

    def pct(q: float) -> int:
        return int(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]) if s else 0

    return {"total": total, "masked": m, "masked_share": round(m / total, 4) if total else 0.0,
            "mean_length": round(total / len(lengths), 1) if lengths else 0.0, "p50_length": pct(0.5),
            "p95_length": pct(0.95), "max_length": max(lengths) if lengths else 0}


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------------------------
# the token-dataset format


def token_features() -> Any:
    import datasets

    return datasets.Features({"id": datasets.Value("string"), "input_ids": datasets.List(datasets.Value("int32")),
                              "loss_mask": datasets.List(datasets.Value("int8")),
                              "conversation": datasets.Value("string")})


def save_token_dataset(rows: dict[str, list], directory: Path) -> list[dict]:
    """Write the rows as a token dataset; returns the `files` record (name, bytes, sha256) for the manifest."""
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict(rows, features=token_features())
    ds.save_to_disk(str(directory))
    return [{"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(Path(directory).iterdir()) if p.is_file() and p.name != MANIFEST]


def verify_files(directory: Path, manifest: dict, what: str, stage: str) -> None:
    """Every file the manifest lists is there with its size and sha256 (one-line SpeculatorsError otherwise)."""
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise SpeculatorsError(f"{what} at {directory} has no checksums in its manifest (written by an older "
                               f"speculators); re-run `speculators {stage} --force`")
    for rec in files:
        path = Path(directory) / str(rec.get("file"))
        if not path.is_file():
            raise SpeculatorsError(f"{what} at {directory} is missing {path.name}; re-run `speculators {stage} --force`")
        if path.stat().st_size != rec.get("bytes") or sha256_file(path) != rec.get("sha256"):
            raise SpeculatorsError(f"{what} at {directory}: {path.name} fails its checksum (altered after "
                                   f"`speculators {stage}` wrote it); re-run `speculators {stage} --force`")


def intact(directory: Path, manifest: dict) -> bool:
    """Whether the files of a complete output still match their checksums."""
    try:
        verify_files(directory, manifest, "output", "prepare")
    except SpeculatorsError:
        return False
    return True


def check_token_values(ds: Any, directory: Path, what: str, stage: str, vocab_size: int | None = None) -> None:
    """loss_mask in {0, 1}, token ids in [0, vocab_size), as many mask values as ids in every row."""
    ids_col = pa.chunked_array(ds.data.column("input_ids").chunks).combine_chunks()
    mask_col = pa.chunked_array(ds.data.column("loss_mask").chunks).combine_chunks()

    def bad(row: int, detail: str) -> SpeculatorsError:
        return SpeculatorsError(f"{what} at {directory} is corrupt: row {row} ({ds[row]['id']!r}) {detail}; re-run "
                                f"`speculators {stage} --force`")

    unequal = np.flatnonzero(pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
                             != pc.list_value_length(mask_col).to_numpy(zero_copy_only=False))
    if unequal.size:
        raise bad(int(unequal[0]), "has a different number of input_ids and loss_mask values")
    offsets = ids_col.offsets.to_numpy()
    ids = ids_col.flatten().to_numpy(zero_copy_only=False)
    mask = mask_col.flatten().to_numpy(zero_copy_only=False)
    for values, wrong, detail in (
            (mask, (mask != 0) & (mask != 1), "has loss_mask {v} (expected 0 or 1)"),
            (ids, (ids < 0) | (ids >= (vocab_size if vocab_size is not None else np.iinfo(np.int64).max)),
             f"has token id {{v}} outside the vocabulary [0, {vocab_size})")):
        where = np.flatnonzero(wrong)
        if where.size:
            row = int(np.searchsorted(offsets, where[0], side="right") - 1)
            raise bad(row, detail.format(v=int(values[where[0]])))


def load_token_dataset(directory: Path, what: str = "prepared data", vocab_size: int | None = None,
                       stage: str = "prepare") -> tuple[Any, dict]:
    """(datasets.Dataset, manifest) of a complete prepared/regenerated dir: checksums and values verified
    (`check_token_values`; token ids against `vocab_size` when given)."""
    import datasets

    directory = Path(directory)
    manifest = read_manifest(directory, PREPARED_FORMAT, what)
    stage = str(manifest.get("stage") or stage)
    verify_files(directory, manifest, what, stage)
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(directory))
    except Exception as exc:  # noqa: BLE001 - arrow/datasets errors vary
        raise SpeculatorsError(f"{what} at {directory} is unreadable ({(str(exc).splitlines() or ['?'])[0]}); "
                               f"re-run `speculators {stage} --force`") from None
    missing = {"id", "input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise SpeculatorsError(f"{what} at {directory} lacks columns {sorted(missing)}; re-run the stage")
    if len(ds) != manifest.get("counts", {}).get("rows"):
        raise SpeculatorsError(f"{what} at {directory} has {len(ds)} rows but its manifest says "
                               f"{manifest.get('counts', {}).get('rows')}; re-run `speculators {stage} --force`")
    check_token_values(ds, directory, what, stage, vocab_size)
    return ds, manifest
