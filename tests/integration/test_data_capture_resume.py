"""Resume: `speculators capture` killed (SIGKILL) after its first shard is complete, then re-run, produces shards
byte-identical to an uninterrupted run, and reuses the shards written before the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from speculators.core.recipes import load_recipe
from speculators.data import capture, prepare
from tests.conftest import make_tiny_target

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl"
CLI = Path(sys.executable).parent / "speculators"


@pytest.mark.integration
def test_killed_capture_resumes_to_identical_shards(tmp_path):
    target = make_tiny_target(tmp_path / "target", "qwen3")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(CHAT.read_text().splitlines()[40:64]) + "\n")

    def write_recipe(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "name": name, "run_dir": str(tmp_path / name), "target": {"name_or_path": str(target)},
            "data": {"sources": [{"path": str(rows)}], "max_length": 256},
            "capture": {"shard_tokens": 200, "batch_size": 2},
            "speculator": {"family": "eagle3", "draft_vocab_size": 128},
            "evaluate": {"workloads": [str(REPO / "data" / "workloads" / "short-output.jsonl")]}}))
        return path

    ref, killed = load_recipe(write_recipe("ref")), load_recipe(write_recipe("killed"))
    prepare.run(ref)
    prepare.run(killed)
    capture.run(ref)
    ref_manifest = json.loads((ref.paths.features / "manifest.json").read_text())
    n_shards = len(ref_manifest["shards"])
    assert n_shards >= 8

    partial = killed.paths.features.with_name("features.partial")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(CLI), "capture", str(tmp_path / "killed.yaml")], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (partial / "shard-00000.json").is_file():
        assert proc.poll() is None, "capture ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sorted(p.name for p in partial.glob("shard-*.json"))
    assert 1 <= len(done_before) < n_shards and not killed.paths.features.exists()

    out = subprocess.run([str(CLI), "capture", str(tmp_path / "killed.yaml")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    m = json.loads((killed.paths.features / "manifest.json").read_text())
    assert m["throughput"]["shards_reused"] >= len(done_before)
    assert m["throughput"]["shards_written"] == n_shards - m["throughput"]["shards_reused"]
    for rec in ref_manifest["shards"]:
        assert (killed.paths.features / rec["file"]).read_bytes() == (ref.paths.features / rec["file"]).read_bytes()
    for name in ("token_freq.safetensors", "vocab-128.safetensors"):
        assert (killed.paths.features / name).read_bytes() == (ref.paths.features / name).read_bytes()
    assert not partial.exists()
