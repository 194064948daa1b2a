"""The OpenAI-compatible app in-process (httpx over ASGI): completions, chat, SSE streaming, /metrics, auth,
limits, and bad requests answered with one clear 4xx each while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from speculators.serving import Engine, SamplingParams
from speculators.serving.server import ServerLimits, create_app
from tests.unit.serving.runtime_helpers import loaded_target, single_thread  # noqa: F401

CHAT = [{"role": "user", "content": "def f(x): def f(x): def f(x):"}]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)


def _run(app, calls):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await calls(client)

    return asyncio.run(main())


def _events(body: str) -> list:
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_completion_and_chat_match_the_engine(engine: Engine) -> None:
    app = create_app(engine, ServerLimits(max_prompt_tokens=64, max_new_tokens=32))
    want_chat = engine.generate(CHAT, SamplingParams(max_new_tokens=12)).text
    want_text = engine.generate("def f(x):", SamplingParams(max_new_tokens=8)).text

    async def calls(c):
        health = await c.get("/health")
        models = await c.get("/v1/models")
        comp = await c.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        chat = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 0,
                                                          "model": models.json()["data"][0]["id"]})
        return health, models, comp, chat

    health, models, comp, chat = _run(app, calls)
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
    app = create_app(engine, ServerLimits(max_new_tokens=32))
    want = engine.generate(CHAT, SamplingParams(max_new_tokens=16)).text

    async def calls(c):
        chat = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 16, "temperature": 0,
                                                          "stream": True,
                                                          "stream_options": {"include_usage": True}})
        comp = await c.post("/v1/completions", json={"prompt": "a b a b a", "max_tokens": 6, "temperature": 0,
                                                     "stream": True})
        return chat, comp

    chat, comp = _run(app, calls)
    assert chat.status_code == 200 and chat.headers["content-type"].startswith("text/event-stream")
    events = _events(chat.text)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-2]["usage"]["completion_tokens"] >= 1
    events = _events(comp.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    want = engine.generate("a b a b a", SamplingParams(max_new_tokens=6)).text
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want


@pytest.mark.parametrize("path, payload, status, needle", [
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 999}, 400, "exceeds this server's limit of 32"),
    ("/v1/completions", {"prompt": "word " * 80}, 400, "this server accepts at most 64"),
    ("/v1/completions", {"prompt": ""}, 400, "the prompt is empty"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=2 is not supported"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 422, "temperature"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
    ("/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 422, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "assistant"),
])
def test_bad_requests_get_clear_4xx(engine: Engine, path: str, payload: dict, status: int, needle: str) -> None:
    app = create_app(engine, ServerLimits(max_prompt_tokens=64, max_new_tokens=32))

    async def calls(c):
        bad = await c.post(path, json=payload)
        good = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return bad, good

    bad, good = _run(app, calls)
    assert bad.status_code == status, bad.text
    err = bad.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"] and err["code"] == status
    assert good.status_code == 200


def test_malformed_json_body(engine: Engine) -> None:
    app = create_app(engine)
    resp = _run(app, lambda c: c.post("/v1/completions", content=b"{not json",
                                      headers={"content-type": "application/json"}))
    assert resp.status_code == 422 and "invalid request" in resp.json()["error"]["message"]


def test_api_key(engine: Engine) -> None:
    app = create_app(engine, api_key="s3cret")

    async def calls(c):
        body = {"prompt": "x", "max_tokens": 2}
        return (await c.post("/v1/completions", json=body),
                await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}),
                await c.get("/health"))

    missing, wrong, right, health = _run(app, calls)
    assert missing.status_code == 401 and wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert right.status_code == 200 and health.status_code == 200


def test_concurrency_limit_and_failures_do_not_take_the_server_down(engine: Engine, monkeypatch) -> None:
    app = create_app(engine, ServerLimits(max_concurrent_requests=1))
    release = threading.Event()
    real = engine.request
    calls_seen = []

    def slow_then_fail(*args, **kw):  # the request coroutine the batch worker drives
        calls_seen.append(1)
        if len(calls_seen) == 1:
            release.wait(timeout=30)
            yield from real(*args, **kw)
            return
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "request", slow_then_fail)

    async def calls(c):
        first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
        for _ in range(200):
            if (await c.get("/health")).json()["in_flight"] == 1:
                break
            await asyncio.sleep(0.01)
        busy = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        release.set()
        ok = await first
        failed = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        metrics = await c.get("/metrics")
        return busy, ok, failed, metrics

    busy, ok, failed, metrics = _run(app, calls)
    assert busy.status_code == 429 and "server busy" in busy.json()["error"]["message"]
    assert ok.status_code == 200
    assert failed.status_code == 500 and "RuntimeError: boom" in failed.json()["error"]["message"]
    assert 'speculators_requests_total{endpoint="/v1/completions",status="429"} 1.0' in metrics.text


def test_metrics_exposition(engine: Engine) -> None:
    app = create_app(engine)

    async def calls(c):
        await c.post("/v1/completions", json={"prompt": "a b c a b c a b", "max_tokens": 12, "temperature": 0})
        return await c.get("/metrics")

    text = _run(app, calls).text
    for name in ("speculators_draft_tokens_total", "speculators_accepted_tokens_total",
                 "speculators_target_calls_total", "speculators_acceptance_length",
                 "speculators_generation_tokens_total", "speculators_request_latency_seconds_bucket",
                 "speculators_time_to_first_token_seconds_count", "speculators_time_per_output_token_seconds_sum",
                 'speculators_requests_total{endpoint="/v1/completions",status="200"} 1.0'):
        assert name in text, name
    tau = float(next(line.split()[-1] for line in text.splitlines()
                     if line.startswith("speculators_acceptance_length ")))
    assert tau >= 1.0


def test_concurrent_requests_share_target_forwards(engine: Engine, monkeypatch) -> None:
    app = create_app(engine, ServerLimits(max_concurrent_requests=4, max_batch_size=4))
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

    async def calls(c):
        tasks = [asyncio.create_task(c.post("/v1/completions", json={"prompt": p, "max_tokens": 10,
                                                                     "temperature": 0, "stream": i % 2 == 1}))
                 for i, p in enumerate(prompts)]
        for _ in range(500):
            if (await c.get("/health")).json()["in_flight"] == 4:
                break
            await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(*tasks)

    async def scrape(c):
        return await c.get("/metrics")

    answers = _run(app, calls)
    metrics = _run(app, scrape).text
    app.state.batch_worker.close()
    for i, (answer, text) in enumerate(zip(answers, want, strict=True)):
        assert answer.status_code == 200
        if i % 2:
            events = _events(answer.text)
            got = "".join(e["choices"][0]["text"] for e in events[:-1])
        else:
            got = answer.json()["choices"][0]["text"]
        assert got == text, f"request {i}"
    assert app.state.batch_worker.runner.largest_batch >= 2
    mean = float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("speculators_mean_batch_size ")))
    assert mean > 1.0 and "speculators_requests_running 0.0" in metrics
