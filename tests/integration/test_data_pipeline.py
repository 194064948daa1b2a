"""The data stages through the real CLI (subprocess): prepare -> regenerate -> capture (+ draft vocabulary) on the
house target with a handful of stdlib-chat rows, each stage printing its one-screen summary; and bad input
(malformed rows, empty assistant turns, no chat template, out-of-range layer ids) fails in one `error:` line with
exit status 2, leaving earlier outputs intact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import HOUSE_TARGET
from tests.integration.cli_helpers import cli_here

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl"
CLI = Path(sys.executable).parent / "speculators"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("data-pipeline")
    target = HOUSE_TARGET
    rows = root / "rows.jsonl"
    rows.write_text("\n".join(CHAT.read_text().splitlines()[:6]) + "\n")
    recipe = {
        "name": "data-it", "run_dir": str(root / "run"), "target": {"name_or_path": str(target)},
        "data": {"sources": [{"path": str(rows)}], "max_length": 256,
                 "regenerate": {"enabled": True, "max_new_tokens": 16, "batch_size": 3}},
        "capture": {"shard_tokens": 400, "batch_size": 3},
        "speculator": {"family": "eagle3", "draft_vocab_size": 256},
        "evaluate": {"workloads": [str(REPO / "data" / "workloads" / "*.jsonl")], "max_rows_per_cohort": 2},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path, target


@pytest.mark.integration
def test_prepare_regenerate_capture_through_the_cli(setup):
    root, recipe, _ = setup
    run = root / "run"
    p = _cli("prepare", str(recipe))
    assert p.returncode == 0, p.stderr
    assert "masked_share" in p.stdout and "rows" in p.stdout
    g = _cli("regenerate", str(recipe))
    assert g.returncode == 0, g.stderr
    assert "turns_regenerated" in g.stdout and "tokens_per_s" in g.stdout
    assert "tok/s" in g.stderr and "last request" in g.stderr, g.stderr[-2000:]  # the live progress line
    c = _cli("capture", str(recipe))
    assert c.returncode == 0, c.stderr
    assert "bytes_per_token" in c.stdout and "tokens_per_s" in c.stdout and "vs_8H_reference" in c.stdout
    m = json.loads((run / "features" / "manifest.json").read_text())
    regen = json.loads((run / "regenerated" / "manifest.json").read_text())
    assert m["data_dir"] == str(run / "regenerated") and m["data_stage"] == "regenerate"
    assert m["counts"]["sequences"] == regen["counts"]["rows"] == 6
    assert m["layer_ids"] == [2, 4, 5] and m["storage"] == "int8" and m["teacher"] == "topk"
    assert m["storage_report"]["bytes_per_token"] <= 0.5 * 8 * 256  # <= half the EAGLE/SpecForge layout (8H)
    assert m["target"]["name_or_path"] == str(HOUSE_TARGET) and m["hidden_size"] == 256
    assert (run / "features" / "vocab-256.safetensors").is_file()
    # a second run of every stage is a no-op
    again = _cli("capture", str(recipe))
    assert again.returncode == 0 and "complete (skipped)" in again.stdout


@pytest.mark.integration
def test_bad_inputs_fail_in_one_line_and_keep_outputs(setup):
    root, recipe, target = setup
    run = root / "run"
    if not (run / "features" / "manifest.json").is_file():
        assert _cli("prepare", str(recipe)).returncode == 0
        assert _cli("capture", str(recipe), "data.regenerate.enabled=false").returncode == 0
    snapshot = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}

    def fails(proc: subprocess.CompletedProcess, pattern: str) -> None:
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and pattern in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr

    regen = [] if (run / "regenerated" / "manifest.json").is_file() else ["data.regenerate.enabled=false"]
    fails(_cli("capture", str(recipe), "capture.layer_ids=[2,40]", *regen), "out of range for a target with 8")

    bad_rows = root / "bad.jsonl"
    bad_rows.write_text(CHAT.read_text().splitlines()[0] + "\n" + json.dumps(
        {"id": "broken-7", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]})
        + "\n")
    fails(cli_here("prepare", str(recipe), f"data.sources=[{{path: {bad_rows}}}]", cwd=REPO), "'broken-7'")
    bad_rows.write_text('{"id": "x1", "messages": [{"role": "user"}]}\n')
    fails(cli_here("prepare", str(recipe), f"data.sources=[{{path: {bad_rows}}}]", cwd=REPO), "'x1'")

    bare = root / "no-template"
    if not bare.exists():
        shutil.copytree(target, bare)
        (bare / "chat_template.jinja").unlink()
    fails(cli_here("prepare", str(recipe), f"target.name_or_path={bare}", cwd=REPO), "no chat template")
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == snapshot
