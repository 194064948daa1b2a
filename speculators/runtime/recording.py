"""Served traffic as training rows: `TrafficRecorder` writes every finished request of the runtime as one row of the
feature-shard format capture writes (`data/shards.py`), so a recording directory is read by `FeatureStore` (and by
training) exactly as a `features/` directory is.

A recorded row is the request's prompt + generated tokens:
    input_ids [T] int32, loss_mask [T] int8 (1 on the generated tokens only), offsets [2]
    taps [T, n*H] int8 + taps_scale      the residual stream entering the tap layers, as the verify forwards (and the
                                          prefill) computed it; the last token, never forwarded, holds zeros
    teacher_topk_ids / _logprobs [L, k]   the target's top-k log-probabilities (temperature 1) at the L positions whose
                                          next token was generated, from the raw logits verification already made
plus the verification feedback of every cycle:
    cycle_start [T] int8                  1 at each cycle's root (the positions a server drafts at)
    draft_depth [T] int8, draft_accepted [T] int8   at a root: the depth drafted (0: plain) and the drafts accepted
    draft_nodes [K, 5] int32              every proposed node: (root position, parent node, depth, token, accepted)
The shard's metadata names the draft revision that drafted it and the request's temperature.

A row is written once its request finished, atomically; `manifest.json` lists the rows. Rewriting it costs O(rows),
so it is rewritten at most every `MANIFEST_EVERY_S` seconds, and once the rows written since its last rewrite reach
1% of those it lists (a small recording: every row), at `flush()` and whenever rows are dropped; rows written after
the last rewrite (a process killed meanwhile) are listed again when the recording is reopened (`_adopt`). When the
recording exceeds its disk budget the oldest rows are dropped from the manifest, then deleted. Recording never
changes what is served: it only keeps tensors the cycles computed anyway (the engine's forwards capture the taps
while it records).

Not here: training on recordings (data/traffic.py), the cycle loop (engine.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from speculators.core.atomic import write_json_atomic
from speculators.core.errors import PairingError, SpeculatorsError
from speculators.core.feature_codec import FEATURES_FORMAT, encode_hidden, group_size_for, topk_id_dtype, write_shard
from speculators.core.hashing import sha256_file
from speculators.core.trees import DraftTree

RECORDING_KIND = "traffic"  # manifest["recording"]["kind"]: how training tells a recording from a capture
ROW_PATTERN = "row-{:09d}.safetensors"
DEFAULT_BUDGET_BYTES = 2 << 30
MANIFEST_EVERY_S = 2.0  # the longest a written row waits to be listed, while rows keep coming (flush() lists it)
NODE_COLUMNS = ("root_position", "parent", "depth", "token", "accepted")


@dataclass
class RecordingSpec:
    """Where and what to record: the directory, its disk budget, the teacher's k and the hidden-state storage."""

    directory: Path
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    teacher_topk: int = 20
    storage: str = "int8"

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.budget_bytes < 1 << 20:
            raise SpeculatorsError(f"a recording's disk budget must be at least 1 MiB, got {self.budget_bytes} bytes")
        if self.teacher_topk < 1:
            raise SpeculatorsError(f"the recorded teacher needs top-k >= 1, got {self.teacher_topk}")
        if self.storage not in ("int8", "bf16"):
            raise SpeculatorsError(f"recording storage must be int8 or bf16, got {self.storage!r}")


@dataclass
class RequestRecord:
    """What one request's cycles leave for its training row (filled by the engine, written by the recorder)."""

    prompt_ids: list[int]
    temperature: float
    topk: int  # the teacher's k
    prefill_taps: torch.Tensor | None = None  # [P-1, W]: the prompt's positions but its last (the first root)
    taps: list[torch.Tensor] = field(default_factory=list)  # [n_i, W] per chunk, positions in order
    teacher_ids: list[torch.Tensor] = field(default_factory=list)  # [n_i, k]
    teacher_logprobs: list[torch.Tensor] = field(default_factory=list)  # [n_i, k]
    cycles: list[tuple[int, int, int]] = field(default_factory=list)  # (root position, depth drafted, accepted)
    nodes: list[list[int]] = field(default_factory=list)  # NODE_COLUMNS per proposed node
    complete: bool = True  # False when a forward did not capture its taps (the row is then not written)

    def add_cycle(self, root_position: int, tree: DraftTree, path: list[int], taken: int,
                  taps: torch.Tensor | None, raw_logits: list[torch.Tensor]) -> None:
        """One verified cycle: the root + accepted path `path` (node indices), of which the first `taken` nodes
        produced committed tokens; `taps` [len(path), W] of the path's nodes; `raw_logits` [V] at those nodes."""
        if taps is None:
            self.complete = False
        elif taken:
            self.taps.append(taps[:taken].float().cpu())
            logp = torch.log_softmax(torch.stack(raw_logits[:taken]).float(), dim=-1)  # [n, V]
            top = logp.topk(self.topk, dim=-1)
            self.teacher_ids.append(top.indices.cpu())
            self.teacher_logprobs.append(top.values.clamp_min(-1e4).cpu())
        accepted = set(path[1:taken])
        self.cycles.append((root_position, int(tree.max_depth), len(accepted)))
        parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
        for i in range(1, tree.size):
            self.nodes.append([root_position, parents[i], depths[i], tokens[i], int(i in accepted)])


