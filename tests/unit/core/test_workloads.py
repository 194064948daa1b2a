"""The held-out workload schema and the shipped workload files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.core.workloads import load_workloads

REPO = Path(__file__).resolve().parents[3]
COHORTS = {"code-completion", "docstring-to-code", "prose", "json-tool-call", "copy-heavy", "short-output"}


def test_shipped_workloads_are_valid_and_held_out() -> None:
    from speculators.house.corpus import HELD_OUT_MODULES

    rows = load_workloads(str(REPO / "data" / "workloads" / "*.jsonl"))
    by_cohort: dict[str, int] = {}
    for row in rows:
        by_cohort[row.cohort] = by_cohort.get(row.cohort, 0) + 1
        module = row.extra["source_module"]
        top = module.split(".")[0]
        assert top in HELD_OUT_MODULES or (module.startswith("topic:")), row.id
    assert set(by_cohort) >= COHORTS
    assert all(n >= 40 for n in by_cohort.values()), by_cohort


def test_workload_modules_are_not_in_the_training_chat_dataset() -> None:
    from speculators.house.corpus import HELD_OUT_MODULES

    text = (REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) >= 1000
    # the phrases the task builders use to name a row's source module (docs may still cite a held-out module,
    # e.g. logging's docs mention `string.Template`; that is not held-out content)
    for mod in HELD_OUT_MODULES:
        for phrase in (f"In the `{mod}` module", f"in the `{mod}` module", f"from `{mod}`.", f"in `{mod}`: ",
                       f"What does the `{mod}` module provide", f"what `{mod}.", f"does `{mod}.", f"take `{mod}.",
                       f'"`{mod}`"'):
            assert phrase not in text, (mod, phrase)


def _write(tmp_path: Path, rows: list) -> str:
    p = tmp_path / "w.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(p)


@pytest.mark.parametrize("row, message", [
    ({"cohort": "c", "prompt": "x", "max_new_tokens": 4}, "missing required key 'id'"),
    ({"id": "a", "cohort": "c", "prompt": "x", "max_new_tokens": 0}, "positive integer"),
    ({"id": "a", "cohort": "c", "max_new_tokens": 4}, "exactly one of 'messages' or 'prompt'"),
    ({"id": "a", "cohort": "c", "prompt": "x", "messages": [], "max_new_tokens": 4}, "exactly one"),
    ({"id": "a", "cohort": "c", "messages": [{"role": "robot", "content": "x"}], "max_new_tokens": 4}, "role"),
    ({"id": "a", "cohort": "c", "messages": [{"role": "assistant", "content": "x"}], "max_new_tokens": 4},
     "ends with a prompt"),
    ("{not json", "not valid JSON"),
])
def test_bad_rows_name_file_and_line(tmp_path: Path, row, message: str) -> None:
    path = _write(tmp_path, [{"id": "ok", "cohort": "c", "prompt": "p", "max_new_tokens": 3}, row])
    with pytest.raises(SpeculatorsError, match=message) as exc:
        load_workloads(path)
    assert f"{path}:2" in str(exc.value)


def test_duplicate_ids_and_missing_files(tmp_path: Path) -> None:
    row = {"id": "a", "cohort": "c", "prompt": "p", "max_new_tokens": 3}
    with pytest.raises(SpeculatorsError, match="duplicate workload id"):
        load_workloads(_write(tmp_path, [row, row]))
    with pytest.raises(SpeculatorsError, match="workload file not found"):
        load_workloads(str(tmp_path / "missing-*.jsonl"))


def test_max_rows_per_cohort(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "cohort": "c" if i % 2 else "d", "prompt": "p", "max_new_tokens": 3} for i in range(10)]
    loaded = load_workloads(_write(tmp_path, rows), max_rows_per_cohort=2)
    assert len(loaded) == 4
