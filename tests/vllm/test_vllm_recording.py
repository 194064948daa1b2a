"""A vLLM deployment feeds the learn-from-traffic loop: `speculators record-vllm` (the real CLI) serves the house
target with a recording vLLM replica; every request it serves becomes a row equal to a Hugging Face capture of the
same tokens (taps within int8 noise, the same teacher), its T = 0 answers are the target's own greedy ones, SIGTERM
records what finished and exits cleanly, and `speculators adapt` trains and gates a revision on the recording."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from speculators.core.config import TargetConfig
from speculators.core.target import load_target
from speculators.core.workloads import load_workloads
from speculators.data.shards import FeatureStore
from speculators.evaluate.teacher import encode_row, greedy_tokens
from speculators.export.vllm_consumer import complete_ids, served_model
from tests.conftest import HOUSE_TARGET
from tests.unit.runtime.test_recording import assert_row_equals_capture
from tests.vllm.fixtures import CLI, REPO, cli, free_port

pytestmark = pytest.mark.vllm

LAYERS = [2, 4, 7]  # the shipped house EAGLE-3's taps (recipes/house-eagle3-adapt.yaml)
MAX_TOKENS = 24


def _wait_for(what, predicate, proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"record-vllm exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.25)


def _rows_listed(rec: Path) -> int:
    try:
        return int(json.loads((rec / "manifest.json").read_text())["counts"]["sequences"])
    except (OSError, ValueError, KeyError):
        return 0


def test_record_vllm_rows_equal_a_capture_and_feed_adapt(vllm_python: Path, tmp_path: Path) -> None:
    rec, port, out = tmp_path / "traffic", free_port(), tmp_path / "record-vllm.out"
    loaded = load_target(TargetConfig(name_or_path=str(HOUSE_TARGET), dtype="float32"), device="cpu")
    rows = [r for r in load_workloads(str(REPO / "data" / "workloads" / "*.jsonl")) if r.cohort == "prose"][:6]
    prompts = [encode_row(loaded.tokenizer, r) for r in rows]
    env = {**os.environ, "SPECULATORS_VLLM_PYTHON": str(vllm_python), "OMP_NUM_THREADS": "1"}
    with out.open("w") as fh:
        proc = subprocess.Popen([str(CLI), "record-vllm", str(HOUSE_TARGET), "--record", str(rec), "--port", str(port),
                                 "--layers", ",".join(map(str, LAYERS)), "--dtype", "float32", "--threads", "1",
                                 "--max-model-len", "1024"], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        _wait_for("the replica's start", lambda: "recording vLLM replica" in out.read_text(), proc, out)
        url = f"http://127.0.0.1:{port}"
        model = served_model(url)
        served = [complete_ids(url, model, p, MAX_TOKENS) for p in prompts]  # T = 0
        sampled = complete_ids(url, model, prompts[0], MAX_TOKENS, temperature=1.0, seed=3)
        _wait_for("every request recorded", lambda: _rows_listed(rec) == len(prompts) + 1, proc, out, 120)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    log = out.read_text()
    assert code == 0, log[-3000:]
    assert "rows_written" in log and "error" not in log.lower(), log[-3000:]

    for p, o in zip(prompts, served, strict=True):  # the replica serves the target's own tokens
        assert o == greedy_tokens(loaded.model, p, len(o)), "the recording replica changed a T = 0 answer"
    store = FeatureStore(rec)
    assert store.manifest["recording"]["kind"] == "traffic" and store.manifest["layer_ids"] == LAYERS
    for i, (p, o) in enumerate(zip([*prompts, prompts[0]], [*served, sampled], strict=True)):
        row = store.sequence(i)
        assert row["input_ids"].tolist() == p + o, f"row {i} holds other tokens than the request served"
        assert row["loss_mask"].tolist() == [0] * len(p) + [1] * len(o)
        assert int(store.token_tensor(i, "cycle_start").sum()) == 0, "a plain replica drafts no cycle"
        assert_row_equals_capture(store, i, loaded.model, LAYERS)
    assert not list((rec / ".vllm-spool").glob("*")), "spool files left behind"

    run = tmp_path / "adapt"  # the same loop as a speculators server's recording: traffic stage, training, gate
    cli("adapt", "recipes/house-eagle3-adapt.yaml", f"run_dir={run}", f"data.sources.0.traffic={rec}",
        "train.max_steps=4", "--margin", "-100")
    report = json.loads((run / "adapt-report.json").read_text())
    assert report["adopt"] and report["rows"] >= 1 and report["swap"] is None
