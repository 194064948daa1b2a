"""Evaluation of a target the bundled runtime refuses: continuations by HF `generate`, no live columns, the reason
said once in the log and in one line of the reports; teacher-forced acceptance and the checkpoint choice as before.

The target is a tiny random Qwen3-Next (`qwen3_next`, house tokenizer): six of its eight decoder layers are gated
delta-net linear attention (a recurrent state, no `self_attn` module) — a state that a tree-masked verification
forward over a static KV cache cannot handle, so the runtime's refusal of it is real and permanent, not a gap of
today's runtime. Hugging Face runs it (torch fallbacks of the linear-attention kernels), and so do the tap /
last-hidden capture and EAGLE-3's construction from its config: no monkeypatching of the refusal is needed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from evalexport_helpers import make_recipe, make_run, small_workloads

from speculators.core.checkpoints import read_pointer
from speculators.core.errors import SpeculatorsError, UnsupportedTargetError
from speculators.core.target import load_target
from speculators.core.workloads import load_workloads
from speculators.evaluate import evaluate as acceptance
from speculators.evaluate.teacher import continuations, encode_row, teacher_pass
from speculators.runtime.forward import support as runtime_support
from speculators.runtime.forward.module_runner import make_runner

torch.set_num_threads(1)


def _runner_refusal(model: torch.nn.Module) -> str:
    with pytest.raises(UnsupportedTargetError) as err:
        make_runner(model)
    return str(err.value)


def _count_runners(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the runners `runtime_support` builds (each still the real runner)."""
    built: list[int] = []

    def counting(*args: object, **kwargs: object) -> object:
        built.append(1)
        return make_runner(*args, **kwargs)

    monkeypatch.setattr(runtime_support, "make_runner", counting)
    return built


