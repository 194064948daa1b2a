"""prepare: sources (jsonl / json / parquet / arrow / datasets dir), schemas (messages, ShareGPT, prompt/completion),
length policy counts, bad rows (fail by id, or skip and report), missing chat template, manifest and resumability;
every failure leaves the earlier output intact."""

from __future__ import annotations

import json

import datasets
import pytest
from data_helpers import recipe, write_rows

from speculators.core.errors import SpeculatorsError
from speculators.data import prepare
from speculators.data.chat import ChatEncoder
from speculators.data.schemas import Conversation, normalize_row


def _load(path):
    return datasets.load_from_disk(str(path))


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_prepare_house_chat_rows_masks_match_the_template(tmp_path, tiny_llama):
    r = recipe(tmp_path / "run", tiny_llama, write_rows(tmp_path / "rows.jsonl", 8))
    s = prepare.run(r)
    ds = _load(r.paths.prepared)
    m = _manifest(r.paths.prepared)
    assert m["format"] == "speculators.prepared/v1" and m["complete"] and m["mask_methods"] == {
        "generation_markers": s["rows"]}
    assert s["rows"] == len(ds) and s["rows"] + m["counts"]["dropped_no_answer_after_truncation"] == 8
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for row in ds:
        conv = Conversation.from_json(row["id"], row["conversation"])
        out = tok.apply_chat_template(conv.messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        n = len(row["input_ids"])
        assert row["input_ids"] == out["input_ids"][:n] and row["loss_mask"] == out["assistant_masks"][:n]
        masked = [t for t, k in zip(row["input_ids"], row["loss_mask"], strict=True) if k]
        assert masked[-1] == tok.convert_tokens_to_ids("<|end|>") or n == 256  # answer ends with end-of-turn
    assert m["tokens"]["masked"] == sum(sum(x) for x in ds["loss_mask"])
    assert m["tokens"]["total"] == sum(len(x) for x in ds["input_ids"])
    assert m["inputs"]["tokenizer_hash"] and m["sources"][0]["fingerprint"]


def test_sources_and_schemas(tmp_path, tiny_llama):
    rows_msgs = [{"id": "m1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                "content": [{"type": "text",
                                                                                             "text": "hello"}]}]}]
    sharegpt = [{"id": "s1", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "q"},
                                               {"from": "gpt", "value": "a"}]}]
    rows_msgs.append({"id": "p2", "prompt": [{"role": "user", "content": "q2"}],
                      "completion": [{"role": "assistant", "content": "a2"}]})
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in rows_msgs) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(sharegpt))
    datasets.Dataset.from_list([{"id": "p1", "prompt": "def f():\n", "completion": "    return 1\n"}]).to_parquet(
        str(tmp_path / "c.parquet"))
    disk = datasets.Dataset.from_list([{"id": "d1", "prompt": "x = ", "completion": "1"}])
    disk.save_to_disk(str(tmp_path / "d"))
    arrow_file = next((tmp_path / "d").glob("*.arrow"))
    sources = [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.json"), "schema": "sharegpt"},
               {"path": str(tmp_path / "c.parquet")}, {"path": str(tmp_path / "d")},
               {"path": str(arrow_file)}]
    r = recipe(tmp_path / "run", tiny_llama, sources, data={"on_bad_row": "skip"})
    s = prepare.run(r)
    m = _manifest(r.paths.prepared)
    ids = _load(r.paths.prepared)["id"]
    assert ids == ["m1", "p2", "s1", "p1", "d1"]  # the arrow file repeats d1: reported as a duplicate
    assert [b["id"] for b in m["bad_rows"]] == ["d1"] and "duplicate" in m["bad_rows"][0]["reason"]
    assert m["mask_methods"] == {"generation_markers": 3, "raw": 2}
    assert [src["kind"] for src in m["sources"]] == ["jsonl", "json", "parquet", "disk", "arrow"]
    assert s["bad_rows"] == 1


def test_sharegpt_roles_are_mapped():
    c = normalize_row("x", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "auto")
    assert c.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.mark.parametrize("raw,reason", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "empty assistant turn"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "q"}]}, "role 'robot'"),
    ({"messages": "hello"}, "must be a list"),
    ({"text": "hello"}, "unknown schema"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown speaker"),
    ({"prompt": "p", "completion": 3}, "both be strings"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "not supported"),
])
def test_malformed_rows_have_one_line_reasons(raw, reason):
    err = normalize_row("row-7", raw, "auto")
    assert err.id == "row-7" and reason in err.reason and "\n" not in err.reason


