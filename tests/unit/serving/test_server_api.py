"""The OpenAI-compatible app over real HTTP on 127.0.0.1 (uvicorn in a thread): completions, chat, SSE streaming,
log-probabilities from the target's rows, /metrics, concurrent requests sharing target forwards, and a failure
inside generation answered as a 500 for that request only."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from speculators.core.config import ServeConfig
from speculators.serving import Engine, SamplingParams
from speculators.serving.server import create_app
from tests.unit.runtime.runtime_helpers import hf_model, loaded_target, single_thread  # noqa: F401
from tests.unit.serving.live_server import LiveServer

CHAT = [{"role": "user", "content": "def f(x): def f(x): def f(x):"}]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)


def events(body: str) -> list:
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_completion_and_chat_match_the_engine(engine: Engine) -> None:
    want_chat = engine.generate(CHAT, SamplingParams(max_new_tokens=12)).text
    want_text = engine.generate("def f(x):", SamplingParams(max_new_tokens=8)).text
    with LiveServer(create_app(engine, ServeConfig(max_prompt_tokens=64, max_new_tokens=32))) as srv:
        c = srv.client
        health, models = c.get("/health"), c.get("/v1/models")
        comp = c.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        chat = c.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 12, "temperature": 0,
                                                    "model": models.json()["data"][0]["id"]})
    assert health.status_code == 200 and health.json()["drafter"] == "ngram"
    assert models.json()["data"][0]["object"] == "model"
    body = comp.json()
    assert comp.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == want_text and body["usage"]["completion_tokens"] <= 8
    body = chat.json()
    assert chat.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want_chat}
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["speculators"]["target_calls"] >= 1


def test_streaming_chat_and_completion(engine: Engine) -> None:
    want = engine.generate(CHAT, SamplingParams(max_new_tokens=16)).text
    want_comp = engine.generate("a b a b a", SamplingParams(max_new_tokens=6)).text
    with LiveServer(create_app(engine, ServeConfig(max_new_tokens=32))) as srv:
        chat = srv.client.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
        comp = srv.client.post("/v1/completions", json={"prompt": "a b a b a", "max_tokens": 6, "temperature": 0,
                                                        "stream": True})
        ok = srv.metric('speculators_requests_total{endpoint="/v1/chat/completions",status="200"}')
    assert chat.status_code == 200 and chat.headers["content-type"].startswith("text/event-stream")
    evs = events(chat.text)
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["delta"]["role"] == "assistant"
    chunks = [e for e in evs[:-1] if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert evs[-2]["usage"]["completion_tokens"] >= 1
    evs = events(comp.text)
    assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == want_comp
    assert ok == 1.0


def _reference_logprobs(tiny_llama, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax of the target's logits (HF forward, float64) at every generated position: [G, V]."""
    with torch.no_grad():
        logits = hf_model(str(tiny_llama))(torch.tensor([prompt_ids + generated])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)]


