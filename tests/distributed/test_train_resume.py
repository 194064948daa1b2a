"""Exact resume: SIGKILL `speculators train` after a checkpoint is written, resume, and the resumed run's per-step
losses equal an uninterrupted run's exactly (model, optimizer, schedule, data position and RNG all restored)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.unit.train.train_helpers import (
    SPECULATORS_BIN,
    cli_env,
    losses,
    prepare,
    recipe_dict,
    run_cli,
    write_recipe,
    write_rows,
)

pytestmark = pytest.mark.distributed

TOTAL = 24


def _recipe(run_dir: Path, target: Path, rows: Path) -> dict:
    return recipe_dict(run_dir, target, rows, train={"max_steps": TOTAL, "grad_accum": 2, "batch_size": 2,
                                                     "save_every": 4, "eval_every": 4, "keep_last": 2,
                                                     "log_every": 1})


def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path: Path, tiny_llama: Path) -> None:
    rows = write_rows(tmp_path / "rows.jsonl", 40)
    a = _recipe(tmp_path / "a", tiny_llama, rows)
    b = _recipe(tmp_path / "b", tiny_llama, rows)
    prepare(a)
    shutil.copytree(tmp_path / "a" / "prepared", tmp_path / "b" / "prepared")
    ra, rb = write_recipe(tmp_path / "a.yaml", a), write_recipe(tmp_path / "b.yaml", b)

    done = run_cli(["train", str(ra)], timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = losses(tmp_path / "a")
    assert sorted(reference) == list(range(1, TOTAL + 1))

    # start run b, kill it (SIGKILL, no cleanup) as soon as its first checkpoint exists
    latest = tmp_path / "b" / "checkpoints" / "latest"
    proc = subprocess.Popen([str(SPECULATORS_BIN), "train", str(rb)], env=cli_env(1), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not latest.is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert latest.is_file(), "run b wrote no checkpoint"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert 0 < killed_at < TOTAL
    assert not (tmp_path / "b" / "checkpoints" / "train-summary.json").exists()

    resumed = run_cli(["train", str(rb)], timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((tmp_path / "b" / "checkpoints" / "train-summary.json").read_text())
    assert summary["resumed_from_step"] >= killed_at and summary["steps"] == TOTAL
    got = losses(tmp_path / "b")
    assert sorted(got) == list(range(1, TOTAL + 1))  # the crashed run's tail was dropped, no duplicates
    after = [s for s in range(1, TOTAL + 1) if s > summary["resumed_from_step"]]
    assert after, "nothing was trained after the resume"
    assert [got[s] for s in after] == [reference[s] for s in after]  # exactly equal, not approximately
    # the two runs end with identical weights (tensor by tensor: safetensors' header order is not deterministic)
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "checkpoints" / f"step-{TOTAL:07d}" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoints" / f"step-{TOTAL:07d}" / "model.safetensors"))
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    # no partial checkpoint dirs survive, keep-last-N holds (plus best)
    names = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert not [n for n in names if n.startswith(".")]
    assert len([n for n in names if n.startswith("step-")]) <= 3
