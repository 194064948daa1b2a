"""Sources that keep their answers (`data.sources[i].regenerate: false`) beside regenerated ones: prepare lists
their rows, regenerate writes them once, as prepared, next to the target's rewrites of the other rows (once per
temperature), capture scores both; `skip_rows` lets one file feed both kinds; bad settings are one line and
write nothing; a recipe that sets neither keeps the inputs hash it had."""

from __future__ import annotations

import json

import datasets
import pytest
from data_helpers import recipe, write_rows

from speculators.core.errors import SpeculatorsError
from speculators.data import capture, prepare, regenerate
from speculators.data.prepare import KEPT_ANSWER_IDS
from speculators.data.schemas import copy_id
from speculators.data.shards import FeatureStore


def _recipe(tmp_path, target, sources, run="run"):
    r = recipe(tmp_path / run, target, sources, data={"regenerate": {
        "enabled": True, "backend": "engine", "max_new_tokens": 8, "concurrency": 4, "crosscheck_rows": 0,
        "temperature": [0.0, 1.0]}})
    r.target.dtype = "float32"
    return r


def _rows(path) -> dict[str, tuple[list[int], list[int]]]:
    return {r["id"]: (r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(str(path))}


def test_kept_rows_pass_through_once_beside_the_rewritten_ones(tmp_path, tiny_llama) -> None:
    data = write_rows(tmp_path / "rows.jsonl", 10)
    r = _recipe(tmp_path, tiny_llama, [{"path": str(data), "max_rows": 4},
                                       {"path": str(data), "skip_rows": 4, "regenerate": False}])
    prepare.run(r)
    prepared = _rows(r.paths.prepared)
    m = json.loads((r.paths.prepared / "manifest.json").read_text())
    first = [json.loads(line).get("id") for line in data.read_text().splitlines()]
    assert len(prepared) == 10 and m[KEPT_ANSWER_IDS] == [str(i) for i in first[4:]]
    assert m["inputs"]["sources"][1]["skip_rows"] == 4 and m["inputs"]["sources"][1]["regenerate"] is False

    summary = regenerate.run(r)
    rows = _rows(r.paths.regenerated)
    kept = m[KEPT_ANSWER_IDS]
    assert summary["rows"] == 4 * 2 + 6 and summary["kept_answer_rows"] == 6 and summary["turns_regenerated"] == 8
    assert {i: rows[i] for i in kept} == {i: prepared[i] for i in kept}  # as written, once, under their own ids
    rewritten = set(prepared) - set(kept)
    assert set(rows) - set(kept) == {copy_id(i, t) for i in rewritten for t in (0.0, 1.0)}
    assert json.loads((r.paths.regenerated / "manifest.json").read_text())["counts"]["rows_in"] == 14
    assert regenerate.run(r)["status"] == "complete (skipped)"

    capture.run(r)  # the kept rows are scored by the target's teacher like the rewritten ones
    assert set(FeatureStore(r.paths.features).row_ids()) == set(rows)


def test_bad_kept_answer_settings_are_one_line_and_plain_recipes_keep_their_hash(tmp_path, tiny_llama) -> None:
    data = write_rows(tmp_path / "rows.jsonl", 4)
    r = _recipe(tmp_path, tiny_llama, [{"path": str(data), "skip_rows": -1}], "neg")
    with pytest.raises(SpeculatorsError, match="skip_rows must be >= 0"):
        prepare.run(r)
    assert not r.paths.prepared.exists()
    r = _recipe(tmp_path, tiny_llama, [{"path": str(data), "regenerate": False}], "all-kept")
    prepare.run(r)
    with pytest.raises(SpeculatorsError, match="every data source keeps its answers") as err:
        regenerate.run(r)
    assert "\n" not in str(err.value) and not r.paths.regenerated.exists()

    plain = _recipe(tmp_path, tiny_llama, [{"path": str(data)}], "plain")
    record = prepare.inputs_fingerprint(plain, prepare.load_tokenizer(plain.target))["sources"][0]
    assert set(record) == {"path", "split", "schema", "max_rows", "fingerprint"}  # earlier runs' hashes hold
