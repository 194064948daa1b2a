"""Shapes with random weights and the runtime's measured costs (oracle/shapes.py, oracle/costs.py) on a tiny
shape: the grids come back complete, budgets and memory limits are recorded as skipped, drafters report the nodes
the runtime would verify. Timings are only checked for being positive: tests never judge wall-clock speed."""

from __future__ import annotations

import pytest
import torch

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.oracle import costs as measure
from speculators.oracle.shapes import random_drafter, random_target, shape_config, shape_names
from speculators.runtime.drafters.model_free import NoDrafter
from speculators.runtime.engine import Engine
from speculators.runtime.forward.target_runner import TargetRunner
from tests.unit.runtime.runtime_helpers import single_thread  # noqa: F401


@pytest.fixture(scope="module")
def tiny():
    return random_target("tiny-llama", "cpu", torch.float32)


def test_named_shapes_are_data_and_unknown_ones_fail(tmp_path) -> None:
    assert {"llama-3.1-8b", "qwen3-8b", "tiny-llama"} <= set(shape_names())
    name, fields = shape_config("llama-3.1-8b")
    assert name == "llama-3.1-8b" and fields["hidden_size"] == 4096 and fields["num_hidden_layers"] == 32
    assert shape_config("Qwen3-8B")[1]["vocab_size"] == 151936
    with pytest.raises(SpeculatorsError, match="unknown model shape 'gpt-9'.*llama-3.1-8b"):
        shape_config("gpt-9")
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    with pytest.raises(SpeculatorsError, match="model_type"):
        shape_config(str(tmp_path / "bad.json"))


def test_random_target_runs_in_the_runtime_without_eos(tiny) -> None:
    assert tiny.model.dtype == torch.float32 and tiny.vocab_size == 4096
    engine = Engine(tiny, max_len=64)
    out = engine.generate([5, 6, 7], max_new_tokens=12)
    assert len(out.token_ids) == 12 and out.text.startswith("t")  # the word-level tokenizer decodes


def test_forward_grid_and_budget(tiny) -> None:
    runner = TargetRunner(tiny.model)
    table = measure.measure_forward(runner, [1, 2], [1, 3, 8], 32, measure.Budget.seconds(60), repeats=2)
    assert sorted(table) == [1, 2] and all(sorted(row) == [1, 3, 8] for row in table.values())
    assert all(t > 0 for row in table.values() for t in row.values())
    spent = measure.Budget(deadline=0.0)  # already over: nothing beyond what is running is measured
    assert measure.measure_forward(runner, [1, 2], [1, 2], 8, spent) == {}
    assert spent.skipped == ["target forward at batch 1: time budget", "target forward at batch 2: time budget"]


@pytest.mark.parametrize("family", ["eagle3", "medusa", "mtp", "dflash"])
def test_every_familys_random_head_is_timed_per_depth(tiny, family: str) -> None:
    drafter, precision = random_drafter(tiny, family, 3, draft_vocab_size=1000)
    runner = TargetRunner(tiny.model, drafter.required_features())
    kinds = {"chain": TreeConfig(kind="chain", depth=3, topk=1, budget=3, adaptive=False),
             "tree": TreeConfig(kind="dynamic", depth=3, topk=2, budget=5, adaptive=False)}
    c = measure.measure_drafter(drafter, runner, kinds, 16, measure.Budget.seconds(60), repeats=2)
    assert [n for _, n in c.propose["chain"].values()] == [1.0, 2.0, 3.0]
    assert [n for _, n in c.propose["tree"].values()] == [2.0, 4.0, 5.0]  # min(budget, top-k x depth)
    assert sorted(c.absorb) == [1, 2, 4, 8] and precision


def test_whole_steps_plain_and_speculative(tiny) -> None:
    budget = measure.Budget.seconds(60)
    plain = Engine(tiny, NoDrafter(), max_len=128)
    assert measure.measure_steps(plain, 2, 0, 16, budget, steps=3) > 0
    drafter, _ = random_drafter(tiny, "eagle3", 2, draft_vocab_size=1000)
    spec = Engine(tiny, drafter, tree=TreeConfig(kind="chain", depth=2, topk=1, budget=2, adaptive=False),
                  max_len=128, adaptive=False)
    assert measure.measure_steps(spec, 1, 2, 16, budget, steps=3) > 0


def test_unknown_families_are_refused(tiny) -> None:
    from speculators.oracle.profile import _drafters

    with pytest.raises(SpeculatorsError, match="--families must name some of eagle3, medusa, mtp"):
        _drafters(tiny, None, ["eagle9"], 2, "auto")
