"""Live acceptance from the bundled runtime, reported per cohort next to the analytic numbers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from evalexport_helpers import make_run

from speculators.evaluate import evaluate as acceptance

torch.set_num_threads(1)


def test_live_acceptance_of_best_and_ngram_per_cohort(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "eagle3", steps=(10,), num_steps=2, temperatures=(0.0, 1.0),
                      live=True, extra=("evaluate.live_rows_per_cohort=1",))
    summary = acceptance.run(recipe, progress=False)
    rep = json.loads((recipe.paths.eval / "step-0000010" / "report.json").read_text())
    assert rep["live_rows_per_cohort"] == 1
    cohorts = {"code-completion", "copy-heavy", "short-output", "overall"}
    for t in ("0.0", "1.0"):
        live = rep["live"][t]
        for side in ("speculator", "ngram_live", "chain_live"):
            assert set(live[side]) == cohorts
            for stats in live[side].values():
                assert stats["target_calls"] > 0 and stats["tau"] >= 1.0
                assert stats["committed_tokens"] <= stats["accepted_tokens"] + stats["target_calls"]
        for name in ("chain", "tree", "ngram"):  # predicted vs live on the same rows, same fixed chain / tree
            block = live[name]
            assert set(block["cohorts"]) == cohorts and block["tree"]["adaptive"] is False
            for v in block["cohorts"].values():
                assert "vllm" not in v and v["predicted"]["target_calls"] > 0
                lo, hi = v["live"]["tau_interval"]
                assert lo <= v["live"]["tau"] <= hi
        assert live["chain"]["tree"]["kind"] == "chain" and live["chain"]["k"] == 2
        # the prediction is token-wise (min(1, p/q)): the live chain must verify the same way, not by block
        assert live["chain"]["tree"]["verify"] == "token"
    for name in ("chain", "tree", "ngram"):  # at T = 0 the replay is exact: the prediction agrees with live
        assert rep["live"]["0.0"][name]["agree"], rep["live"]["0.0"][name]
    assert "live tau@T=0.0 (best / n-gram)" in summary and "chain tau@T=0.0 predicted / live" in summary
    md = (recipe.paths.eval / "step-0000010" / "report.md").read_text()
    assert "live tau" in md and "live n-gram tau" in md and "predicted vs live" in md
    sel = json.loads((recipe.paths.eval / "selection.json").read_text())
    assert sel["live"] == rep["live"]
    assert acceptance.is_complete(recipe)
