"""Pairing: the (draft revision, target revision) identity every speculator directory carries in `pairing.json`.

`pairing.json` records the target it was trained for (name, resolved revision, content hash, tokenizer hash,
adapter, layer ids, hidden size, vocab), the draft (family and revision = hash of its config + weights), the
training recipe and, after evaluation/export, an evaluation summary. `check_pairing` is what the runtime calls
before serving: a tokenizer mismatch is always refused; a different target revision is refused unless the caller
explicitly allows it. This module does not load models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from speculators.core.atomic import write_text_atomic
from speculators.core.errors import PairingError, SpeculatorsError

PAIRING_FILE = "pairing.json"
PAIRING_FORMAT = "speculators.pairing/v1"


def draft_revision(directory: str | Path) -> str:
    """sha256 over the speculator's config.json and weight files (names + bytes)."""
    d = Path(directory)
    h = hashlib.sha256()
    files = sorted(p for p in d.iterdir() if p.is_file() and (p.name == "config.json" or p.suffix == ".safetensors"))
    if not files:
        raise SpeculatorsError(f"{d} holds no config.json / *.safetensors; not a speculator directory")
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def pairing_record(*, target: dict, family: str, layer_ids: list[int] | None, draft_dir: str | Path,
                   recipe: dict | None = None, evaluation: dict | None = None, extra: dict | None = None) -> dict:
    """Build the pairing record for a speculator directory whose config + weights are already written."""
    record: dict[str, Any] = {
        "format": PAIRING_FORMAT,
        "target": {
            "name_or_path": target["name_or_path"], "revision": target["revision"],
            "content_hash": target["content_hash"], "tokenizer_hash": target["tokenizer_hash"],
            "adapter": target.get("adapter"), "adapter_revision": target.get("adapter_revision"),
            "architectures": target.get("architectures", []), "num_layers": target["num_layers"],
            "hidden_size": target["hidden_size"], "vocab_size": target["vocab_size"],
        },
        "draft": {"family": family, "revision": draft_revision(draft_dir), "layer_ids": layer_ids},
        "recipe": recipe,
        "evaluation": evaluation,
    }
    if extra:
        record.update(extra)
    return record


def write_pairing(directory: str | Path, record: dict) -> Path:
    return write_text_atomic(Path(directory) / PAIRING_FILE, json.dumps(record, indent=2, sort_keys=False) + "\n")


def read_pairing(directory: str | Path) -> dict:
    path = Path(directory) / PAIRING_FILE
    if not path.is_file():
        raise SpeculatorsError(f"{directory} has no {PAIRING_FILE}; it was not written by speculators train/export "
                               f"(re-export it, or pass a directory that has one)")
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpeculatorsError(f"{path} is not valid JSON ({exc})") from None
    if record.get("format") != PAIRING_FORMAT:
        raise SpeculatorsError(f"{path}: unknown pairing format {record.get('format')!r} (expected {PAIRING_FORMAT})")
    return record


def check_pairing(record: dict, target: dict, *, allow_revision_mismatch: bool = False,
                  check_draft_dir: str | Path | None = None) -> list[str]:
    """Refuse a target the speculator was not trained for. Returns warnings (overridden revision mismatch).

    `target` is a `TargetFingerprint.to_dict()` of the target about to be served.
    """
    want = record["target"]
    if want["tokenizer_hash"] != target["tokenizer_hash"]:
        raise PairingError(
            f"tokenizer mismatch: the speculator was trained with the tokenizer of {want['name_or_path']} "
            f"(tokenizer {want['tokenizer_hash'][:12]}) but the target {target['name_or_path']} uses tokenizer "
            f"{target['tokenizer_hash'][:12]}; this can never be served together")
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if int(want[key]) != int(target[key]):
            raise PairingError(f"target shape mismatch: speculator expects {key}={want[key]}, target "
                               f"{target['name_or_path']} has {key}={target[key]}")
    warnings: list[str] = []
    same_rev = want["revision"] == target["revision"] and want["content_hash"] == target["content_hash"]
    same_adapter = (want.get("adapter_revision") or None) == (target.get("adapter_revision") or None)
    if not (same_rev and same_adapter):
        msg = (f"target revision mismatch: the speculator was trained for {want['name_or_path']}@{want['revision']}"
               f"{'+adapter@' + str(want.get('adapter_revision')) if want.get('adapter') else ''} but the target is "
               f"{target['name_or_path']}@{target['revision']}"
               f"{'+adapter@' + str(target.get('adapter_revision')) if target.get('adapter') else ''}")
        if not allow_revision_mismatch:
            raise PairingError(msg + " (pass --allow-revision-mismatch to serve it anyway)")
        warnings.append(msg + " (allowed by override)")
    if check_draft_dir is not None:
        actual = draft_revision(check_draft_dir)
        if actual != record["draft"]["revision"]:
            raise PairingError(f"draft weights in {check_draft_dir} changed since pairing.json was written "
                               f"(recorded {record['draft']['revision'][:19]}, found {actual[:19]})")
    return warnings