def test_logprobs_come_from_the_target(engine: Engine, tiny_llama) -> None:
    prompt = "a b c a b c a b"
    ids = engine.encode(prompt)
    with LiveServer(create_app(engine)) as srv:
        comp = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0.8,
                                                        "seed": 3, "logprobs": 3}).json()
        chat = srv.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                             "logprobs": True, "top_logprobs": 2}).json()
        stream = srv.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "temperature": 0,
                                                               "logprobs": True, "stream": True})
        plain = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}).json()
    assert plain["choices"][0]["logprobs"] is None  # only when asked for
    lp = comp["choices"][0]["logprobs"]
    sampled = engine.generate(prompt, SamplingParams(max_new_tokens=10, temperature=0.8, seed=3)).token_ids
    assert len(lp["tokens"]) == comp["usage"]["completion_tokens"] == len(lp["token_logprobs"]) == len(sampled)
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"] and lp["text_offset"][0] == 0
    ref = _reference_logprobs(tiny_llama, ids, sampled)  # the raw law: before temperature
    for j, tok in enumerate(sampled):
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j, tok]), abs=1e-4)
        top = lp["top_logprobs"][j]
        assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert max(top.values()) == pytest.approx(float(ref[j].max()), abs=1e-4)
    content = chat["choices"][0]["logprobs"]["content"]
    chat_ids = engine.encode(CHAT)
    out_ids = engine.generate(CHAT, SamplingParams(max_new_tokens=6)).token_ids
    ref = _reference_logprobs(tiny_llama, chat_ids, out_ids)
    assert len(content) == len(out_ids)
    for j, item in enumerate(content):
        assert item["logprob"] == pytest.approx(float(ref[j, out_ids[j]]), abs=1e-4)
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"], abs=1e-6)  # greedy: the best
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"] and len(item["top_logprobs"]) == 2
    streamed = [c for e in events(stream.text)[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-6)


def test_failures_do_not_take_the_server_down(engine: Engine, monkeypatch) -> None:
    real = engine.request
    calls = []

    def fail_second(*args, **kw):  # the request coroutine the batch worker drives
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        yield from real(*args, **kw)

    monkeypatch.setattr(engine, "request", fail_second)
    with LiveServer(create_app(engine)) as srv:
        ok = srv.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        failed = srv.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        again = srv.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and again.status_code == 200
    assert failed.status_code == 500 and "RuntimeError: boom" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"


def test_metrics_exposition(engine: Engine) -> None:
    with LiveServer(create_app(engine)) as srv:
        srv.client.post("/v1/completions", json={"prompt": "a b c a b c a b", "max_tokens": 12, "temperature": 0})
        text = srv.client.get("/metrics").text
    for name in ("speculators_draft_tokens_total", "speculators_accepted_tokens_total",
                 "speculators_target_calls_total", "speculators_acceptance_length",
                 "speculators_generation_tokens_total", "speculators_request_latency_seconds_bucket",
                 "speculators_time_to_first_token_seconds_count", "speculators_time_per_output_token_seconds_sum",
                 'speculators_requests_total{endpoint="/v1/completions",status="200"} 1.0',
                 "speculators_requests_cancelled 0.0"):
        assert name in text, name
    tau = float(next(line.split()[-1] for line in text.splitlines()
                     if line.startswith("speculators_acceptance_length ")))
    assert tau >= 1.0


def test_concurrent_requests_share_target_forwards(engine: Engine, monkeypatch) -> None:
    prompts = ["def f(x):", "a b c a b c a b", "import os\n", "x = 1\ny ="]
    want = [engine.generate(p, SamplingParams(max_new_tokens=10)).text for p in prompts]
    release = threading.Event()
    real = engine.request
    started = []

    def held_first(*args, **kw):  # the first request waits until all four are in flight
        started.append(1)
        if len(started) == 1:
            release.wait(timeout=30)
        yield from real(*args, **kw)

    monkeypatch.setattr(engine, "request", held_first)
    with LiveServer(create_app(engine, ServeConfig(max_concurrent_requests=4, max_batch_size=4))) as srv:
        def call(i: int):
            return srv.client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 10,
                                                            "temperature": 0, "stream": i % 2 == 1})

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(call, i) for i in range(4)]
            srv.wait_until(lambda: srv.health()["in_flight"] == 4)
            release.set()
            answers = [f.result() for f in futures]
        metrics = srv.client.get("/metrics").text
        largest = srv.app.state.batch_worker.runner.largest_batch
    for i, (answer, text) in enumerate(zip(answers, want, strict=True)):
        assert answer.status_code == 200
        got = "".join(e["choices"][0]["text"] for e in events(answer.text)[:-1]) if i % 2 else \
            answer.json()["choices"][0]["text"]
        assert got == text, f"request {i}"
    assert largest >= 2
    mean = float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("speculators_mean_batch_size ")))
    assert mean > 1.0 and "speculators_requests_running 0.0" in metrics
