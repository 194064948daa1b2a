"""Two CPU processes (accelerate, gloo) capture exactly what one process captures: the same shard plan, the same
bytes in every shard (hence the same tokens and tensors), the same token frequencies and draft vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators.core.recipes import recipe_from_dict
from speculators.data import capture, prepare
from speculators.data.shards import FeatureStore

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl"


def _recipe(run_dir: Path, target: Path, rows: Path, processes: int):
    return recipe_from_dict({
        "name": "dist", "run_dir": str(run_dir), "target": {"name_or_path": str(target)},
        "data": {"sources": [{"path": str(rows)}], "max_length": 192},
        "capture": {"shard_tokens": 300, "batch_size": 3, "num_processes": processes},
        "speculator": {"family": "eagle3", "draft_vocab_size": 128},
        "evaluate": {"workloads": [str(REPO / "data" / "workloads" / "*.jsonl")], "max_rows_per_cohort": 1}})


@pytest.mark.distributed
def test_two_cpu_processes_capture_the_same_data_as_one(tmp_path, tiny_llama):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(CHAT.read_text().splitlines()[20:32]) + "\n")
    one = _recipe(tmp_path / "one", tiny_llama, rows, 1)
    two = _recipe(tmp_path / "two", tiny_llama, rows, 2)
    prepare.run(one)
    prepare.run(two)
    capture.run(one)
    s2 = capture.run(two)
    m1 = json.loads((one.paths.features / "manifest.json").read_text())
    m2 = json.loads((two.paths.features / "manifest.json").read_text())
    assert m2["throughput"]["processes"] == 2 and len(m1["shards"]) >= 3 and s2["shards"] == len(m1["shards"])
    assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m2["shards"]]
    for rec in m1["shards"]:
        assert (one.paths.features / rec["file"]).read_bytes() == (two.paths.features / rec["file"]).read_bytes()
    for name in ("token_freq.safetensors", "vocab-128.safetensors"):
        assert (one.paths.features / name).read_bytes() == (two.paths.features / name).read_bytes()
    a, b = FeatureStore(one.paths.features), FeatureStore(two.paths.features)
    assert len(a) == len(b) == m1["counts"]["sequences"]
    for i in range(len(a)):
        x, y = a.sequence(i), b.sequence(i)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert not (two.paths.features.with_name("features.partial")).exists()
