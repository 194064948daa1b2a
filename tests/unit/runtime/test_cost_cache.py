"""Cycle costs kept per machine (runtime/cost_cache.py): an engine with `cost_cache` measures its costs on its first
request and keeps them in the cache root; the next engine like it starts from them (no calibration) and reports
where they came from; another thread count, a cache file that is damaged, or a table that two cycles timed now
contradict (saved while other work shared the cores) is measured anew; engines without `cost_cache` write nothing."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.core.config import TreeConfig
from speculators.runtime import calibration, cycle_steps
from speculators.runtime.cost_cache import cost_key, cost_path
from speculators.runtime.cycle_costs import CostModel
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import hf_greedy, loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 100, 200, 5, 6]
TREE = TreeConfig(kind="dynamic", depth=3, topk=2, budget=6, adaptive=True)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def spec_dir(tiny_llama, tmp_path_factory) -> str:
    return str(make_speculator_dir(tiny_llama, "eagle3", tmp_path_factory.mktemp("cost-cache") / "eagle3", seed=3))


def _engine(tiny_llama, spec_dir: str, cost_cache: bool = True) -> Engine:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dir, tree=TREE, ngram_graft=2)
    engine.cost_cache = cost_cache
    return engine


def _calibrations(monkeypatch) -> list[int]:
    """Count the first-request measurements (the real calibration still runs)."""
    calls: list[int] = []
    real = cycle_steps.calibrate_verification

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cycle_steps, "calibrate_verification", counted)
    return calls


def test_the_state_round_trips_exactly() -> None:
    cost = CostModel()
    for nodes, seconds in ((1, 0.01), (2, 0.012), (5, 0.02)):
        cost.observe_cycle(nodes, seconds, "dynamic")
    cost.set_draft(2, 3, 0.004, "dynamic")
    cost.observe_absorb(0.001)
    cost.observe_total("model", 0.02, 0.025)
    again = CostModel.from_state(json.loads(json.dumps(cost.state())))
    assert again == cost and again.rate([0.5, 0.4], 2, "dynamic") == cost.rate([0.5, 0.4], 2, "dynamic")


def test_the_next_engine_starts_from_the_costs_this_one_measured(tiny_llama, spec_dir, cache, monkeypatch) -> None:
    calls = _calibrations(monkeypatch)
    # the check of a loaded table is the next test's subject: under CI's parallel load a tiny model's cycle varies 3x
    monkeypatch.setattr(calibration, "LOADED_TOLERANCE", 1e9)
    first = _engine(tiny_llama, spec_dir)
    out = first.generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert calls == [1] and out.stats.adaptive["cost"]["origin"] == "measured"
    path = cost_path(cost_key(first))
    saved = json.loads(path.read_text())
    assert saved["key"]["threads"] == torch.get_num_threads() and saved["key"]["drafter"]["family"] == "eagle3"

    second = _engine(tiny_llama, spec_dir)
    out = second.generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert calls == [1], "the second engine measured again"
    assert out.stats.adaptive["cost"]["origin"] == f"cached: {path}"
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT, 12)  # costs choose plans; the output is the target's


def test_another_thread_count_or_a_damaged_file_is_measured_anew(tiny_llama, spec_dir, cache, monkeypatch) -> None:
    calls = _calibrations(monkeypatch)
    _engine(tiny_llama, spec_dir).generate(PROMPT, SamplingParams(max_new_tokens=8))
    torch.set_num_threads(2)
    try:
        _engine(tiny_llama, spec_dir).generate(PROMPT, SamplingParams(max_new_tokens=8))
    finally:
        torch.set_num_threads(1)
    assert calls == [1, 1] and len(list((cache / "costs").glob("*.json"))) == 2
    engine = _engine(tiny_llama, spec_dir)
    cost_path(cost_key(engine)).write_text("{not json")
    engine.generate(PROMPT, SamplingParams(max_new_tokens=8))
    assert calls == [1, 1, 1] and json.loads(cost_path(cost_key(engine)).read_text())["cost"]["points"]


def test_an_engine_without_the_cache_writes_nothing(tiny_llama, spec_dir, cache) -> None:
    engine = _engine(tiny_llama, spec_dir, cost_cache=False)
    engine.generate(PROMPT, SamplingParams(max_new_tokens=8))
    assert engine.cost.calibrated and not cache.exists()


@pytest.mark.parametrize("inflated", ["points", "draft"])
def test_a_cached_table_that_this_machine_now_contradicts_is_measured_anew(tiny_llama, spec_dir, cache,
                                                                          monkeypatch, inflated: str) -> None:
    """A table saved while other work shared the cores (every cycle, or the drafting, 20x dearer than now) is checked
    against two cycles and a proposal timed on the first request, dropped, measured again and overwritten."""
    calls = _calibrations(monkeypatch)
    first = _engine(tiny_llama, spec_dir)
    first.generate(PROMPT, SamplingParams(max_new_tokens=8))
    if inflated == "draft":  # the cycles timed as the table says (CI's load varies them 3x): the proposal decides
        monkeypatch.setattr(calibration, "time_cycles", lambda engine, token, cache, sizes: {
            size: first.cost.cycle(size) for size in sizes})
    path = cost_path(cost_key(first))
    saved = json.loads(path.read_text())
    fresh_one_node = CostModel.from_state(saved["cost"]).cycle(1)
    if inflated == "points":
        saved["cost"]["points"] = {b: [n, 20 * t] for b, (n, t) in saved["cost"]["points"].items()}
    else:
        saved["cost"]["draft"] = {k: {d: 20 * t for d, t in v.items()} for k, v in saved["cost"]["draft"].items()}
    path.write_text(json.dumps(saved))
    second = _engine(tiny_llama, spec_dir)
    out = second.generate(PROMPT, SamplingParams(max_new_tokens=8))
    assert calls == [1, 1], "the contradicted table was used"
    what = "a 1-node cycle" if inflated == "points" else f"a depth-1 {TREE.kind} proposal"
    assert out.stats.adaptive["cost"]["origin"].startswith(f"measured (cached costs dropped: {what} took")
    rewritten = CostModel.from_state(json.loads(path.read_text())["cost"])
    assert rewritten.cycle(1) < 5 * fresh_one_node  # the fresh measurement replaced the busy machine's table
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT, 8)
