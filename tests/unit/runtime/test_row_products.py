"""Row products (runtime/forward/row_products.py): either formulation of a weight product and a forward padded to
more rows give the outputs, features and committed cache of the plain forward; the tuned table is complete,
never pads past the cache, and is measured once per shape; engines tune their runner before the first cycle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from speculators.core.trees import ancestor_mask, depths_of
from speculators.models.base import FeatureRequest
from speculators.runtime.forward import row_products
from speculators.runtime.forward.module_runner import make_runner
from speculators.runtime.forward.row_products import MAX_TUNED_ROWS, RowProducts, pad_segment, tune_row_products
from speculators.runtime.forward.target_runner import Segment
from tests.conftest import tiny_config
from tests.unit.runtime.runtime_helpers import single_thread  # noqa: F401

VOCAB = 300


def _runner(family: str, path: str = "auto"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, VOCAB), dtype=torch.float32).eval()
    return make_runner(model, FeatureRequest(tap_layer_ids=(1, 2), last_hidden=True), path=path)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_both_formulations_compute_the_linear_map(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(1, rows, 48, generator=g), torch.randn(80, 48, generator=g)  # [1, T, In], [Out, In]
    b = torch.randn(80, generator=g) if bias else None
    for form in ("rows", "cols"):
        out = RowProducts(form={rows: form}).linear(x, w, b)  # [1, T, Out]
        assert out.shape == (1, rows, 80)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=0)


def test_the_cols_form_hands_on_a_row_major_result() -> None:
    """(W @ x^T)^T is a transposed view; every later op of the layer ran on that row-innermost layout (attention 3.5x
    slower on SmolLM2): the product is made contiguous again."""
    x, w = torch.randn(1, 3, 48), torch.randn(80, 48)
    out = RowProducts(form={3: "cols"}).linear(x, w)
    assert out.is_contiguous() and out.stride() == (240, 80, 1)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("head_pad", [False, True])
def test_the_output_head_computes_the_same_logits_in_every_form(rows: int, head_pad: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden, w = torch.randn(rows, 48, generator=g), torch.randn(300, 48, generator=g)  # [R, H], [V, H]
    out = RowProducts(head_pad=head_pad).head(hidden, w)  # one row padded to two when head_pad
    assert out.shape == (rows, 300)
    torch.testing.assert_close(out, F.linear(hidden, w), atol=1e-5, rtol=0)


def test_a_padded_segment_leaves_the_real_rows_alone() -> None:
    parents = torch.tensor([-1, 0, 0, 1])
    seg = Segment(cache=None, input_ids=torch.tensor([5, 6, 7, 8]), depths=depths_of(parents),
                  tree_mask=ancestor_mask(parents))
    padded = pad_segment(seg, 7)
    assert padded.input_ids.tolist() == [5, 6, 7, 8, 8, 8, 8]
    assert padded.depths.tolist() == [0, 1, 1, 2, 3, 3, 3]
    assert torch.equal(padded.tree_mask[:4, :4], ancestor_mask(parents))
    assert not padded.tree_mask[:4, 4:].any(), "a real row must never see a padding row"
    assert torch.equal(padded.tree_mask[4:, 4:], torch.eye(3, dtype=torch.bool))
    assert not padded.tree_mask[4:, :4].any()
    assert padded.logit_rows.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("family, path", [("llama", "fused"), ("qwen3", "fused"), ("gemma3_text", "modules")])
def test_padded_and_reformulated_forwards_equal_the_plain_one(family: str, path: str) -> None:
    """A chain and a tree after a committed prefix, run plain, then with every product in the other form and every
    row count padded (1 -> 2, 2 -> 5, 4 -> 9, 6 -> 8) and one head row run as two: same logits, features, hidden rows, and the same cache after the
    commit of an accepted path; a forward with no room in the cache is not padded."""
    runner = _runner(family, path)
    g = torch.Generator().manual_seed(1)
    prefix, chain = torch.randint(0, VOCAB, (11,), generator=g), torch.randint(0, VOCAB, (2,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tree = torch.randint(0, VOCAB, (6,), generator=g)

    def run(products: RowProducts) -> tuple[list, torch.Tensor]:
        runner.products = products
        cache = runner.new_cache(64)
        runner.forward(cache, prefix)
        cache.commit(list(range(11)))
        outs = [runner.forward_batch([Segment(cache, chain)])[0]]
        cache.commit([0, 1])
        outs.append(runner.forward_batch([Segment(cache, tree, depths_of(parents), ancestor_mask(parents),
                                                  logit_rows=torch.tensor([0, 3, 5]))])[0])
        cache.commit([0, 1, 3])
        outs.append(runner.forward_batch([Segment(cache, prefix[:1])])[0])  # a plain step: one head row
        outs.append(runner.forward_batch([Segment(cache, prefix[:4])])[0])
        return outs, cache.kv[..., :cache.length, :].clone()

    plain, plain_kv = run(RowProducts(tuned=True))
    forms = {n: "cols" for n in range(1, MAX_TUNED_ROWS + 1)}
    other, other_kv = run(RowProducts(form=forms, pad={1: 2, 2: 5, 4: 9, 6: 8}, tuned=True, head_pad=True))
    for a, b in zip(plain, other, strict=True):
        assert b.logits.shape == a.logits.shape and b.hidden.shape == a.hidden.shape
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=0)
        assert b.features.keys() == a.features.keys() == {"taps", "last_hidden"}
        for key in a.features:
            torch.testing.assert_close(b.features[key], a.features[key], atol=1e-5, rtol=0)
    torch.testing.assert_close(other_kv, plain_kv, atol=1e-5, rtol=0)
    assert RowProducts(pad={4: 9}).padded_rows(4, room=8) == 4 and RowProducts(pad={4: 9}).padded_rows(4, 9) == 9


def test_tuning_gives_a_complete_table_once_per_shape(monkeypatch) -> None:
    monkeypatch.setattr(row_products, "_TUNED", {})
    runner = _runner("llama")
    cache = runner.new_cache(64)
    runner.forward(cache, torch.arange(5))
    cache.commit(list(range(5)))
    table = tune_row_products(runner, cache, token=3, max_rows=6, forms=runner.product_forms)
    assert table.tuned and set(table.form) == set(table.pad) == set(range(1, 7))
    assert set(table.form.values()) <= {"rows", "cols"}
    assert all(n <= table.pad[n] <= 6 for n in table.pad)
    assert {(f, n) for f, n in table.seconds} == {(f, n) for f in ("rows", "cols") for n in range(1, 7)}
    assert cache.length == 5, "tuning runs in scratch slots: nothing is committed"
    assert isinstance(table.head_pad, bool)  # whether one head row runs faster as two: this machine's timing
    assert tune_row_products(runner, cache, token=3, max_rows=6, forms=runner.product_forms) is table
    assert tune_row_products(runner, cache, token=3, max_rows=4, forms=runner.product_forms) is table, "covered"
    monkeypatch.setattr(row_products, "_TUNED", {})
    small = runner.new_cache(8)
    small.length = 6  # 2 free slots: the table covers only what fits
    assert set(tune_row_products(runner, small, 3, max_rows=6, forms=runner.product_forms).form) == {1, 2}
    bigger = tune_row_products(runner, cache, 3, max_rows=6, forms=runner.product_forms)  # asks more: tuned again
    assert set(bigger.form) == set(range(1, 7))
    monkeypatch.setattr(row_products, "_TUNED", {})
    spent = tune_row_products(runner, cache, 3, max_rows=5, forms=runner.product_forms, budget_s=0.0)
    # out of time after one row count (which form won it is the machine's timing: not asserted)
    assert spent.tuned and set(spent.form) == {1} and spent.pad == {1: 1}, "out of time after one row count"
    assert spent.padded_rows(4, room=50) == 4


def test_engines_tune_their_runner_before_the_first_cycle(house_target, monkeypatch) -> None:
    from speculators.serving import Engine, SamplingParams

    monkeypatch.setattr(row_products, "_TUNED", {})

    plain, lookup = Engine.from_pretrained(str(house_target), None), Engine.from_pretrained(str(house_target), "ngram")
    for engine in (plain, lookup):
        assert not engine.runner.products.tuned
        engine.generate("def add(a, b):", SamplingParams(max_new_tokens=4, temperature=0))
        assert engine.runner.products.tuned
    assert set(plain.runner.products.form) == {1, 2}, "plain decoding tunes one row against two"
    tree = lookup.tree
    wanted = max(tree.budget, tree.depth, lookup.lookup_depth) + lookup.graft_nodes + 1
    assert max(lookup.runner.products.form) == min(MAX_TUNED_ROWS, wanted)
