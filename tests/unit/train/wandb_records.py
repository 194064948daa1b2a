"""Reading what an offline W&B run recorded: its `run-<id>.wandb` files (W&B's append-only log: a 7-byte file header,
then 32 KiB blocks of leveldb-log records, each a protobuf `Record`), so tests can check what reached the run."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        part, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield part
        elif kind == FIRST:
            buf = part
        elif kind == MIDDLE:
            buf += part
        elif kind == LAST:
            yield buf + part


def offline_run(logs_dir: Path, run_id: str) -> dict:
    """Everything the offline run `run_id` under logs_dir/wandb recorded, over all its (resumed) run files:
    {"run": [(project, entity, group, tags)], "history": [{key: value}], "summary": {key: value}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict = {"run": [], "history": [], "summary": {}}
    # a resume in the same second as the start lands in "offline-run-<time>-<id>-1": every directory of the run
    files = sorted(Path(logs_dir).glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert files, f"no offline W&B run {run_id} under {logs_dir}"
    for path in files:
        for rec in _records_once_exited(path, pb):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["run"].append((rec.run.project, rec.run.entity, rec.run.run_group, list(rec.run.tags)))
            elif kind == "history":
                out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.history.item})
            elif kind == "summary":
                out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.summary.update})
    return out


def _records_once_exited(path: Path, pb, timeout_s: float = 60.0) -> list:
    """The records of one run file once it holds the run's exit record: W&B's service process writes the file and
    can still be flushing it when `finish()` returns (about one read in eight saw a run without its last history)."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        records = []
        for raw in _chunks(data):
            rec = pb.Record()
            rec.ParseFromString(raw)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)
