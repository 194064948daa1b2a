"""Capture across nodes and the pieces of the vLLM backend that run without vLLM: node r of n writes shards
r, r + n, ... into one run dir and the node that completes the set writes the manifest (the same shards, byte for
byte, as one node writing them all); the capture settings that cannot work are refused before anything is
written; the final norm the vLLM backend applies is the target's own, loaded from the checkpoint alone."""

from __future__ import annotations

import json

import pytest
import torch
from data_helpers import recipe, write_rows

from speculators.core.errors import SpeculatorsError
from speculators.core.target import final_norm, load_target
from speculators.data import capture, prepare
from speculators.data.vllm_capture import load_final_norm


def _shas(features) -> list[str]:
    return [s["sha256"] for s in json.loads((features / "manifest.json").read_text())["shards"]]


def test_two_nodes_write_the_shards_of_one(tmp_path, tiny_llama):
    rows = write_rows(tmp_path / "rows.jsonl", 12)
    single = recipe(tmp_path / "one", tiny_llama, rows)
    prepare.run(single)
    capture.run(single)
    nodes = [recipe(tmp_path / "two", tiny_llama, rows, capture={"num_nodes": 2, "node_rank": r}) for r in (1, 0)]
    prepare.run(nodes[0])
    first = capture.run(nodes[0])
    assert first["status"].startswith("partial") and not (tmp_path / "two" / "features").exists(), first
    assert not capture.is_complete(nodes[0])
    done = capture.run(nodes[1])
    assert done["status"] == "done" and capture.is_complete(nodes[1])
    assert len(_shas(tmp_path / "one" / "features")) >= 3
    assert _shas(tmp_path / "two" / "features") == _shas(tmp_path / "one" / "features")


@pytest.mark.parametrize(("settings", "message"), [
    ({"num_nodes": 2, "node_rank": 2}, "node_rank"),
    ({"backend": "vllm", "num_processes": 2}, "one vLLM engine per node"),
    ({"backend": "vllm", "vllm": {"tensor_parallel_size": 0}}, "tensor_parallel_size"),
])
def test_impossible_capture_settings_are_refused_before_writing(tmp_path, tiny_llama, settings, message):
    r = recipe(tmp_path / "run", tiny_llama, write_rows(tmp_path / "rows.jsonl", 4), capture=settings)
    prepare.run(r)
    with pytest.raises(SpeculatorsError, match=message):
        capture.run(r)
    assert not (tmp_path / "run" / "features").exists() and not (tmp_path / "run" / "features.partial").exists()


def test_final_norm_loaded_alone_is_the_targets(tmp_path, tiny_llama):
    model = load_target(recipe(tmp_path / "a", tiny_llama, []).target, device="cpu", dtype="float32").model
    with torch.no_grad():  # a norm whose weights are not all ones, so a norm left at its init would show
        final_norm(model).weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "target")
    norm = load_final_norm(recipe(tmp_path / "b", tmp_path / "target", []).target)
    x = torch.randn(5, model.config.hidden_size)  # [T, H]
    torch.testing.assert_close(norm(x), final_norm(model)(x))
    assert not torch.allclose(norm(x), torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-5))
