"""Greedy losslessness on the house target: the runtime's tokens equal Hugging Face `generate(do_sample=False)`
on held-out workload rows, for every drafter and tree shape.

Budget (CI on 2 CPU cores): the n-gram drafter (its default chain, drafted every cycle) runs EVERY held-out row
(data/workloads/*.jsonl, 288 rows) with max_new_tokens cut to 16; every other drafter x tree shape (none; n-gram
dynamic / static; random-init EAGLE-3 / Medusa / MTP x chain / dynamic / static) runs the first 2 rows of each
cohort with up to 32 new tokens; the same subset once more with 4 requests sharing each target forward (batching.py,
random EAGLE-3 dynamic trees + prompt-lookup graft). Random speculators are fine: parity must hold for any draft.
The references come from batched, left-padded `generate` calls (runtime_helpers.hf_greedy_many: half the time of
288 single-row calls). fp32 numerics may flip an exact near-tie: at a divergence the baseline's top-2 logit margin
there (an unpadded forward) must be < 1e-4 (such rows are counted and reported; expected zero).
"""

from __future__ import annotations

import pytest

from speculators.core.config import TreeConfig
from speculators.core.workloads import load_workloads
from speculators.runtime.batching import generate_batch
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import (  # noqa: F401
    FAMILIES,
    hf_greedy_many,
    loaded_target,
    make_speculator_dir,
    single_thread,
    top2_margin,
)

pytestmark = pytest.mark.integration

FULL_MAX_NEW = 16
SUBSET_ROWS = 2
SUBSET_MAX_NEW = 32
NEAR_TIE = 1e-4
TREES = {
    "chain": TreeConfig(kind="chain", depth=4, topk=1, budget=4, adaptive=False),
    "dynamic": TreeConfig(kind="dynamic", depth=4, topk=3, budget=10, adaptive=False),
    "static": TreeConfig(kind="static", depth=3, topk=3, budget=8, adaptive=False),
}


@pytest.fixture(scope="module")
def rows(house_target):
    target = loaded_target(str(house_target))
    encoder = Engine(target)
    out = []
    seen: dict[str, int] = {}
    for row in load_workloads(["data/workloads/*.jsonl"]):
        ids = encoder.encode(row.prompt if row.prompt is not None else row.messages)
        subset = seen.get(row.cohort, 0) < SUBSET_ROWS
        seen[row.cohort] = seen.get(row.cohort, 0) + 1
        max_new = min(row.max_new_tokens, SUBSET_MAX_NEW if subset else FULL_MAX_NEW)
        out.append({"id": row.id, "ids": ids, "subset": subset, "max_new": max_new})
    assert len(out) == 288
    refs = hf_greedy_many(house_target, [r["ids"] for r in out], [r["max_new"] for r in out])
    return [{**row, "ref": ref} for row, ref in zip(out, refs, strict=True)]


@pytest.fixture(scope="module")
def spec_dirs(house_target, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parity-specs")
    return {f: str(make_speculator_dir(house_target, f, root / f, seed=5)) for f in FAMILIES}


def _compare(house_target, row: dict, got: list[int], max_new: int) -> str:
    """'equal', 'near-tie' (allowed) or a failure description."""
    ref = row["ref"][:max_new]
    if got == ref:
        return "equal"
    j = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    if j < min(len(got), len(ref)):
        margin = top2_margin(house_target, row["ids"] + ref[:j])
        if margin < NEAR_TIE:
            return "near-tie"
        return f"{row['id']}: token {j} is {got[j]}, HF greedy has {ref[j]} (top-2 margin {margin:.3g})"
    return f"{row['id']}: lengths differ ({len(got)} vs {len(ref)})"


def _run(house_target, engine: Engine, rows: list[dict], max_new: int | None, record) -> None:
    failures, ties = [], 0
    for row in rows:
        n = max_new or row["max_new"]
        got = engine.generate(row["ids"], SamplingParams(max_new_tokens=n)).token_ids
        verdict = _compare(house_target, row, got, n)
        ties += verdict == "near-tie"
        if verdict not in ("equal", "near-tie"):
            failures.append(verdict)
    record(f"{engine.info.name}", f"{len(rows)} rows, {ties} near-ties, {len(failures)} failures")
    assert not failures, failures[:3]


def test_ngram_every_heldout_row(house_target, rows, record_property) -> None:
    engine = Engine.from_pretrained(loaded_target(str(house_target)), "ngram")
    engine.set_tree(engine.tree, adaptive=False)  # its chain every cycle: the controller's choice follows the timing
    _run(house_target, engine, rows, FULL_MAX_NEW, record_property)
    assert engine.totals.accepted_tokens > 0


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("drafter", ["none", "ngram", *FAMILIES])
def test_every_drafter_and_tree_on_a_cohort_subset(house_target, rows, spec_dirs, drafter: str, tree: str,
                                                   record_property) -> None:
    if drafter == "none" and tree != "chain":
        pytest.skip("plain decoding has no tree")
    speculator = spec_dirs.get(drafter, drafter)
    engine = Engine.from_pretrained(loaded_target(str(house_target)), speculator, tree=TREES[tree])
    _run(house_target, engine, [r for r in rows if r["subset"]], None, record_property)


def test_batched_requests_on_a_cohort_subset(house_target, rows, spec_dirs, record_property) -> None:
    engine = Engine.from_pretrained(loaded_target(str(house_target)), spec_dirs["eagle3"], tree=TREES["dynamic"],
                                    ngram_graft=3)
    subset = [r for r in rows if r["subset"]]
    outs = generate_batch(engine, [r["ids"] for r in subset],
                                 [SamplingParams(max_new_tokens=r["max_new"]) for r in subset], max_batch=4)
    verdicts = [_compare(house_target, r, o.token_ids, r["max_new"]) for r, o in zip(subset, outs, strict=True)]
    failures = [v for v in verdicts if v not in ("equal", "near-tie")]
    record_property("batched", f"{len(subset)} rows, {verdicts.count('near-tie')} near-ties, {len(failures)} failures")
    assert not failures, failures[:3]
    assert engine.totals.accepted_tokens > 0
