"""Small shared pieces of the data stages: atomic writes, manifests, the token-dataset format, token statistics.

The token-dataset format (`prepared/` and `regenerated/`): a `datasets` Arrow dir (`save_to_disk`) with columns
`id` (string), `input_ids` (int32 list), `loss_mask` (int8 list, 1 = assistant token incl. its end-of-turn token)
and `conversation` (the normalised conversation as JSON, so regenerate can re-render it), plus `manifest.json`
(format `speculators.prepared/v1`, written last; `complete: true`).

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

from speculators.errors import SpeculatorsError

PREPARED_FORMAT = "speculators.prepared/v1"
MANIFEST = "manifest.json"


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` via a temp file + fsync + os.replace (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as fh:
        json.dump(data, fh, indent=2, sort_keys=False, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> dict:
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
    m = read_json(path, f"{what} manifest")
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


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temp dir into place; the previous output is removed only once the new one is complete."""
    final = Path(final)
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)


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


def save_token_dataset(rows: dict[str, list], directory: Path) -> None:
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict(rows, features=token_features())
    ds.save_to_disk(str(directory))


def load_token_dataset(directory: Path, what: str = "prepared data") -> tuple[Any, dict]:
    """(datasets.Dataset, manifest) of a complete prepared/regenerated dir, validated."""
    import datasets

    directory = Path(directory)
    manifest = read_manifest(directory, PREPARED_FORMAT, what)
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(directory))
    except Exception as exc:  # noqa: BLE001 - arrow/datasets errors vary
        raise SpeculatorsError(f"{what} at {directory} is unreadable ({(str(exc).splitlines() or ['?'])[0]}); "
                               "re-run the stage with --force") from None
    missing = {"id", "input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise SpeculatorsError(f"{what} at {directory} lacks columns {sorted(missing)}; re-run the stage")
    if len(ds) != manifest.get("counts", {}).get("rows"):
        raise SpeculatorsError(f"{what} at {directory} has {len(ds)} rows but its manifest says "
                               f"{manifest.get('counts', {}).get('rows')}; re-run the stage with --force")
    return ds, manifest
