"""regenerate: batched local generation equals unbatched greedy; the OpenAI-compatible backend (a real HTTP server
serving the tiny target) gives the same rows; rows the server refuses are rejected and listed by id; rows that fail
(a flaky server) stay pending and no row is ever lost: above data.regenerate.max_failed_fraction the stage fails with
one line and writes nothing, at or below it the output leaves them out and the next run tries them again; the
endpoint and the model are checked before the first row; the regenerated answers are the target's own tokens with
exact masks."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from data_helpers import recipe, write_rows
from openai_test_server import ModelServer

from speculators.core.errors import SpeculatorsError
from speculators.data import prepare, regenerate
from speculators.pipeline import run_pipeline


def _regen_recipe(tmp_path, target, run="run", n=5, **regen):
    data = tmp_path / "rows.jsonl"
    if not data.exists():
        write_rows(data, n)
        with data.open("a") as fh:  # a prompt-only row: the target writes the missing answer
            fh.write(json.dumps({"id": "prompt-only", "messages": [{"role": "user", "content": "Name a module."}]})
                     + "\n")
            fh.write(json.dumps({"id": "raw-code", "prompt": "import os\n\ndef main():\n", "completion": "    pass\n"})
                     + "\n")  # a raw prompt/completion row: a new completion, no chat template
    cfg = {"enabled": True, "max_new_tokens": 12, "batch_size": 4, **regen}
    return recipe(tmp_path / run, target, data, data={"regenerate": cfg})


def _rows(path):
    ds = datasets.load_from_disk(str(path))
    return {r["id"]: (r["input_ids"], r["loss_mask"]) for r in ds}


def test_local_batched_equals_unbatched_greedy(tmp_path, tiny_llama):
    batched = _regen_recipe(tmp_path, tiny_llama, "b4", batch_size=4, backend="local")
    single = _regen_recipe(tmp_path, tiny_llama, "b1", batch_size=1, backend="local")
    prepare.run(batched)
    prepare.run(single)
    s = regenerate.run(batched)
    regenerate.run(single)
    assert s["rows"] == 7 and s["failed_rows"] == 0 and s["turns_regenerated"] >= 7
    a, b = _rows(batched.paths.regenerated), _rows(single.paths.regenerated)
    assert a == b
    # the regenerated answers are the target's greedy continuation, token for token
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prepared = _rows(batched.paths.prepared)
    for rid, (ids, mask) in list(a.items())[:3]:
        start = mask.index(1)
        end = start + mask[start:].index(0) if 0 in mask[start:] else len(mask)
        assert ids[:start] == prepared[rid][0][:start]  # same prompt as prepared (single-turn rows)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids[:start]]), max_new_tokens=end - start, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        answer = ids[start:end]
        greedy = out[0, start:].tolist()
        # generation stops at a special token; the template closes the turn with <|end|>
        n = len(answer) - 1 if answer[-1] == 1 else len(answer)
        assert greedy[:n] == answer[:n]
    assert "prompt-only" in a  # a row without answer got one
    raw_ids, raw_mask = a["raw-code"]
    assert raw_ids[: raw_mask.index(1)] == prepared["raw-code"][0][: prepared["raw-code"][1].index(1)]
    assert raw_ids != prepared["raw-code"][0]  # the completion was rewritten by the target


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_engine_backend_equals_hf_generate_and_reports_the_crosscheck(tmp_path, tiny_llama, drafter):
    """The bundled runtime (continuous batching, drafting) writes the same rows as HF generate at T = 0 in fp32,
    and the stage records its side-by-side check (rows, identical, seconds of both) in the manifest."""
    hf = _regen_recipe(tmp_path, tiny_llama, "hf", batch_size=4, backend="local")
    engine = _regen_recipe(tmp_path, tiny_llama, f"engine-{drafter}", batch_size=4, backend="engine", concurrency=3,
                           drafter=drafter, crosscheck_rows=4)
    for r in (hf, engine):
        r.target.dtype = "float32"
        prepare.run(r)
        regenerate.run(r)
    assert _rows(engine.paths.regenerated) == _rows(hf.paths.regenerated)
    gen = json.loads((engine.paths.regenerated / "manifest.json").read_text())["generation"]
    check = gen["crosscheck"]
    assert check["rows"] == 4 and check["identical"] == 4 and check["hf_seconds"] > 0 and check["speedup"] > 0
    assert gen["engine"]["drafter"] == drafter and gen["engine"]["requests"] >= 7
    assert gen["engine"]["tau"] >= 1.0


def test_engine_backend_sampling_is_reproducible_and_a_bad_drafter_is_one_line(tmp_path, tiny_llama):
    r = _regen_recipe(tmp_path, tiny_llama, "sampled", backend="engine", temperature=1.0, crosscheck_rows=0)
    prepare.run(r)
    regenerate.run(r)
    first = _rows(r.paths.regenerated)
    regenerate.run(r, force=True)
    assert _rows(r.paths.regenerated) == first
    bad = _regen_recipe(tmp_path, tiny_llama, "bad", backend="engine", drafter=str(tmp_path / "missing"))
    prepare.run(bad)
    with pytest.raises(SpeculatorsError, match="speculator not found"):
        regenerate.run(bad)
    assert not bad.paths.regenerated.exists()


def test_openai_backend_matches_local_and_reports_failed_rows(tmp_path, tiny_llama):
    local = _regen_recipe(tmp_path, tiny_llama, "local", batch_size=1, backend="local")
    prepare.run(local)
    regenerate.run(local)
    want = _rows(local.paths.regenerated)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = []
    for conv in datasets.load_from_disk(str(local.paths.prepared))["conversation"]:
        if "messages" not in json.loads(conv):
            continue
        msgs = json.loads(conv)["messages"]
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        prompts.append(len(tok.apply_chat_template(msgs[:first], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]))
    limit = max(prompts) - 1  # the longest prompt is rejected by the server (HTTP 400, like vLLM)
    with ModelServer(str(tiny_llama), max_prompt_tokens=limit) as server:
        r = _regen_recipe(tmp_path, tiny_llama, "remote", backend="openai", endpoint=server.url, concurrency=3,
                          max_retries=1)
        prepare.run(r)
        s = regenerate.run(r)
    assert s["rejected_rows"] >= 1 and len(s["rejected_ids"]) == s["rejected_rows"] and s["failed_rows"] == 0
    m = json.loads((r.paths.regenerated / "manifest.json").read_text())
    assert m["counts"]["rejected"] == s["rejected_rows"]
    assert all("HTTP 400" in f["reason"] and "limit" in f["reason"] for f in m["rejected_rows"])
    got = _rows(r.paths.regenerated)
    assert set(got) | set(s["rejected_ids"]) == set(want)
    for rid in got:
        assert got[rid] == want[rid]
    assert regenerate.is_complete(r)  # rejected rows are final: nothing left to try


@pytest.fixture(scope="module")
def clean_rows(tmp_path_factory, tiny_llama):
    """Every row regenerated through a healthy server in one run."""
    with ModelServer(str(tiny_llama)) as server:
        r = _regen_recipe(tmp_path_factory.mktemp("regen-clean"), tiny_llama, "clean", backend="openai",
                          endpoint=server.url)
        prepare.run(r)
        assert regenerate.run(r)["rows"] == 7
    return _rows(r.paths.regenerated)


def test_failed_rows_are_never_lost(tmp_path, tiny_llama, clean_rows):
    with ModelServer(str(tiny_llama), failures=3) as server:  # the first 3 requests get HTTP 503
        r = _regen_recipe(tmp_path, tiny_llama, "flaky", backend="openai", endpoint=server.url, concurrency=1,
                          max_retries=0)
        prepare.run(r)
        with pytest.raises(SpeculatorsError, match=r"3 of 7 rows failed \(42.9% > data.regenerate.max_failed_"
                                                   r"fraction 1.0%\); first: .*HTTP 503.* re-run to try"):
            regenerate.run(r)
        assert not r.paths.regenerated.exists() and not regenerate.is_complete(r)  # nothing written
        first_run = server.requests
        s = regenerate.run(r)  # the server is healthy now: only the 3 failed rows are asked for again
        retried = server.requests - first_run
        assert s["status"] == "done" and s["rows"] == 7 and s["failed_rows"] == 0
        assert 3 <= retried < first_run
        assert regenerate.is_complete(r) and regenerate.run(r)["status"] == "complete (skipped)"
        assert server.requests == first_run + retried
    assert _rows(r.paths.regenerated) == clean_rows  # rows lost: 0, and every row is the target's own
    assert not r.paths.regenerated.with_name("regenerated.partial").exists()


def test_failures_within_the_tolerance_stay_pending(tmp_path, tiny_llama, clean_rows):
    with ModelServer(str(tiny_llama), failures=1) as server:
        r = _regen_recipe(tmp_path, tiny_llama, "tolerant", backend="openai", endpoint=server.url, concurrency=1,
                          max_retries=0, max_failed_fraction=0.2)
        prepare.run(r)
        s = regenerate.run(r)
        assert s["status"] == "done" and s["rows"] == 6 and s["failed_rows"] == 1  # written without it
        assert not regenerate.is_complete(r)  # ... which stays pending
        again = run_pipeline(r, only=["regenerate"])["regenerate"]  # `speculators run` tries it again
        assert again["status"] == "done" and again["rows"] == 7 and again["failed_rows"] == 0
        assert regenerate.is_complete(r)
    assert _rows(r.paths.regenerated) == clean_rows


def test_endpoint_and_model_are_checked_before_the_first_row(tmp_path, tiny_llama):
    with ModelServer(str(tiny_llama)) as server:
        r = _regen_recipe(tmp_path, tiny_llama, "model", backend="openai", endpoint=server.url, model="gpt-4o")
        prepare.run(r)
        with pytest.raises(SpeculatorsError, match=r"does not serve model 'gpt-4o' \(it serves: .*tiny"):
            regenerate.run(r)
        assert server.requests == 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = _regen_recipe(tmp_path, tiny_llama, "down", backend="openai", endpoint=f"http://127.0.0.1:{port}/v1",
                      max_retries=0, request_timeout=5)
    prepare.run(r)
    with pytest.raises(SpeculatorsError, match=f"cannot reach data.regenerate.endpoint http://127.0.0.1:{port}/v1"):
        regenerate.run(r)
    assert not r.paths.regenerated.with_name("regenerated.partial").exists()


def test_regenerate_disabled_is_a_clear_error(tmp_path, tiny_llama):
    r = recipe(tmp_path / "run", tiny_llama, write_rows(tmp_path / "rows.jsonl", 2))
    with pytest.raises(SpeculatorsError, match="regeneration is disabled"):
        regenerate.run(r)


def test_engine_backend_on_a_target_the_runtime_refuses_regenerates_by_hf_generate(tmp_path, tiny_qwen3_next, caplog):
    """A linear-attention target: `backend: engine` writes the same rows as `backend: local` (HF generate), with one
    log line naming why, instead of stopping."""
    local = _regen_recipe(tmp_path, tiny_qwen3_next, "local", backend="local")
    engine = _regen_recipe(tmp_path, tiny_qwen3_next, "engine", backend="engine")
    for r in (local, engine):
        r.target.dtype = "float32"
        prepare.run(r)
    regenerate.run(local)
    with caplog.at_level("INFO", logger="speculators.data.regenerate"):
        regenerate.run(engine)
    lines = [r.getMessage() for r in caplog.records if "instead of the bundled runtime" in r.getMessage()]
    assert len(lines) == 1 and "'qwen3_next'" in lines[0] and "no self-attention" in lines[0]
    assert _rows(engine.paths.regenerated) == _rows(local.paths.regenerated)
    assert "engine" not in json.loads((engine.paths.regenerated / "manifest.json").read_text())["generation"]
