"""scripts/gpu_check.sh in its CPU mode (`--cpu`): the GPU checks (tests/gpu on the CPU, small), `speculators
bench` and `speculators profile` of a small shape (random heads of every family, DFlash included), end to end, so
the script the device runs cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.cli_helpers import REPO_ENV

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_gpu_check_script_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=900,
                          env={**REPO_ENV, "OUT": str(out), "PYTHON": sys.executable})
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "gpu-check.log", "profile-tiny-llama.json",
                                                     "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "# gpu_check (cpu)" in summary and "every step passed" in summary
    assert "passed: test_greedy_parity_with_hf[ngram-dynamic-bfloat16]" in summary
    assert "passed: test_first_two_tokens_follow_the_target[0-float32]" in summary and "FAILED" not in summary
    assert "# speculators bench" in summary and "# speculators profile — shape:tiny-llama" in summary
    profile = json.loads((out / "profile-tiny-llama.json").read_text())
    assert set(profile["predictions"]) == {"eagle3", "medusa", "mtp", "dflash"}
    assert profile["schedule"]["eagle3"]["vllm"] and profile["schedule"]["dflash"]["vllm"]
    assert "== profile-dflash: skipped (no DFLASH" in proc.stdout  # the DFlash export step needs a trained export
    assert json.loads((out / "bench.json").read_text())["results"]["0.0"]["all"]["plain"]["tokens"] > 0


def test_gpu_check_script_refuses_a_machine_without_cuda(tmp_path) -> None:
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**REPO_ENV, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
                               "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stdout + proc.stderr  # the log has both
