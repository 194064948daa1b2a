"""Medusa: vLLM Medusa layout, distinct ResBlocks, heads on the absorbed hidden == forward_train, static choices."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from models_helpers import (
    HIDDEN,
    VOCAB,
    build,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    randomize,
    target_features,
)

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.models import SPECULATORS
from speculators.models.base import FeatureRequest
from speculators.models.static_trees import default_choices, medusa_choices_from_accuracy


def _batch(target, b=2, t=10, seed=0):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **target_features(target, ids, None)}


def test_layout_init_and_distinct_layers():
    model, _, target = build("medusa", num_steps=3, num_layers=2)
    assert model.required_features() == FeatureRequest(tap_layer_ids=None, last_hidden=True)
    sd = model.state_dict()
    assert set(sd) == {f"blocks.{h}.layers.{j}.{p}" for h in range(3) for j in range(2) for p in ("weight", "bias")} \
        | {f"lm_heads.{h}.weight" for h in range(3)}
    assert sd["blocks.0.layers.0.weight"].shape == (HIDDEN, HIDDEN) and sd["lm_heads.2.weight"].shape == (VOCAB, HIDDEN)
    ptrs = {p.data_ptr() for n, p in model.named_parameters()}
    assert len(ptrs) == len(list(model.parameters()))  # no weight shared between layers or heads
    batch = _batch(target)
    logits = model.forward_train(batch)
    assert len(logits) == 3 and all(x.shape == (2, 10, VOCAB) for x in logits)
    # zero-initialised ResBlocks + lm_heads from the target: an untrained head is the target's own head
    base = target.lm_head(batch["last_hidden"])
    for x in logits:
        torch.testing.assert_close(x, base)
    x = model.forward_train(batch)[1].sum()
    x.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith(("blocks.1", "lm_heads.1")))
    assert model.blocks[0].layers[0].weight.grad is None


def test_config_follows_vllm_medusa_format():
    model, _, _ = build("medusa", num_steps=4, num_layers=1)
    c = model.config_dict()
    assert c["model_type"] == "medusa" and c["num_heads"] == 4 and c["num_hidden_layers"] == 1
    assert c["hidden_size"] == HIDDEN and c["vocab_size"] == VOCAB and c["medusa_fc_bias"] is True
    assert c["speculators_native"]["family"] == "medusa"
    assert SPECULATORS["medusa"].from_config_dict(c).config_dict() == c
    with pytest.raises(SpeculatorsError, match="original_lm_head"):
        SPECULATORS["medusa"].from_config_dict({**c, "original_lm_head": True})


def test_heads_on_absorbed_hidden_equal_forward_train():
    model, _, target = build("medusa", num_steps=3)
    randomize(model)
    batch = _batch(target, b=1, t=9, seed=4)
    with torch.no_grad():
        train = model.forward_train(batch)
    state = model.new_state(32, "cpu")
    ids, hid = batch["input_ids"][0], batch["last_hidden"][0]
    model.absorb(state, {"last_hidden": hid[:4]}, ids[1:5])
    model.absorb(state, {"last_hidden": hid[4:7]}, ids[5:8])  # positions 0..6, root = x_7
    tree = model.propose(state, int(ids[7]), TreeConfig(kind="chain", depth=3, budget=3), SamplingParams(), None)
    want = [int(train[k][0, 6].argmax()) for k in range(3)]
    assert tree.tokens.tolist() == [int(ids[7]), *want] and tree.mode == "greedy"
    with pytest.raises(ValueError, match="root token"):
        model.propose(state, (int(ids[7]) + 1) % VOCAB, TreeConfig(kind="chain"), SamplingParams(), None)


def _expected_accepted(choices, rank_p):
    return sum(math.prod(rank_p[d][r] for d, r in enumerate(path)) for path in choices)


def test_medusa_choices_maximise_expected_acceptance():
    acc = [[0.5, 0.7], [0.3, 0.45], [0.2, 0.3]]
    rank_p = [[row[0], *(row[i] - row[i - 1] for i in range(1, len(row)))] for row in acc]
    all_paths = [p for d in range(1, 4) for p in itertools.product(range(2), repeat=d)]
    for budget in (1, 3, 6):
        choices = medusa_choices_from_accuracy(acc, budget)
        assert len(choices) == budget
        assert all(tuple(c[:-1]) in {tuple(x) for x in choices} or len(c) == 1 for c in choices)  # prefix-closed
        assert choices == sorted(choices, key=lambda c: (len(c), c))
        # brute force over every prefix-closed tree of this size
        best = 0.0
        for subset in itertools.combinations(all_paths, budget):
            s = set(subset)
            if all(len(p) == 1 or p[:-1] in s for p in subset):
                best = max(best, _expected_accepted(subset, rank_p))
        assert _expected_accepted([tuple(c) for c in choices], rank_p) == pytest.approx(best)
    d = default_choices(4, 20)
    assert len(d) == 20 and [0] in d and [0, 0] in d and max(len(c) for c in d) <= 4


def test_static_tree_uses_stored_choices():
    model, _, target = build("medusa", num_steps=3)
    randomize(model)
    model.set_choices_from_accuracy([[0.6, 0.8], [0.4, 0.6], [0.2, 0.3]], budget=5)
    assert model.config_dict()["speculators_native"]["medusa_choices"] == model.choices
    batch = _batch(target, b=1, t=6)
    state = model.new_state(16, "cpu")
    model.absorb(state, {"last_hidden": batch["last_hidden"][0]}, batch["input_ids"][0])
    tree = model.propose(state, int(batch["input_ids"][0, -1]), TreeConfig(kind="static", depth=3, budget=16),
                         SamplingParams(temperature=0.7), None)
    assert tree.size == 6 and tree.mode == "deterministic"
    with torch.no_grad():
        heads = model.heads(batch["last_hidden"][0, -1])
    for i, path in enumerate(model.choices, start=1):
        assert int(tree.tokens[i]) == int(torch.topk(heads[len(path) - 1], path[-1] + 1).indices[-1])