def _bad_file(tmp_path):
    good = write_rows(tmp_path / "good.jsonl", 3).read_text()
    bad = json.dumps({"id": "bad-empty", "messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": ""}]})
    (tmp_path / "mixed.jsonl").write_text(good + bad + "\n{not json\n")
    return tmp_path / "mixed.jsonl"


def test_bad_rows_fail_by_id_and_keep_the_earlier_output(tmp_path, tiny_llama):
    r = recipe(tmp_path / "run", tiny_llama, write_rows(tmp_path / "rows.jsonl", 3))
    prepare.run(r)
    before = (r.paths.prepared / "manifest.json").read_bytes()
    bad = recipe(tmp_path / "run", tiny_llama, _bad_file(tmp_path))
    with pytest.raises(SpeculatorsError, match=r"bad row 'bad-empty' .*empty assistant turn.*on_bad_row=skip"):
        prepare.run(bad)
    assert (r.paths.prepared / "manifest.json").read_bytes() == before
    assert prepare.is_complete(r) and not prepare.is_complete(bad)


def test_bad_rows_skipped_and_reported(tmp_path, tiny_llama):
    r = recipe(tmp_path / "run", tiny_llama, _bad_file(tmp_path), data={"on_bad_row": "skip"})
    s = prepare.run(r)
    m = _manifest(r.paths.prepared)
    assert s["bad_rows"] == 2
    assert [b["id"] for b in m["bad_rows"]] == ["bad-empty", "mixed.jsonl:5"]
    assert "not valid JSON" in m["bad_rows"][1]["reason"]


def test_length_policy_drop_and_truncate_are_counted(tmp_path, tiny_llama):
    rows = write_rows(tmp_path / "rows.jsonl", 10)
    drop = recipe(tmp_path / "drop", tiny_llama, rows, data={"max_length": 100, "length_policy": "drop"})
    trunc = recipe(tmp_path / "trunc", tiny_llama, rows, data={"max_length": 100, "length_policy": "truncate"})
    sd, st = prepare.run(drop), prepare.run(trunc)
    assert sd["dropped_too_long"] > 0 and sd["truncated"] == 0
    assert st["truncated"] > 0 and st["dropped_too_long"] == 0
    assert max(len(x) for x in _load(trunc.paths.prepared)["input_ids"]) == 100
    assert max(len(x) for x in _load(drop.paths.prepared)["input_ids"]) <= 100
    m = _manifest(trunc.paths.prepared)["counts"]
    assert sd["rows"] + sd["dropped_too_long"] == 10
    assert st["rows"] + m["dropped_no_answer_after_truncation"] == 10


def test_missing_chat_template_fails_in_one_line(tmp_path, tiny_llama):
    import shutil

    target = tmp_path / "no-template"
    shutil.copytree(tiny_llama, target)
    (target / "chat_template.jinja").unlink()
    r = recipe(tmp_path / "run", target, write_rows(tmp_path / "rows.jsonl", 2))
    with pytest.raises(SpeculatorsError, match="no chat template and the recipe gives none"):
        prepare.run(r)
    assert not r.paths.prepared.exists()
    tpl = tmp_path / "tpl.jinja"
    tpl.write_text((tiny_llama / "chat_template.jinja").read_text())
    ok = recipe(tmp_path / "run", target, tmp_path / "rows.jsonl", target={"chat_template": str(tpl)})
    assert prepare.run(ok)["rows"] >= 1


def test_is_complete_tracks_inputs(tmp_path, tiny_llama):
    rows = write_rows(tmp_path / "rows.jsonl", 3)
    r = recipe(tmp_path / "run", tiny_llama, rows)
    assert not prepare.is_complete(r)
    prepare.run(r)
    assert prepare.is_complete(r)
    assert prepare.run(r)["status"] == "complete (skipped)"
    assert not prepare.is_complete(recipe(tmp_path / "run", tiny_llama, rows, data={"max_length": 64}))
    write_rows(rows, 4)  # the source changed
    assert not prepare.is_complete(r)


def test_encoder_and_prepare_agree_on_raw_rows(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    (tmp_path / "pc.jsonl").write_text(json.dumps({"id": "r", "prompt": "import os\n", "completion": "os.sep\n"}))
    r = recipe(tmp_path / "run", tiny_llama, tmp_path / "pc.jsonl")
    prepare.run(r)
    row = _load(r.paths.prepared)[0]
    enc = ChatEncoder(AutoTokenizer.from_pretrained(tiny_llama)).encode(
        Conversation(id="r", prompt="import os\n", completion="os.sep\n"))
    assert row["input_ids"] == enc.input_ids and row["loss_mask"] == enc.loss_mask
