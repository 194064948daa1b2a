"""The vllm-check stage's T > 0 plumbing without a vLLM: which drafting it predicts for the export's launch.sh
(`sampled_drafting`), the section it renders, and the repair's probe answer on a Python without vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from speculators.errors import SpeculatorsError
from speculators.evaluate.chain_prediction import sampled_agreement
from speculators.export import vllm_check
from speculators.export.vllm_consumer import CPU_SAMPLING_FIX, expand_kernel_check, is_vllm_cpu, sampling_env
from speculators.metrics import ChainCounts


def _export(tmp_path: Path, use_block: bool | None, launch_text: str, use_sampled: bool = False) -> Path:
    export = tmp_path / "export"
    export.mkdir(exist_ok=True)
    block = None if use_block is None else {"use": use_block}
    (export / "report.json").write_text(json.dumps({"launch": {"k": 3, "block": block,
                                                               "drafts": {"use": use_sampled}}}))
    (export / "launch.sh").write_text(launch_text)
    return export


def test_drafting_follows_what_launch_sh_asks_this_vllm_for(tmp_path: Path) -> None:
    python = Path(sys.executable)  # not vllm-cpu: a GPU vLLM's V2 runner honours "block"
    assert not is_vllm_cpu(python)
    assert vllm_check.sampled_drafting(_export(tmp_path, None, "VLLM_CPU"), {}, python) == "argmax"
    assert vllm_check.sampled_drafting(_export(tmp_path, False, "VLLM_CPU"), {}, python) == "argmax"
    assert vllm_check.sampled_drafting(_export(tmp_path, True, "VLLM_CPU"), {}, python) == "block"
    assert vllm_check.sampled_drafting(_export(tmp_path, True, "VLLM_CPU"), {"BLOCK": "0"}, python) == "argmax"
    sampled = _export(tmp_path, False, "SAMPLED_DRAFTS", use_sampled=True)
    assert vllm_check.sampled_drafting(sampled, {}, python) == "sampled"
    assert vllm_check.sampled_drafting(sampled, {"SAMPLED_DRAFTS": "0"}, python) == "argmax"
    assert vllm_check.sampled_drafting(_export(tmp_path, False, "old", use_sampled=True), {}, python) == "argmax"


def test_the_sampled_section_renders_agreement_and_skips(tmp_path: Path) -> None:
    rows = [ChainCounts(k=2, drafts=10, draft_tokens=20, accepted=[6, 3]),
            ChainCounts(k=2, drafts=12, draft_tokens=24, accepted=[5, 2])]
    base = {"k": 2, "vllm": "vllm-cpu 0.32.0", "comparison": {"all": {"predicted": rows[0].to_dict()}},
            "lossless": {"rows": 2, "identical_rows": 2, "equal_to_ours_fp32": 2, "runtime_equal_to_ours_fp32": 2}}
    sampled = {"temperature": 1.0, "drafting": "sampled", "vllm_env": "as installed",
               "comparison": {"all": {"predicted": rows[0].to_dict(), "vllm": rows[1].to_dict()}},
               "agreement": sampled_agreement(rows, rows[::-1])}
    text = vllm_check.render({**base, "sampled": sampled})
    assert "At T = 1 (sampled; vLLM draws the drafts from the draft law" in text and "as installed." in text
    assert "Predicted vs vLLM at T = 1" in text
    skipped = vllm_check.render({**base, "sampled": {"temperature": 1.0, "drafting": "block",
                                                     "skipped": vllm_check.SKIPPED_BLOCK}})
    assert "At T = 1: launch.sh asks this vLLM for block verification" in skipped


def test_the_expand_probe_names_a_python_without_vllm() -> None:
    """The probe's failure is one clear error; for the stage it means "measured as installed", not a failed stage
    (a GPU vLLM, say, whose kernels the probe cannot reach)."""
    assert (CPU_SAMPLING_FIX / "sitecustomize.py").is_file()
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(SpeculatorsError, match="could not run vLLM's expand_batch_to_tokens"):
        expand_kernel_check(Path(sys.executable), env)
    chosen, note = sampling_env(Path(sys.executable), env)
    assert chosen == env and note.startswith("measured as installed (could not run")
