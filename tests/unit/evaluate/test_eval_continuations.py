"""The target's continuations of the evaluated rows: the bundled runtime writes them (many rows per forward) equal
to HF `generate` at T=0 in fp32, reproducibly and independently of the other rows at T>0; the cache serves a subset
of the rows (the live rows) without generating again, and keeps each backend's continuations apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from evalexport_helpers import make_recipe, small_workloads

from speculators.core.errors import SpeculatorsError
from speculators.core.target import load_target
from speculators.core.workloads import load_workloads
from speculators.evaluate.live import pick_rows
from speculators.evaluate.teacher import continuations, crosscheck_record


def _ids(seqs: dict) -> dict[tuple[float, str], list[int]]:
    return {(t, s.row.id): s.continuation for t, ss in seqs.items() for s in ss}


def test_engine_continuations_equal_generate_at_t0_and_the_cache_serves_the_live_rows(tmp_path: Path,
                                                                                      tiny_llama: Path) -> None:
    recipe = make_recipe(tmp_path, tiny_llama, "eagle3",
                         workloads=small_workloads(tmp_path / "rows.jsonl", rows_per_cohort=3, max_new_tokens=16))
    loaded = load_target(recipe.target)
    rows = load_workloads(recipe.evaluate.workloads)
    cache = tmp_path / "continuations.json"
    engine = continuations(loaded, rows, [0.0, 1.0], 5, "rev", cache, "engine", crosscheck_rows=4, progress=False)
    local = continuations(loaded, rows, [0.0], 5, "rev", tmp_path / "local.json", "local", progress=False)
    assert len(rows) == 9
    assert [s.continuation for s in engine[0.0]] == [s.continuation for s in local[0.0]]  # greedy: token for token
    assert [s.token_ids[:s.prompt_len] for s in engine[0.0]] == [h.token_ids[:h.prompt_len] for h in local[0.0]]
    assert all(len(s.continuation) <= s.row.max_new_tokens for ss in engine.values() for s in ss)

    # a subset (the live rows) at T>0 without the cache: the same samples as in the full batch (per-row seeds)
    live = pick_rows(rows, 1)
    alone = continuations(loaded, live, [1.0], 5, "rev", None, "engine", progress=False)
    assert _ids(alone) == {k: v for k, v in _ids(engine).items() if k[0] == 1.0 and k[1] in {r.id for r in live}}
    assert continuations(loaded, live, [1.0], 6, "rev", None, "engine", progress=False) != alone  # another seed

    # the cache answers the subset without a target forward: poison the model to prove it is not called
    stored = json.loads(cache.read_text())
    assert stored["format"].endswith("/v2") and len(stored["sequences"]) == 2 * len(rows)
    # the side-by-side check ran on the first 4 greedy rows, both backends agreeing; its outputs are the ones kept
    check = crosscheck_record(cache)
    assert check["rows"] == 4 and check["identical"] == 4 and check["hf_seconds"] > 0 and check["speedup_cpu"] > 0
    unchecked = continuations(loaded, rows, [0.0, 1.0], 5, "rev", None, "engine", progress=False)
    assert _ids(unchecked) == _ids(engine)
    forward = loaded.model.forward
    loaded.model.forward = lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated again"))
    try:
        cached = continuations(loaded, live, [0.0, 1.0], 5, "rev", cache, "engine", progress=False)
    finally:
        loaded.model.forward = forward
    assert _ids(cached) == {k: v for k, v in _ids(engine).items() if k[1] in {r.id for r in live}}
    # another backend (or seed, or target revision) never reads these entries
    again = continuations(loaded, live, [0.0], 5, "rev", cache, "local", progress=False)
    assert _ids(again) == {k: v for k, v in _ids(engine).items() if k[0] == 0.0 and k[1] in {r.id for r in live}}
    assert json.loads(cache.read_text())["key"] != stored["key"]

    with pytest.raises(SpeculatorsError, match="continuation_backend must be one of"):
        continuations(loaded, live, [0.0], 5, "rev", None, "vllm", progress=False)
    with pytest.raises(SpeculatorsError, match="evaluate.crosscheck_rows must be"):
        make_recipe(tmp_path, tiny_llama, "eagle3", extra=("evaluate.crosscheck_rows=-1",))
