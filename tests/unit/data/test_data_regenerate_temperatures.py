"""regenerate at several temperatures (`data.regenerate.temperature: [0.0, 1.0]`): every row once per temperature,
ids `<id>@T=<t>`, the greedy copies equal a greedy-only regeneration token for token; the copies of one row stay on
one side of the train / val split in capture's vocabulary counts and in training (offline and online sources);
a bad temperature list is one line and writes nothing."""

from __future__ import annotations

import json

import datasets
import pytest
from data_helpers import recipe, write_rows

from speculators.core.errors import SpeculatorsError
from speculators.core.recipes import load_recipe
from speculators.data import capture, prepare, regenerate, shards
from speculators.data.schemas import copy_id, source_row_id
from speculators.data.shards import FeatureStore
from speculators.data.token_counts import split_counts
from speculators.train.batches import FeatureSource, PreparedSource, train_val_indices


def _recipe(tmp_path, target, run, temperature, n=8):
    data = tmp_path / "rows.jsonl"
    if not data.exists():
        write_rows(data, n)
    r = recipe(tmp_path / run, target, data, data={"val_fraction": 0.25, "regenerate": {
        "enabled": True, "backend": "engine", "max_new_tokens": 10, "concurrency": 4, "crosscheck_rows": 2,
        "temperature": temperature}})
    r.target.dtype = "float32"
    return r


def _rows(path) -> dict[str, tuple[list[int], list[int]]]:
    return {r["id"]: (r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(path))}


def test_each_row_once_per_temperature_and_copies_share_a_split_side(tmp_path, tiny_llama) -> None:
    greedy = _recipe(tmp_path, tiny_llama, "greedy", 0.0)
    mixed = _recipe(tmp_path, tiny_llama, "mixed", [0.0, 1.0])
    for r in (greedy, mixed):
        prepare.run(r)
    regenerate.run(greedy)
    summary = regenerate.run(mixed)
    one, two = _rows(greedy.paths.regenerated), _rows(mixed.paths.regenerated)
    assert summary["rows"] == 2 * len(one) == 16 and summary["failed_rows"] == 0
    assert set(two) == {copy_id(i, t) for i in one for t in (0.0, 1.0)}
    assert all(two[copy_id(i, 0.0)] == one[i] for i in one)  # the greedy copies: the greedy-only run's rows
    assert sum(two[copy_id(i, 1.0)] != one[i] for i in one) >= 1  # the sampled copies are other answers
    m = json.loads((mixed.paths.regenerated / "manifest.json").read_text())
    assert m["source"]["temperatures"] == [0.0, 1.0] and m["counts"]["rows_in"] == 16
    assert m["generation"]["crosscheck"]["temperature"] == 0.0 and m["generation"]["crosscheck"]["identical"] == 2
    assert regenerate.run(mixed)["status"] == "complete (skipped)"

    # the split: both copies of a row on one side, in training's online source and in capture's counts
    ds = datasets.load_from_disk(str(mixed.paths.regenerated))
    ids = list(ds["id"])
    train, val = train_val_indices(PreparedSource(mixed.paths.regenerated), 0.25, mixed.seed)
    assert sorted(train + val) == list(range(16)) and len(val) == 4  # 2 of 8 source rows
    val_sources = {source_row_id(ids[i]) for i in val}
    assert val_sources.isdisjoint(source_row_id(ids[i]) for i in train) and len(val_sources) == 2
    train_c, val_c = split_counts(ds, 1 + max(max(ids_) for ids_, _ in two.values()), 0.25, mixed.seed)
    want = sum(sum(two[ids[i]][1]) for i in val)  # assistant tokens of the held-out copies
    assert int(val_c.sum()) == want and int(train_c.sum()) + want == sum(sum(m_) for _, m_ in two.values())

    # offline: the features keep the ids, and the feature store's split is the same
    capture.run(mixed)
    store = FeatureStore(mixed.paths.features)
    assert store.row_ids() == ids
    assert train_val_indices(FeatureSource(store), 0.25, mixed.seed) == (train, val)
    assert store.split("val", 0.25, mixed.seed) == val


def test_split_groups_reduce_to_the_plain_split_and_bad_temperature_lists_are_one_line(tmp_path, tiny_llama) -> None:
    plain = shards.split_side_indices(20, "val", 0.1, 3)
    assert shards.split_side_indices(20, "val", 0.1, 3, [f"r{i}" for i in range(20)]) == plain  # distinct: unchanged
    groups = [f"r{i % 10}" for i in range(20)]
    val = shards.split_side_indices(20, "val", 0.1, 3, groups)
    assert len(val) == 2 and groups[val[0]] == groups[val[1]]
    copies = [copy_id(f"r{i % 10}", 0.0 if i < 10 else 1.0) for i in range(20)]  # ids of two temperature copies
    assert shards.split_side_indices(20, "val", 0.1, 3, copies) == val
    assert source_row_id(copy_id("a@T=x", 0.7)) == "a@T=x" and source_row_id("a@T=x") == "a@T=x"
    with pytest.raises(SpeculatorsError, match="3 row ids for 4"):
        shards.split_side_indices(4, "val", 0.5, 0, ["a", "b", "c"])

    for bad, message in (([], "non-empty list"), ([1.0, 1.0], "lists a temperature twice")):
        r = _recipe(tmp_path, tiny_llama, f"bad-{len(bad)}", bad)
        prepare.run(r)
        with pytest.raises(SpeculatorsError, match=message):
            regenerate.run(r)
        assert not r.paths.regenerated.exists()
    with pytest.raises(SpeculatorsError, match=r"data.regenerate.temperature must be >= 0, got \[0.0, -1.0\]"):
        load_recipe(None, ["data.regenerate.temperature=[0.0, -1.0]"])
