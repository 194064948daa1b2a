"""Profiles of shapes bigger than memory (oracle/slicing.py): the memory a shape takes is counted before anything is
allocated, the slice is chosen or refused in one line, its timed span covers enough layer weights, a slice keeps
its first layers in place, and the tables are extrapolated by the layer count. Timings are never judged here (docs/results.md has slice vs whole measured)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from speculators.core.errors import SpeculatorsError
from speculators.oracle import slicing
from speculators.oracle.shapes import random_drafter, random_target, shape_model_config
from speculators.runtime.forward.target_runner import TargetRunner
from tests.unit.runtime.runtime_helpers import single_thread  # noqa: F401

GB = 2**30


def test_memory_is_counted_on_the_meta_device_and_a_slice_keeps_embedding_and_head() -> None:
    _, config = shape_model_config("llama-3.1-70b")
    whole = slicing.model_bytes(config, torch.bfloat16)
    assert 141.0e9 < whole < 141.2e9  # 70.55B parameters x 2 bytes
    two = slicing.model_bytes(config, torch.bfloat16, layers=2)
    head_and_embedding = 2 * 128256 * 8192 * 2
    layer = (whole - head_and_embedding) / 80
    assert abs(two - (head_and_embedding + 2 * layer)) < 1e6


def test_a_slice_is_chosen_when_the_shape_does_not_fit_and_refused_when_even_the_slice_does_not(monkeypatch) -> None:
    _, config = shape_model_config("llama-3.1-8b")
    monkeypatch.setattr(slicing.memory, "available_bytes", lambda device: 22 * GB)
    assert slicing.plan_slice(config, torch.bfloat16, "cpu", ["eagle3"], "auto") is None  # 16 GB < 0.7 x 22
    assert slicing.plan_slice(config, torch.float32, "cpu", ["eagle3"], "auto") == 4  # 32 GB: 3 taps + 1
    assert slicing.plan_slice(config, torch.float32, "cpu", ["medusa"], "auto") == 2  # no taps: 1 + 1
    assert slicing.plan_slice(config, torch.bfloat16, "cpu", ["eagle3"], "always") == 4
    with pytest.raises(SpeculatorsError, match="whole shape takes 29.9 GiB in float32.* drop --slice never"):
        slicing.plan_slice(config, torch.float32, "cpu", ["eagle3"], "never")
    monkeypatch.setattr(slicing.memory, "available_bytes", lambda device: 4 * GB)
    with pytest.raises(SpeculatorsError, match="even a slice of 4 of its 32 layers takes 7.2 GiB in float32 .*--dtype bfloat16") as err:
        slicing.plan_slice(config, torch.float32, "cpu", ["eagle3"], "auto")
    assert "\n" not in str(err.value)


def test_scaling_extrapolates_each_entry_by_the_layer_count() -> None:
    big = {1: {1: 10.0, 4: 12.0}, 2: {1: 11.0}}
    small = {1: {1: 8.0, 4: 11.0}}  # batch 2 measured only in the big slice: left out
    assert slicing.scale_table(big, small, 4, 3, 32) == {1: {1: 10.0 + 28 * 2.0, 4: 12.0 + 28 * 1.0}}
    assert slicing.scale_table({1: 5.0}, {1: 6.0}, 4, 3, 32) == {1: 5.0}  # noise: a layer never costs below 0
    assert slicing.scale_table({1: 30.0}, {1: 6.0}, 15, 3, 30) == {1: 30.0 + 15 * 2.0}  # 12 layers cost 24


def test_a_small_model_is_timed_over_enough_layers_to_leave_the_caches(monkeypatch) -> None:
    """SmolLM2-135M's shape (30 layers of 14 MB in float32): a one-layer difference would be timing noise x 26 and
    a few layers' weights fit a CPU's caches; the span covers 256 MiB, capped at half the shape and at what fits."""
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    monkeypatch.setattr(slicing.memory, "available_bytes", lambda device: 22 * GB)
    assert slicing.plan_slice(config, torch.float32, "cpu", ["eagle3"], "always") == 15  # 3 + 12 (half of 30)
    assert slicing.plan_slice(config, torch.float32, "cpu", ["medusa"], "always") == 15  # 1 + 14
    layer = slicing.model_bytes(config, torch.float32, 2) - slicing.model_bytes(config, torch.float32, 1)
    rest = slicing.model_bytes(config, torch.float32, 1) - layer
    assert slicing.slice_span(config, torch.float32, 3, rest + 5.5 * layer) == 2  # only 3 + 2 layers fit
    _, big = shape_model_config("llama-3.1-8b")  # 0.8 GiB a layer: one layer spans 256 MiB
    assert slicing.slice_span(big, torch.float32, 3, 20 * GB) == 1


@pytest.mark.usefixtures("single_thread")
def test_a_slice_keeps_its_first_layers_in_place_and_still_runs() -> None:
    target = random_target("tiny-llama", "cpu", torch.float32, layers=4)
    assert target.model.config.num_hidden_layers == 4
    taps = slicing.slice_taps("eagle3", 8, 4)
    assert taps == [0, 1, 2]
    drafter, _ = random_drafter(target, "eagle3", 2, layer_ids=taps)
    embed = target.model.get_input_embeddings().weight
    slicing.keep_layers(target.model, 3)
    assert len(target.model.model.layers) == 3 and target.model.config.num_hidden_layers == 3
    assert target.model.get_input_embeddings().weight is embed  # the same tensors: no second copy
    runner = TargetRunner(target.model, drafter.required_features())
    cache = runner.new_cache(16)
    out = runner.forward(cache, torch.tensor([1, 2, 3]), capture=True)
    assert out.logits.shape[-1] == 4096 and out.features["taps"].shape[-1] == 3 * 128


def test_random_heads_are_built_in_the_drafting_dtype() -> None:
    """A 70B shape's EAGLE-3 head is counted (and built) in bfloat16: half its float32 size; the default dtype is
    left as it was."""
    _, config = shape_model_config("llama-3.1-70b")
    fp32 = slicing.drafter_bytes(config, ["eagle3"], 3, 32000)
    bf16 = slicing.drafter_bytes(config, ["eagle3"], 3, 32000, torch.bfloat16)
    assert bf16 * 2 == fp32 and 4.0 * GB < bf16 < 5.0 * GB
    target = random_target("tiny-llama", "cpu", torch.bfloat16)
    for family in ("eagle3", "medusa", "dflash"):
        drafter, _ = random_drafter(target, family, 2)
        assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}, family
        assert torch.get_default_dtype() == torch.float32
