"""scripts/draft_vocab_coverage.py: the share of the target's held-out tokens inside each draft vocabulary size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from speculators.data import vocab
from speculators.evaluate.teacher import CONTINUATIONS_FORMAT

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "draft_vocab_coverage.py"


def test_coverage_counts_the_target_tokens_inside_each_vocabulary(tmp_path):
    freq = torch.zeros(100, dtype=torch.long)
    freq[[10, 11, 12, 13]] = torch.tensor([40, 30, 20, 10])  # a 2-token vocabulary holds 10 and 11
    vocab.save_token_freq(tmp_path / "features", freq, always_include_ids=[])
    (tmp_path / "eval").mkdir()
    sequences = {"0.0:a": [10, 10, 11, 12], "0.0:b": [13], "1.0:a": [50, 10]}
    (tmp_path / "eval" / "continuations.json").write_text(json.dumps({"format": CONTINUATIONS_FORMAT, "sequences": sequences}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--sizes", "2,4"], capture_output=True,
                         text=True, check=True).stdout
    assert "| T = 0.0 | 5 | 0.600 | 1.000 |" in out  # 3 of 5 tokens in {10, 11}; all 5 in {10..13}
    assert "| T = 1.0 | 2 | 0.500 | 0.500 |" in out  # 50 was never seen in training


def test_a_run_without_a_capture_is_one_error_line(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert res.returncode != 0 and res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
