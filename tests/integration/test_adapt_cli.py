"""The learn-from-traffic loop on the house target, through the real CLI: `speculators serve --record` (a real HTTP
server drafting with the shipped EAGLE-3 revision) records served requests; `speculators adapt` trains a new revision
on them, gates it on the held-back rows and swaps it into the running server, whose T = 0 answers stay the target's
own; a gate that asks for more than the revision gained keeps the running one."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from speculators.core.workloads import load_workloads
from tests.conftest import REPO
from tests.integration.cli_helpers import cli, cli_here, error_line, serve_process

pytestmark = pytest.mark.integration

SHIPPED = REPO / "data" / "speculators" / "stdlib-lm-eagle3"


def _prompts(n: int) -> list[str]:
    rows = [r for r in load_workloads(str(REPO / "data" / "workloads" / "*.jsonl")) if r.cohort == "prose"]
    return [r.messages[-1]["content"] if r.messages else r.prompt for r in rows[:n]]


def _complete(base: str, prompt: str) -> str:
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 32, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serve_record_adapt_and_swap(house_target, tmp_path) -> None:
    rec = tmp_path / "traffic"
    prompts = _prompts(10)
    with serve_process("--target", str(house_target), "--speculator", str(SHIPPED), "--record", str(rec),
                       "--device", "cpu", "--threads", "1") as (base, _):
        before = [_complete(base, p) for p in prompts]
        manifest = json.loads((rec / "manifest.json").read_text())
        assert manifest["counts"]["sequences"] == len(prompts) and manifest["recording"]["kind"] == "traffic"
        run = tmp_path / "adapt"
        common = ["recipes/house-eagle3-adapt.yaml", f"run_dir={run}", f"data.sources.0.traffic={rec}",
                  "train.max_steps=6", "--server", base]
        kept = cli("adapt", *common, "--margin", "100")  # more than any revision can gain: never adopted
        assert kept.returncode == 0, kept.stderr[-3000:]
        report = json.loads((run / "adapt-report.json").read_text())
        assert not report["adopt"] and report["swap"] is None and report["rows"] == 2
        assert httpx.get(base + "/admin/draft-revision", timeout=30).json()["swaps"] == 0
        adopted = cli("adapt", *common, "--margin", "-100")  # anything is adopted: the swap path end to end
        assert adopted.returncode == 0, adopted.stderr[-3000:]
        report = json.loads((run / "adapt-report.json").read_text())
        assert report["adopt"] and report["swap"]["staged"] == report["revision_candidate"]
        after = [_complete(base, p) for p in prompts]
        state = httpx.get(base + "/admin/draft-revision", timeout=30).json()
        metrics = httpx.get(base + "/metrics", timeout=30).text
    assert after == before, "the swap changed what the server answers at T = 0"
    assert state["running"] == report["revision_candidate"] and state["swaps"] == 1
    assert state["previous"] == report["revision_running"]
    assert f'speculators_revision_target_calls{{revision="{report["revision_candidate"]}"}}' in metrics
    bad = cli("adapt", "recipes/house-eagle3-adapt.yaml", f"run_dir={tmp_path / 'x'}",
              f"data.sources.0.traffic={rec}", "data.traffic.held_back=0")
    assert "held_back" in error_line(bad)


def test_record_vllm_refuses_bad_input_in_one_line_before_starting_vllm(house_target, tmp_path) -> None:
    """(The recording itself is served by the real vLLM in tests/vllm/test_vllm_recording.py.)"""
    env = {"SPECULATORS_VLLM_PYTHON": sys.executable}  # found, never started: every refusal comes first
    missing = cli("record-vllm", str(tmp_path / "nowhere"), "--record", str(tmp_path / "r0"), env=env)
    assert "local target directory" in error_line(missing)
    bad_layers = cli_here("record-vllm", str(house_target), "--record", str(tmp_path / "r1"), "--layers", "2,99", env=env)
    assert "99" in error_line(bad_layers)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    manifest = {"format": "speculators.features/v1", "recording": {"kind": "traffic"}, "layer_ids": [2, 4, 5],
                "target": {"name_or_path": "another", "revision": "r9", "content_hash": "0" * 64}, "shards": []}
    (theirs / "manifest.json").write_text(json.dumps(manifest))
    other = cli_here("record-vllm", str(house_target), "--record", str(theirs), env=env)
    assert "another@r9" in error_line(other)
    assert json.loads((theirs / "manifest.json").read_text()) == manifest
    assert sorted(p.name for p in theirs.iterdir()) == ["manifest.json"], "something was written beside it"
