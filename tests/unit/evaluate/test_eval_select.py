"""Checkpoint choice: the best held-out simulated tau wins, never the lowest loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from evalexport_helpers import build_speculator, make_recipe, save_checkpoint

from speculators.core.checkpoints import read_pointer
from speculators.core.errors import SpeculatorsError
from speculators.core.target import fingerprint_target, load_target
from speculators.core.workloads import load_workloads
from speculators.evaluate import evaluate as acceptance
from speculators.evaluate.select import choose_best
from speculators.evaluate.teacher import continuations, teacher_pass

torch.set_num_threads(1)


def _report(name: str, mean_tau: float) -> dict:
    return {"checkpoint": name, "temperatures": {"0.0": {"speculator": {"mean_tau": mean_tau}},
                                                 "1.0": {"speculator": {"mean_tau": 3.0 - mean_tau}}}}


def test_choose_best_by_tau_at_the_selection_temperature() -> None:
    reports = {"step-0000010": _report("step-0000010", 1.8), "step-0000020": _report("step-0000020", 1.5)}
    assert choose_best(reports, 0.0) == "step-0000010"
    assert choose_best(reports, 1.0) == "step-0000020"
    tie = {"step-0000010": _report("step-0000010", 1.5), "step-0000020": _report("step-0000020", 1.5)}
    assert choose_best(tie, 0.0) == "step-0000020"  # ties: the later step
    with pytest.raises(SpeculatorsError, match="no temperature 0.5"):
        choose_best(reports, 0.5)


def _fit(spec, model, sequences, steps: int = 30) -> None:
    """Fit a speculator to the target's own greedy continuations (teacher argmax at t+1+k for step k at t)."""
    passes = [(seq, teacher_pass(model, seq.token_ids, [])) for seq in sequences]
    opt = torch.optim.Adam([p for p in spec.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        loss = torch.zeros(())
        for seq, tp in passes:
            ids = torch.tensor([seq.token_ids])
            logits = spec.forward_train({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         **tp.features(None, True)})
            t = torch.arange(seq.prompt_len - 1, len(seq.token_ids) - 2)
            for k, lg in enumerate(logits):
                ok = t + 1 + k < len(seq.token_ids) - 1
                target = tp.logits[t[ok] + 1 + k].argmax(-1)
                loss = loss + torch.nn.functional.cross_entropy(lg[0, t[ok]], target)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_selection_picks_the_best_tau_not_the_lowest_loss(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_recipe(tmp_path, tiny_llama, "medusa", num_steps=2)
    loaded = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    rows = load_workloads(recipe.evaluate.workloads)
    seqs = continuations(loaded, rows, [0.0], recipe.seed, "test", None, progress=False)
    good = build_speculator(recipe, loaded, seed=0)
    _fit(good, loaded.model, seqs[0.0])
    bad = build_speculator(recipe, loaded, seed=1)
    # the recorded losses say the opposite of acceptance: a loss-based choice would take step 20
    save_checkpoint(recipe, good.eval(), 10, fp, training={"validation": {"val_loss": 5.0}})  # as the trainer writes
    save_checkpoint(recipe, bad, 20, fp, training={"validation": {"val_loss": 0.5}})
    acceptance.run(recipe, progress=False)
    sel = json.loads((recipe.paths.eval / "selection.json").read_text())
    by_name = {r["checkpoint"]: r for r in sel["checkpoints"]}
    assert by_name["step-0000010"]["mean_tau"] > by_name["step-0000020"]["mean_tau"] + 0.2
    assert min(sel["checkpoints"], key=lambda r: r["loss"])["checkpoint"] == "step-0000020"
    assert sel["best"] == "step-0000010"
    assert read_pointer(recipe.paths.checkpoints, "best").name == "step-0000010"