def _entry(path: Path, tokens: int, masked: int, size: int, digest: str, index: int, revision: str | None) -> dict:
    """A row's line in the manifest."""
    return {"file": path.name, "rows": 1, "tokens": tokens, "masked": masked, "bytes": size, "sha256": digest,
            "index": index, "draft_revision": revision}


class TrafficRecorder:
    """Appends finished requests of one engine (one target, one tap layout) to a recording directory."""

    def __init__(self, spec: RecordingSpec, *, target: dict, layer_ids: list[int], num_layers: int,
                 hidden_size: int, vocab_size: int) -> None:
        self.spec, self.target, self.layer_ids = spec, target, list(layer_ids)
        self.hidden_size, self.vocab_size, self.num_layers = hidden_size, vocab_size, num_layers
        self.lock = threading.RLock()  # the serving thread writes, another may flush
        self.rows_written = 0
        self.rows_skipped = 0  # requests whose forwards were not all captured (not written)
        self.seconds = 0.0  # spent writing rows
        spec.directory.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict] = self._existing_entries()
        self.unlisted = self._adopt()  # rows written since the manifest's last rewrite
        self.listed_at = time.monotonic()
        self.next_index = 1 + max((int(e["index"]) for e in self.entries), default=0)
        if self.unlisted:
            self.flush()

    def _existing_entries(self) -> list[dict]:
        """The rows of a recording already in the directory (appended to), after checking it is this target's."""
        path = self.spec.directory / "manifest.json"
        if not path.is_file():
            return []
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpeculatorsError(f"{path} is unreadable ({exc}); record into another directory") from None
        if manifest.get("recording", {}).get("kind") != RECORDING_KIND:
            raise SpeculatorsError(f"{self.spec.directory} holds something other than a recording; record into an "
                                   f"empty directory")
        theirs = manifest.get("target", {})
        if theirs.get("content_hash") != self.target["content_hash"] or manifest.get("layer_ids") != self.layer_ids:
            raise PairingError(f"{self.spec.directory} records target {theirs.get('name_or_path')}@"
                               f"{theirs.get('revision')} (taps {manifest.get('layer_ids')}), not "
                               f"{self.target['name_or_path']}@{self.target['revision']} (taps {self.layer_ids}); "
                               f"record into another directory")
        return [dict(e) for e in manifest.get("shards", [])]

    def _adopt(self) -> int:
        """List the rows of an earlier process written after its manifest's last rewrite (it was killed before a
        `flush`); the number adopted."""
        last = max((int(e["index"]) for e in self.entries), default=0)
        adopted = 0
        for path in sorted(self.spec.directory.glob("row-*.safetensors")):
            number = path.stem.removeprefix("row-")
            if not number.isdigit() or int(number) <= last:
                continue  # listed, or older than the listed rows (dropped by rotation): not adopted
            try:
                with safe_open(str(path), framework="pt") as fh:
                    meta = json.loads((fh.metadata() or {}).get("speculators", "{}"))
                    tokens, masked = int(fh.get_slice("input_ids").get_shape()[0]), int(fh.get_tensor("loss_mask").sum())
            except (OSError, ValueError, KeyError, SafetensorError):
                continue
            self.entries.append(_entry(path, tokens, masked, path.stat().st_size, sha256_file(path), int(number),
                                       meta.get("draft_revision")))
            adopted += 1
        return adopted

    def start(self, prompt_ids: list[int], temperature: float, prefill_taps: torch.Tensor | None) -> RequestRecord:
        return RequestRecord(list(prompt_ids), temperature, self.spec.teacher_topk, prefill_taps)

    def write(self, record: RequestRecord, output_ids: list[int], draft_revision: str | None) -> Path | None:
        """Write one finished request (None, and counted as skipped, when its taps are incomplete)."""
        with self.lock:
            return self._write(record, output_ids, draft_revision)

    def _write(self, record: RequestRecord, output_ids: list[int], draft_revision: str | None) -> Path | None:
        t0 = time.perf_counter()
        prompt, n_out, prefill_taps = record.prompt_ids, len(output_ids), record.prefill_taps
        body = len(prompt) - 1
        if prefill_taps is None and body == 0 and record.taps:  # a one-token prompt: nothing was prefilled
            prefill_taps = record.taps[0][:0]
        if (not record.complete or n_out == 0 or prefill_taps is None or prefill_taps.shape[0] != body
                or sum(int(t.shape[0]) for t in record.taps) != n_out):
            self.rows_skipped += 1
            return None
        width = int(prefill_taps.shape[1])
        taps = torch.cat([prefill_taps.float().cpu(), *record.taps, torch.zeros(1, width)])  # [T, W]
        total = len(prompt) + n_out
        ids = torch.tensor(prompt + list(output_ids), dtype=torch.int32)
        mask = torch.zeros(total, dtype=torch.int8)
        mask[len(prompt):] = 1
        tensors = {"input_ids": ids, "loss_mask": mask, "offsets": torch.tensor([0, total], dtype=torch.int64),
                   **encode_hidden(taps, self.spec.storage, "taps", self.hidden_size),
                   "teacher_topk_ids": torch.cat(record.teacher_ids).to(topk_id_dtype(self.vocab_size)),
                   "teacher_topk_logprobs": torch.cat(record.teacher_logprobs).to(torch.float16),
                   **self._feedback(record, total)}
        index = self.next_index
        self.next_index += 1
        row_id = f"traffic/{index:09d}"
        meta = {"format": FEATURES_FORMAT, "shard": index, "ids": [row_id], "draft_revision": draft_revision,
                "temperature": record.temperature, "recorded": time.time()}
        path = self.spec.directory / ROW_PATTERN.format(index)
        digest, size = write_shard(path, tensors, meta)
        self.entries.append(_entry(path, total, n_out, size, digest, index, draft_revision))
        self.unlisted += 1
        dropped = self._rotate()
        if dropped or self.unlisted * 100 >= len(self.entries) or time.monotonic() - self.listed_at >= \
                MANIFEST_EVERY_S:
            self._list_rows()
        for entry in dropped:  # gone from the manifest first: a reader never meets a listed, missing row
            (self.spec.directory / entry["file"]).unlink(missing_ok=True)
        self.rows_written += 1
        self.seconds += time.perf_counter() - t0
        return path

    @staticmethod
    def _feedback(record: RequestRecord, total: int) -> dict[str, torch.Tensor]:
        start, depth, accepted = (torch.zeros(total, dtype=torch.int8) for _ in range(3))
        for root, drafted, took in record.cycles:
            start[root], depth[root], accepted[root] = 1, min(drafted, 127), min(took, 127)
        nodes = torch.tensor(record.nodes, dtype=torch.int32).reshape(-1, len(NODE_COLUMNS))  # [K, 5]
        return {"cycle_start": start, "draft_depth": depth, "draft_accepted": accepted, "draft_nodes": nodes}

    def _rotate(self) -> list[dict]:
        """Drop the oldest rows until the recording fits its budget (the newest row always stays)."""
        dropped = []
        while len(self.entries) > 1 and sum(int(e["bytes"]) for e in self.entries) > self.spec.budget_bytes:
            dropped.append(self.entries.pop(0))
        return dropped

    def flush(self) -> None:
        """List every row written so far in `manifest.json` (atomically)."""
        with self.lock:
            self._list_rows()

    def _list_rows(self) -> None:
        self._write_manifest()
        self.unlisted, self.listed_at = 0, time.monotonic()

    def _write_manifest(self) -> None:
        tokens = sum(int(e["tokens"]) for e in self.entries)
        masked = sum(int(e["masked"]) for e in self.entries)
        size = sum(int(e["bytes"]) for e in self.entries)
        manifest: dict[str, Any] = {
            "format": FEATURES_FORMAT, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "target": self.target, "family": None, "layer_ids": self.layer_ids, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "stored": ["taps"],
            "storage": self.spec.storage, "group_size": group_size_for(self.hidden_size), "teacher": "topk",
            "teacher_topk": self.spec.teacher_topk,
            "recording": {"kind": RECORDING_KIND, "budget_bytes": self.spec.budget_bytes,
                          "node_columns": list(NODE_COLUMNS),
                          "draft_revisions": sorted({str(e.get("draft_revision")) for e in self.entries})},
            "counts": {"sequences": len(self.entries), "tokens": tokens, "masked_tokens": masked,
                       "masked_share": round(masked / tokens, 4) if tokens else 0.0, "shards": len(self.entries)},
            "storage_report": {"shard_bytes": size, "bytes_per_token": round(size / tokens, 2) if tokens else 0.0,
                               "bytes_per_1000_generated_tokens": round(1000 * size / masked) if masked else 0},
            "shards": self.entries,
        }
        write_json_atomic(self.spec.directory / "manifest.json", manifest)

    def report(self) -> dict:
        size = sum(int(e["bytes"]) for e in self.entries)
        return {"directory": str(self.spec.directory), "rows": len(self.entries), "rows_written": self.rows_written,
                "rows_skipped": self.rows_skipped, "bytes": size, "write_seconds": round(self.seconds, 3)}
