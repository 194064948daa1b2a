"""The evaluate stage on tiny random targets: outputs, resumability, every family through one code path, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from evalexport_helpers import build_speculator, make_recipe, make_run, save_checkpoint

from speculators.core.checkpoints import read_pointer
from speculators.core.errors import PairingError, SpeculatorsError
from speculators.core.target import fingerprint_target, load_target
from speculators.evaluate import evaluate as acceptance

torch.set_num_threads(1)


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_writes_reports_plots_selection_and_best(tmp_path: Path, tiny_llama: Path) -> None:
    from speculators.core.tracking import RUN_ID_FILE, Tracker, wandb_options
    from tests.unit.train.wandb_records import offline_run

    recipe = make_run(tmp_path, tiny_llama, "eagle3", steps=(10, 20), draft_vocab_size=512,
                      temperatures=(0.0, 1.0))
    Tracker(recipe.paths.logs, ["wandb"], run_name="t", config={}, wandb=wandb_options(recipe.train)).close()
    summary = acceptance.run(recipe, progress=False)
    ev = recipe.paths.eval
    sel = json.loads((ev / "selection.json").read_text())
    assert sel["format"] == "speculators.selection/v1" and sel["complete"] is True
    assert summary["best"] == sel["best"] and sel["best"] in ("step-0000010", "step-0000020")
    assert read_pointer(recipe.paths.checkpoints, "best").name == sel["best"]
    for step in ("step-0000010", "step-0000020"):
        rep = json.loads((ev / step / "report.json").read_text())
        assert rep["format"] == "speculators.eval/v1" and rep["family"] == "eagle3"
        assert set(rep["temperatures"]) == {"0.0", "1.0"}
        assert rep["cohorts"] == ["code-completion", "copy-heavy", "short-output"]
        for entry in rep["temperatures"].values():
            for side in ("speculator", "ngram"):
                s = entry[side]
                assert set(s["cohorts"]) == set(rep["cohorts"])
                for c in s["cohorts"].values():
                    assert len(c["per_position_acceptance"]) == 3 and c["simulated_tau"] >= 1.0
                    assert c["simulated_tau"] == c["tau_by_depth"][-1]
        block = rep["temperatures"]["1.0"]["speculator_block"]  # block verification prediction at T > 0 only
        assert "speculator_block" not in rep["temperatures"]["0.0"] and set(block["cohorts"]) == set(rep["cohorts"])
        assert block["mean_tau"] >= rep["temperatures"]["1.0"]["speculator"]["mean_tau"] - 1e-3
        md = (ev / step / "report.md").read_text()
        assert "n-gram tau" in md and "## T = 0.0" in md and "copy-heavy" in md and "block tau" in md
        assert _png(ev / step / "per_position.png") and _png(ev / step / "tau.png")
    assert _png(ev / "selection.png") and "Best checkpoint" in (ev / "report.md").read_text()
    assert "tau@T=0.0 (n-gram)" in summary and set(summary["tau@T=0.0 (best)"]) == set(rep["cohorts"])
    assert acceptance.is_complete(recipe)
    # the report joined the training run in W&B (offline here): the checkpoint choice and per-cohort tau
    wandb_run = offline_run(recipe.paths.logs, (recipe.paths.logs / RUN_ID_FILE).read_text().strip())
    assert wandb_run["summary"]["eval/best_checkpoint"] == sel["best"]
    assert wandb_run["summary"]["eval/mean_tau@T=1.0"] == sel["summary"]["1.0"]["mean_tau"]
    evaluation = next(h for h in wandb_run["history"] if "eval/cohort_tau/_type" in h)
    assert evaluation["eval/cohort_tau/nrows"] == 6 and evaluation["eval/per_position/_type"] == "image-file"


def test_evaluate_is_resumable_and_notices_new_checkpoints(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "medusa", steps=(10,), num_steps=2)
    assert not acceptance.is_complete(recipe)
    assert acceptance.run(recipe, progress=False)["evaluated"] == 1
    cache = json.loads((recipe.paths.eval / "continuations.json").read_text())
    assert len(cache["sequences"]) == 3  # 3 rows x 1 temperature, generated once
    assert acceptance.is_complete(recipe)
    assert acceptance.run(recipe, progress=False)["evaluated"] == 0  # nothing new: reports reused
    loaded = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    save_checkpoint(recipe, build_speculator(recipe, loaded, seed=5), 30, fp)
    assert not acceptance.is_complete(recipe)
    out = acceptance.run(recipe, progress=False)
    assert out["evaluated"] == 1 and out["checkpoints"] == 2
    assert acceptance.run(recipe, force=True, progress=False)["evaluated"] == 2


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
def test_every_family_goes_through_the_same_evaluator(tmp_path: Path, tiny_llama: Path, family: str) -> None:
    recipe = make_run(tmp_path, tiny_llama, family, steps=(10,), num_steps=2)
    acceptance.run(recipe, progress=False)
    rep = json.loads((recipe.paths.eval / "step-0000010" / "report.json").read_text())
    assert rep["family"] == family and rep["speculator_depth"] == 2 and rep["depth"] == 3
    spec = rep["temperatures"]["0.0"]["speculator"]
    assert all(len(c["per_position_acceptance"]) == 2 for c in spec["cohorts"].values())
    ngram, full = rep["temperatures"]["0.0"]["ngram"], rep["temperatures"]["0.0"]["ngram_full_depth"]
    assert all(len(c["per_position_acceptance"]) == 2 for c in ngram["cohorts"].values())  # compared at equal depth
    assert all(len(c["per_position_acceptance"]) == 3 for c in full["cohorts"].values())
    for name, c in ngram["cohorts"].items():
        assert c["simulated_tau"] == full["cohorts"][name]["tau_by_depth"][1]
    # the n-gram at a server's cycle starts too, at the speculator's depth: the same positions as the speculator's
    cyc, spec_cyc = ngram["cycle_starts"], spec["cycle_starts"]
    assert cyc["cohorts"].keys() == spec_cyc["cohorts"].keys() and len(cyc["overall"]["attempts"]) == 2
    assert all(1.0 <= c["tau"] <= 3.0 for c in cyc["cohorts"].values())
    report = (recipe.paths.eval / "step-0000010" / "report.md").read_text()
    assert "| n-gram tau at cycle starts |" in report
    assert "n-gram tau at cycle starts" in (recipe.paths.eval / "report.md").read_text()


def test_bad_inputs_fail_in_one_line(tmp_path: Path, tiny_llama: Path, tiny_qwen3: Path) -> None:
    recipe = make_recipe(tmp_path, tiny_llama, "eagle3")
    with pytest.raises(SpeculatorsError, match="no checkpoints to evaluate"):
        acceptance.run(recipe, progress=False)
    recipe = make_run(tmp_path, tiny_llama, "medusa", steps=(10,), num_steps=2)
    wrong_family = make_recipe(tmp_path, tiny_llama, "eagle3")
    with pytest.raises(SpeculatorsError, match="is a medusa speculator but the recipe says"):
        acceptance.run(wrong_family, progress=False)
    bad_temp = make_recipe(tmp_path, tiny_llama, "medusa", extra=("evaluate.select_temperature=0.7",))
    with pytest.raises(SpeculatorsError, match="select_temperature"):
        acceptance.run(bad_temp, progress=False)
    other_target = make_recipe(tmp_path, tiny_qwen3, "medusa")  # same tokenizer and shapes, another revision
    with pytest.raises(PairingError, match="target revision mismatch"):
        acceptance.run(other_target, progress=False)
    assert not (recipe.paths.eval / "selection.json").exists()  # nothing was written by the failed runs


def test_a_corrupt_checkpoint_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = make_run(tmp_path, tiny_llama, "medusa", steps=(10,), num_steps=2)
    ck = recipe.paths.checkpoints / "step-0000010"
    (ck / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpeculatorsError, match="corrupt or truncated"):
        acceptance.run(recipe, progress=False)


def test_baselines_are_scored_on_the_same_rows_side_by_side(tmp_path: Path, tiny_llama: Path,
                                                           tiny_qwen3: Path) -> None:
    """evaluate.baselines: another run's checkpoint is scored on this run's rows exactly as its own evaluation scores
    it, shown next to the best checkpoint; a missing entry is reported and makes the stage incomplete once it exists;
    a baseline paired with another target or a directory that holds no speculator is refused in one line."""
    for name in ("eagle", "medusa", "later", "qwen"):
        (tmp_path / name).mkdir()
    other = make_run(tmp_path / "eagle", tiny_llama, "eagle3", steps=(10,), num_steps=2)
    own = acceptance.run(other, progress=False)
    later = tmp_path / "later" / "run" / "checkpoints" / "best"  # the pointer another run will write
    recipe = make_run(tmp_path / "medusa", tiny_llama, "medusa", steps=(10,), num_steps=2,
                      extra=(f"evaluate.baselines=['{other.paths.checkpoints / 'best'}', '{later}']",))
    acceptance.run(recipe, progress=False)
    sel = json.loads((recipe.paths.eval / "selection.json").read_text())
    present, missing = sel["baselines"]
    assert missing == {"label": str(later), "missing": True}
    assert present["family"] == "eagle3" and present["path"].endswith("step-0000010")
    theirs = json.loads((other.paths.eval / own["best"] / "report.json").read_text())["temperatures"]["0.0"]
    assert present["temperatures"]["0.0"]["mean_tau"] == theirs["speculator"]["mean_tau"]  # the same rows, same code
    assert present["temperatures"]["0.0"]["cycle_mean_tau"] == theirs["speculator"]["cycle_starts"]["mean_tau"]
    md = (recipe.paths.eval / "report.md").read_text()
    assert "## Side by side with the baselines" in md and "(eagle3, depth 2)" in md and "not evaluated" in md
    assert acceptance.is_complete(recipe)
    make_run(tmp_path / "later", tiny_llama, "eagle3", steps=(20,), num_steps=2)
    (later.parent / "best").write_text("step-0000020\n")
    assert not acceptance.is_complete(recipe)  # the missing baseline exists now
    assert acceptance.run(recipe, progress=False)["evaluated"] == 0  # only the new baseline is scored
    assert [b["missing"] for b in json.loads((recipe.paths.eval / "selection.json").read_text())["baselines"]] == \
        [False, False]
    assert acceptance.is_complete(recipe)

    stranger = make_run(tmp_path / "qwen", tiny_qwen3, "eagle3", steps=(10,), num_steps=2)
    for entry, error, match in ((stranger.paths.checkpoints / "step-0000010", PairingError, "target revision"),
                                (tmp_path, SpeculatorsError, "is not a speculator directory")):
        bad = make_recipe(tmp_path / "medusa", tiny_llama, "medusa", num_steps=2,
                          extra=(f"evaluate.baselines=['{entry}']",))
        with pytest.raises(error, match=match):
            acceptance.run(bad, progress=False)
