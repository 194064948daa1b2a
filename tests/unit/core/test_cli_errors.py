"""The CLI turns user errors into one line and a non-zero exit, without a traceback. The first case runs the console
entry point in a process; the others `speculators.cli.main` in this one (tests/integration/cli_helpers.py
`cli_here`: the same exit status and output, without importing torch and transformers anew for each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import load_recipe
from speculators.pipeline import run_pipeline
from tests.integration.cli_helpers import cli_here

REPO = Path(__file__).resolve().parents[3]


def _process(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speculators.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return cli_here(*args, cwd=REPO)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def test_recipe_key_typo(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\ntrain:\n  bach_size: 4\n")
    line = _one_error_line(_process("train", str(recipe)))
    assert "train.bach_size" in line and "train.batch_size" in line


def test_override_typo() -> None:
    line = _one_error_line(_cli("run", "recipes/house-eagle3.yaml", "speculatr.family=medusa", "--dry-run"))
    assert "speculatr" in line and "speculator" in line


def test_unknown_family_is_checked_against_the_registry() -> None:
    """The recipe's family is a folder under speculators/models/: the CLI and run_pipeline say so in one line."""
    line = _one_error_line(_cli("run", "recipes/house-eagle3.yaml", "speculator.family=eagle", "--dry-run"))
    assert "unknown speculator family 'eagle' (speculator.family); known: eagle3, medusa, mtp, dflash" in line
    recipe = load_recipe(None, ["speculator.family=eagle"])
    with pytest.raises(SpeculatorsError, match=r"^unknown speculator family 'eagle' \(speculator.family\); known:"):
        run_pipeline(recipe, log=lambda _: None)


def test_missing_recipe() -> None:
    line = _one_error_line(_cli("prepare", "recipes/does-not-exist.yaml"))
    assert "recipe not found" in line


def test_dry_run_prints_resolved_recipe() -> None:
    proc = _cli("run", "recipes/house-eagle3.yaml", "train.lr=0.5", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "lr: 0.5" in proc.stdout


def test_missing_target_path(tmp_path: Path) -> None:
    proc = _cli("generate", "--target", str(tmp_path / "nope"), "--prompt", "def f(")
    line = _one_error_line(proc)
    assert "target not found" in line and "nope" in line


def test_corrupt_target_config(tmp_path: Path) -> None:
    bad = tmp_path / "target"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    line = _one_error_line(_cli("generate", "--target", str(bad), "--prompt", "def f("))
    assert "config.json" in line and "not valid JSON" in line


def test_unreadable_workload_file(tmp_path: Path) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    line = _one_error_line(_cli("generate", "--workload", str(bad)))
    assert str(bad) in line


def test_negative_thread_count() -> None:
    line = _one_error_line(_cli("generate", "--prompt", "x", "--threads", "-1"))
    assert "--threads" in line
