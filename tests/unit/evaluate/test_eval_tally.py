"""The draft-calibration diagnostic of `evaluate/tally.py`: at T > 0 the every-position tau of the draft's law
rescaled by 1/s names a mis-calibrated draft (too sharp or too flat) and leaves a calibrated one alone."""

from __future__ import annotations

import torch

from speculators.core.sampling import SamplingParams
from speculators.core.workloads import WorkloadRow
from speculators.evaluate.alpha import speculator_alpha, speculator_alpha_scaled
from speculators.evaluate.report import _calibration
from speculators.evaluate.tally import DRAFT_SCALES, SpeculatorTally
from speculators.evaluate.teacher import EvalSequence

V, T, P, D = 12, 40, 6, 3


def _case(sharpness: float, seed: int = 0) -> tuple[EvalSequence, list[torch.Tensor], torch.Tensor]:
    """A sequence whose draft at step k-1, position t, is the teacher's law at t+k with logits x `sharpness`."""
    g = torch.Generator().manual_seed(seed)
    teacher = 2.0 * torch.randn(T, V, generator=g)  # [T, V]
    steps = []
    for k in range(1, D + 1):
        idx = (torch.arange(T) + k).clamp_max(T - 1)  # [T]
        steps.append(sharpness * teacher[idx])  # [T, V]: step k-1 at t targets the teacher at t+k
    ids = torch.randint(0, V, (T,), generator=g).tolist()
    row = WorkloadRow(id="r0", cohort="c", max_new_tokens=T - P)
    return EvalSequence(row=row, temperature=1.0, token_ids=ids, prompt_len=P), steps, teacher


def _summary(sharpness: float) -> dict:
    tally = SpeculatorTally(D, torch.arange(V), [0.0, 1.0])
    for seed in range(3):
        seq, steps, teacher = _case(sharpness, seed)
        tally.add(seq, steps, teacher, 0.0)
        tally.add(seq, steps, teacher, 1.0)
    return {t: tally.summary(t) for t in ("0.0", "1.0")}


def test_a_draft_equal_to_the_teacher_is_calibrated() -> None:
    s = _summary(1.0)
    assert "draft_scales" not in s["0.0"]  # greedy acceptance does not depend on the draft's scale
    t1 = s["1.0"]
    assert set(t1["draft_scales"]) == {str(x) for x in DRAFT_SCALES}
    assert abs(t1["mean_tau"] - (1 + D)) < 1e-6  # q == p accepts every depth
    assert all(v < t1["mean_tau"] for v in t1["draft_scales"].values())
    assert "the draft is calibrated" in _calibration(t1)


def test_a_too_sharp_draft_is_named_with_the_scale_that_helps() -> None:
    t1 = _summary(2.0)["1.0"]
    scaled = t1["draft_scales"]
    assert scaled["1.25"] > scaled["1.1"] > t1["mean_tau"] > scaled["0.9"] > scaled["0.8"]
    sentence = _calibration(t1)
    assert "s=1.25 would gain +" in sentence, sentence


def test_a_too_flat_draft_is_named_too() -> None:
    t1 = _summary(0.5)["1.0"]
    assert t1["draft_scales"]["0.8"] > t1["mean_tau"]
    assert "s=0.8 would gain +" in _calibration(t1)


def test_the_scan_equals_scoring_each_rescaled_draft_on_its_own() -> None:
    """One teacher law for every scale gives what scoring the draft's logits / s separately gives."""
    seq, steps, teacher = _case(1.7, seed=4)
    params = SamplingParams(temperature=1.0)
    scan = speculator_alpha_scaled(steps, teacher, torch.arange(V), P, params, D, DRAFT_SCALES)
    for s in DRAFT_SCALES:
        alone, valid = speculator_alpha([z / s for z in steps], teacher, torch.arange(V), P, params, D)
        assert torch.allclose(scan[s][0], alone) and torch.equal(scan[s][1], valid)