def _hf_greedy(loaded: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy continuation straight from HF `generate` (its own generation config's EOS ids)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, temperature=None, top_k=None, top_p=None)
    return out[0, len(prompt):].tolist()


def test_the_refusal_is_the_runners_message_asked_once_and_a_supported_target_has_none(
        tmp_path: Path, tiny_qwen3_next: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_target(make_recipe(tmp_path, tiny_qwen3_next, "eagle3").target)
    reason = _runner_refusal(loaded.model)
    assert "qwen3_next" in reason  # the runner's line names the model type
    built = _count_runners(monkeypatch)
    assert runtime_support.runtime_refusal(loaded) == reason
    assert runtime_support.runtime_refusal(loaded) == reason
    assert built == [1]  # asked twice, built once
    llama = load_target(make_recipe(tmp_path, tiny_llama, "eagle3").target)
    assert runtime_support.runtime_refusal(llama) is None and built == [1, 1]


@pytest.mark.parametrize("error", [SpeculatorsError("a broken checkpoint"), RuntimeError("a bug")])
def test_only_unsupported_target_errors_are_an_answer(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def failing(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(runtime_support, "make_runner", failing)
    with pytest.raises(type(error), match=str(error)):
        runtime_support.runtime_refusal(SimpleNamespace(model=torch.nn.Linear(2, 2)))


def test_taps_and_last_hidden_of_a_linear_attention_target_are_hfs_hidden_states(tmp_path: Path,
                                                                                 tiny_qwen3_next: Path) -> None:
    loaded = load_target(make_recipe(tmp_path, tiny_qwen3_next, "eagle3").target)
    ids = list(range(100, 120))
    tp = teacher_pass(loaded.model, ids, [2, 4, 5])  # layer 2 is gated delta-net, layer 3 full attention
    with torch.no_grad():
        hf = loaded.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    want = torch.cat([hf.hidden_states[i][0] for i in (2, 4, 5)], dim=-1)
    torch.testing.assert_close(tp.taps, want)
    torch.testing.assert_close(tp.last_hidden, hf.hidden_states[-1][0])
    torch.testing.assert_close(tp.logits, hf.logits[0])


def test_engine_continuations_fall_back_to_hf_generate_with_one_log_line(
        tmp_path: Path, tiny_qwen3_next: Path, caplog: pytest.LogCaptureFixture) -> None:
    recipe = make_recipe(tmp_path, tiny_qwen3_next, "eagle3",
                         workloads=small_workloads(tmp_path / "rows.jsonl", max_new_tokens=10))
    loaded = load_target(recipe.target)
    reason = _runner_refusal(loaded.model)
    rows = load_workloads(recipe.evaluate.workloads)
    cache = tmp_path / "continuations.json"
    with caplog.at_level(logging.INFO):
        seqs = continuations(loaded, rows, [0.0], 5, "rev", cache, "engine", crosscheck_rows=2, progress=False)
    assert [r.getMessage() for r in caplog.records if reason in r.getMessage()] == [
        f"target continuations by HF generate instead of the bundled runtime: {reason}"]
    for s in seqs[0.0]:
        assert s.token_ids[:s.prompt_len] == encode_row(loaded.tokenizer, s.row)
        assert len(s.continuation) > 1 and s.continuation == _hf_greedy(loaded, s.token_ids[:s.prompt_len], 10)
    assert json.loads(cache.read_text())["crosscheck"] is None  # no runtime, no side-by-side check
    # cached under the `local` key (they are HF's tokens): an explicit `local` request reads them, no forward
    forward = loaded.model.forward
    loaded.model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated again"))
    try:
        local = continuations(loaded, rows, [0.0], 5, "rev", cache, "local", progress=False)
    finally:
        loaded.model.forward = forward
    assert [s.token_ids for s in local[0.0]] == [s.token_ids for s in seqs[0.0]]


def test_evaluate_without_the_runtime_reports_why_and_still_picks_a_checkpoint(
        tmp_path: Path, tiny_qwen3_next: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    recipe = make_run(tmp_path / "a", tiny_qwen3_next, "eagle3", steps=(10, 20), num_steps=2, draft_vocab_size=512,
                      live=True, extra=("evaluate.live_rows_per_cohort=1",))
    assert recipe.evaluate.continuation_backend == "engine"
    loaded = load_target(recipe.target)
    reason = _runner_refusal(loaded.model)
    built = _count_runners(monkeypatch)
    with caplog.at_level(logging.INFO):
        summary = acceptance.run(recipe, progress=False)
    assert built == [1]  # the runtime was asked once (not once for continuations and again for each live engine)
    assert [r.getMessage() for r in caplog.records if reason in r.getMessage()] == [
        "evaluating without the bundled runtime (target continuations by HF generate, no live or predicted-vs-live "
        f"columns): {reason}"]
    ev = recipe.paths.eval
    sel = json.loads((ev / "selection.json").read_text())
    assert summary["best"] == sel["best"] == read_pointer(recipe.paths.checkpoints, "best").name
    assert sel["live"] is None and sel["runtime_unavailable"] == reason and sel["continuation_backend"] == "local"
    assert summary["without the bundled runtime (continuations by HF generate, no live columns)"] == reason
    line = ("- no live or predicted-vs-live columns, and the target's continuations were written by HF `generate`: "
            f"the bundled runtime cannot run this target ({reason})")
    assert (ev / "report.md").read_text().count(line) == 1
    for step in ("step-0000010", "step-0000020"):
        rep = json.loads((ev / step / "report.json").read_text())
        assert rep["live"] is None and rep["runtime_unavailable"] == reason
        spec = rep["temperatures"]["0.0"]["speculator"]
        assert set(spec["cohorts"]) == set(rep["cohorts"]) and spec["mean_tau"] >= 1.0
        md = (ev / step / "report.md").read_text()
        assert md.count(line) == 1 and "live tau" not in md and "predicted vs live" not in md
    # the continuations exist and are HF's greedy tokens
    stored = json.loads((ev / "continuations.json").read_text())["sequences"]
    rows = load_workloads(recipe.evaluate.workloads)
    assert len(stored) == len(rows) == 3
    want = sorted(_hf_greedy(loaded, encode_row(loaded.tokenizer, r), r.max_new_tokens) for r in rows)
    assert sorted(stored.values()) == want and all(len(c) > 1 for c in want)
    # complete (a pipeline run skips it), and evaluated like an explicit `local`, live-off run of the same checkpoints
    assert acceptance.is_complete(recipe)
    assert acceptance.run(recipe, progress=False)["evaluated"] == 0
    local = make_recipe(tmp_path / "b", tiny_qwen3_next, "eagle3", num_steps=2, draft_vocab_size=512,
                        extra=("evaluate.continuation_backend=local",))
    for step in ("step-0000010", "step-0000020"):
        shutil.copytree(recipe.paths.checkpoints / step, local.paths.checkpoints / step)
    assert acceptance.run(local, progress=False)["best"] == sel["best"]
    best = json.loads((local.paths.eval / sel["best"] / "report.json").read_text())
    assert best["temperatures"] == json.loads((ev / sel["best"] / "report.json").read_text())["temperatures"]
