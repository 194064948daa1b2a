"""Sampling losslessness end to end on the device: the joint law of the first two generated tokens equals the
exact target law (Pearson chi-square, the integration test's harness), for a sampled EAGLE-3 chain ("iid"), a
Medusa top-k tree ("deterministic"), n-gram drafts and the batched case, in float32 and bfloat16 — and a
deliberately lossy engine is rejected by the same test on the same device (the test has power there).
The exact law comes from the target in float32 on the CPU; a bfloat16 target's own law differs from it by rounding
only, far below what 1,000 samples resolve."""

from __future__ import annotations

import pytest

from speculators.core.config import TreeConfig
from speculators.serving import Engine
from tests.gpu.gpu_helpers import loaded_target
from tests.integration.test_runtime_sampling import (
    FAMILY_ALPHA,
    SAMPLES,
    _AcceptAnyDraft,
    _chi_square,
    _law_test,
    _prompt,
    assert_detected,
)
from tests.unit.runtime.runtime_helpers import make_speculator_dir

HOUSE = "data/targets/stdlib-lm"
CASES = [  # (drafter, tree, sampling, requests sharing each forward)
    ("eagle3", TreeConfig(kind="chain", depth=2, adaptive=False), dict(temperature=1.2, top_k=0, top_p=0.8), 0),
    ("medusa", TreeConfig(kind="dynamic", depth=2, topk=3, budget=5, adaptive=False),
     dict(temperature=0.9, top_k=20, top_p=0.9), 0),
    ("ngram", TreeConfig(kind="chain", depth=3, adaptive=False), dict(temperature=0.7, top_k=8, top_p=1.0), 0),
    ("medusa", TreeConfig(kind="dynamic", depth=2, topk=3, budget=5, adaptive=False),
     dict(temperature=0.9, top_k=20, top_p=0.9), 8),
]
FLOAT32_CASES = 2
NUM_TESTS = len(CASES) + FLOAT32_CASES + 1
SMALL_SAMPLES = 200  # CPU mode


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu-sampling-specs")
    return {f: str(make_speculator_dir(HOUSE, f, root / f, seed=11)) for f in ("eagle3", "medusa")}



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_first_two_tokens_follow_the_target(device, small, dtype, case, spec_dirs, record_property) -> None:
    if small and (dtype == "bfloat16" or case > 0):
        pytest.skip("CPU mode: one case in float32 (fewer samples) keeps the script short")
    if dtype == "float32" and case >= FLOAT32_CASES:
        pytest.skip("float32: the first cases (bfloat16, the GPU default, runs them all) keep the script short")
    drafter, tree, sampling, batch = CASES[case]
    engine = Engine.from_pretrained(loaded_target(HOUSE, device, dtype), spec_dirs.get(drafter, drafter), tree=tree,
                                    ngram_graft=0)
    p_value = _chi_square(engine, HOUSE, _prompt(HOUSE), sampling, seed=2000 * (case + 1), max_batch=batch,
                          samples=SMALL_SAMPLES if small else SAMPLES)
    record_property("chi-square", f"{device} {dtype} {drafter} {tree.kind} batch {batch or 1}: p = {p_value:.3g}")
    assert engine.totals.drafted_tokens > 0
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"{drafter} {tree.kind} {sampling}: p = {p_value:.3g}"


def test_a_lossy_engine_is_rejected_on_the_device(device, small) -> None:
    dtype = "float32" if small else "bfloat16"
    tree = TreeConfig(kind="dynamic", depth=3, topk=2, budget=4, adaptive=False)
    target = loaded_target(HOUSE, device, dtype)
    engine = Engine.from_pretrained(target, "ngram", tree=tree)
    bad = _AcceptAnyDraft(target, engine.drafter, info=engine.info, tree=tree)
    p_value, outside = _law_test(bad, HOUSE, _prompt(HOUSE), dict(temperature=1.0, top_k=0, top_p=1.0), seed=77,
                                 samples=SMALL_SAMPLES if small else SAMPLES)
    assert bad.totals.drafted_tokens > 0
    assert_detected(p_value, outside, FAMILY_ALPHA / NUM_TESTS, "the lossy engine")
