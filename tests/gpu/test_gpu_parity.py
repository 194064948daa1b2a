"""Greedy parity with Hugging Face on held-out rows, on the device, in float32 and in bfloat16.

What holds (docs/architecture.md §7): the output is lossless in distribution in every dtype; token-for-token equality with
greedy decoding holds where the verification forward rounds like the one-token forward. So at every row that
differs from HF `generate` (same device, same dtype), the first differing token must be at a near-tie of the HF
logits (`gpu_helpers.near_tie_limit`); the counts of equal rows, near-ties and divergences are recorded
(`record_property`, printed by scripts/gpu_check.sh). Drafters: plain decoding, n-gram trees, random EAGLE-3
(chain and dynamic tree) and random Medusa (static tree), and the house EAGLE-3 export when
SPECULATORS_GPU_CHECK_SPECULATOR names it.
"""

from __future__ import annotations

import os

import pytest

from speculators.core.config import TreeConfig
from speculators.core.workloads import load_workloads
from speculators.serving import Engine, SamplingParams
from tests.gpu.gpu_helpers import hf_greedy, loaded_target, near_tie_limit, top2
from tests.unit.runtime.runtime_helpers import make_speculator_dir

HOUSE = "data/targets/stdlib-lm"
TREES = {
    "chain": TreeConfig(kind="chain", depth=4, topk=1, budget=4, adaptive=False),
    "dynamic": TreeConfig(kind="dynamic", depth=4, topk=3, budget=10, adaptive=False),
    "static": TreeConfig(kind="static", depth=3, topk=3, budget=8, adaptive=False),
}
CASES = [("none", "chain"), ("ngram", "dynamic"), ("eagle3", "chain"), ("eagle3", "dynamic"),
         ("medusa", "static"), ("trained", "dynamic"), ("trained", "chain")]
SMALL_CASES = {("none", "chain", "bfloat16"), ("ngram", "dynamic", "float32"), ("ngram", "dynamic", "bfloat16"),
               ("eagle3", "dynamic", "float32"), ("trained", "dynamic", "bfloat16")}  # CPU mode


@pytest.fixture(scope="module")
def spec_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu-specs")
    dirs = {f: str(make_speculator_dir(HOUSE, f, root / f, seed=5)) for f in ("eagle3", "medusa")}
    trained = os.environ.get("SPECULATORS_GPU_CHECK_SPECULATOR", "").strip()
    if trained:
        dirs["trained"] = trained
    return dirs


@pytest.fixture(scope="module")
def rows(small) -> list[dict]:
    pattern, per_cohort, max_new = ("data/workloads/[cs]*.jsonl", 1, 8) if small else ("data/workloads/*.jsonl", 3, 32)
    return [{"id": r.id, "messages": r.messages, "prompt": r.prompt, "max_new": min(r.max_new_tokens, max_new)}
            for r in load_workloads([pattern], max_rows_per_cohort=per_cohort)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("drafter, tree", CASES)
def test_greedy_parity_with_hf(device, small, dtype, drafter, tree, rows, spec_dirs, record_property) -> None:
    if drafter not in ("none", "ngram") and drafter not in spec_dirs:
        pytest.skip("SPECULATORS_GPU_CHECK_SPECULATOR is not set")
    if small and (drafter, tree, dtype) not in SMALL_CASES:
        pytest.skip("CPU mode: a few cases keep the script short")
    target = loaded_target(HOUSE, device, dtype)
    engine = Engine.from_pretrained(target, spec_dirs.get(drafter, drafter), tree=TREES[tree], ngram_graft=0)
    equal, ties, failures, accepted = 0, [], [], 0
    for row in rows:
        ids = engine.encode(row["prompt"] if row["prompt"] is not None else row["messages"])
        out = engine.generate(ids, SamplingParams(max_new_tokens=row["max_new"]))
        accepted += out.stats.acceptance.accepted_tokens
        ref = hf_greedy(HOUSE, device, dtype, ids, row["max_new"])
        if out.token_ids == ref:
            equal += 1
            continue
        j = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b), None)
        if j is None:
            failures.append(f"{row['id']}: lengths differ ({len(out.token_ids)} vs {len(ref)})")
            continue
        top, margin = top2(HOUSE, device, dtype, ids + ref[:j])
        limit = near_tie_limit(dtype, top, device)
        (ties if margin <= limit else failures).append(f"{row['id']}@{j}: margin {margin:.3g} (limit {limit:.3g})")
    record_property("parity", f"{device} {dtype} {drafter}/{tree}: {equal}/{len(rows)} rows equal to HF, "
                              f"{len(ties)} near-ties {ties[:3]}, {len(failures)} failures, {accepted} drafts accepted")
    assert not failures, failures[:3]
    if drafter == "trained":
        assert accepted > 0, "the trained speculator accepted nothing: the check proves little"
