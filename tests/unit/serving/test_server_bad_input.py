"""The server against bad and hostile clients, over real HTTP on 127.0.0.1: malformed and unsupported requests get
one clear 4xx in OpenAI's error shape (never a silent 200, never a 500); limits come from one ServeConfig and agree
with the model's context; the API key is checked before a body is read; oversized bodies are refused unread; busy
answers say when to retry; a client that disconnects — streaming or not — frees its slot at once and is counted as
499."""

from __future__ import annotations

import json
import threading

import pytest

from speculators.core.config import ServeConfig
from speculators.core.errors import SpeculatorsError
from speculators.serving import Engine
from speculators.serving.server import create_app
from tests.unit.runtime.runtime_helpers import loaded_target, single_thread  # noqa: F401
from tests.unit.serving.live_server import LiveServer, read_response

CHAT = [{"role": "user", "content": "hello"}]
PROMPT = {"prompt": "x", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=128)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServeConfig(max_prompt_tokens=64, max_new_tokens=32))) as srv:
        yield srv


def _post_raw(srv: LiveServer, path: str, body: bytes, headers: str = "") -> tuple[int, dict, bytes]:
    sock = srv.raw(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    with sock:
        return read_response(sock)


BAD = [  # (path, JSON body or raw bytes, status, param, words in the message)
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 999}, 400, "max_tokens", "exceeds this server's limit of 32"),
    ("/v1/completions", {"prompt": "word " * 80}, 400, "prompt", "this server accepts at most 64"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "batched prompts are not supported"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt", "prompt token ids must be in [0,"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "only n=1"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing required parameter: prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "valid integer, got true"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed", "seed must be an int in"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70, "stream": True}, 400, "seed", "seed must be an int in"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs", "logprobs must be in [0, 5]"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "echo is not implemented"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "only best_of=1"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "penalties"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -1}, 400, "frequency_penalty", "penalties"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 3}}, 400, "logit_bias", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 3}, 400, "max_completion_tokens",
     "Unrecognized request argument supplied: max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty", "Unrecognized"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    ("/v1/completions", b'{"prompt": "\\ud800 x"}', 400, "prompt", "lone surrogate"),
    ("/v1/completions", b'{not json', 400, None, "not valid JSON"),
    ("/v1/completions", b'[1, 2]', 400, None, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", "assistant"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "function calling are not implemented"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "only text output"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 40}, 400, "max_completion_tokens",
     "max_completion_tokens=40 exceeds"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     400, "messages.0.content", "invalid value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content",
     "lone surrogate"),
]


@pytest.mark.parametrize("path, payload, status, param, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_one_clear_error(server: LiveServer, path: str, payload, status: int, param, needle: str):
    if isinstance(payload, bytes):
        code, _, raw = _post_raw(server, path, payload)
        body = json.loads(raw)
    else:
        resp = server.client.post(path, content=json.dumps(payload, ensure_ascii=True),
                                  headers={"content-type": "application/json"})
        code, body = resp.status_code, resp.json()
    assert code == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == (
        "invalid_request_error" if status < 500 else "server_error")
    assert needle in err["message"] and "\n" not in err["message"], err["message"]
    assert err["param"] == param and (err["code"] is None or isinstance(err["code"], str))
    assert server.client.post("/v1/completions", json=PROMPT).status_code == 200  # still serving


@pytest.mark.parametrize("payload", [
    {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "best_of": 1, "echo": False,
     "logit_bias": {}, "user": "me", "top_k": -1, "max_tokens": None},
    {"messages": CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "n": 1,
     "max_completion_tokens": 3, "max_tokens": 20, "logprobs": False, "store": False, "parallel_tool_calls": True},
])
def test_fields_that_ask_for_nothing_are_accepted(server: LiveServer, payload: dict) -> None:
    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    resp = server.client.post(path, json=payload)
    assert resp.status_code == 200, resp.text
    if "max_completion_tokens" in payload:  # honoured (over max_tokens)
        assert resp.json()["usage"]["completion_tokens"] <= 3


def test_defaults_agree_with_the_context(engine: Engine) -> None:
    with pytest.raises(SpeculatorsError, match="max_prompt_tokens=128 leaves no room .* 128-token context"):
        create_app(engine, ServeConfig(max_prompt_tokens=128))
    with LiveServer(create_app(engine, ServeConfig(max_new_tokens=100))) as srv:  # 128-token context
        long_chat = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 5}]
        n_prompt = len(engine.encode(long_chat))
        assert 60 < n_prompt < 127
        ok = srv.client.post("/v1/chat/completions", json={"messages": long_chat, "temperature": 0})
        too_many = srv.client.post("/v1/chat/completions", json={"messages": long_chat, "max_tokens": 90})
    assert ok.status_code == 200, ok.text  # no max_tokens: what fits in the context
    assert ok.json()["usage"]["completion_tokens"] <= 128 - n_prompt + 1
    err = too_many.json()["error"]
    assert too_many.status_code == 400 and err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"lower max_tokens to at most {128 - n_prompt + 1}" in err["message"]
    assert "max_new_tokens" not in err["message"]


def test_oversized_bodies_are_refused_unread(engine: Engine) -> None:
    with LiveServer(create_app(engine, ServeConfig(max_request_bytes=4096))) as srv:
        # a declared 50 MB body: answered before a byte of it is sent
        sock = srv.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 52428800\r\n\r\n")
        with sock:
            status, headers, body = read_response(sock)
        assert status == 413 and headers.get("connection") == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        # a chunked body is counted as it arrives
        sock = srv.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        with sock:
            for _ in range(3):
                sock.sendall(b"800\r\n" + b" " * 0x800 + b"\r\n")
            status, _, _ = read_response(sock)
        assert status == 413
        assert srv.client.post("/v1/completions", json=PROMPT).status_code == 200
        assert srv.metric('speculators_requests_total{endpoint="/v1/completions",status="413"}') == 2.0
        assert srv.health()["in_flight"] == 0


def test_api_key_is_checked_before_the_body(engine: Engine) -> None:
    with LiveServer(create_app(engine, api_key="s3cret")) as srv:
        c = srv.client
        missing = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        wrong = c.post("/v1/completions", json=PROMPT, headers={"Authorization": "Bearer nope"})
        right = c.post("/v1/completions", json=PROMPT, headers={"Authorization": "Bearer s3cret"})
        schema = c.get("/openapi.json")
        health, metrics = c.get("/health"), c.get("/metrics")
        sock = srv.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n")
        with sock:
            huge, _, _ = read_response(sock)
    assert missing.status_code == 401 and wrong.status_code == 401 and huge == 401 and schema.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert wrong.json()["error"]["code"] == "invalid_api_key" and "API key" in wrong.json()["error"]["message"]
    assert right.status_code == 200 and health.status_code == 200 and metrics.status_code == 200


def _hold_requests(engine: Engine, monkeypatch) -> threading.Event:
    """Requests wait inside the batch worker until the returned event is set."""
    release = threading.Event()
    real = engine.request

    def held(*args, **kw):
        release.wait(timeout=60)
        yield from real(*args, **kw)

    monkeypatch.setattr(engine, "request", held)
    return release


def test_busy_answers_say_when_to_retry(engine: Engine, monkeypatch) -> None:
    release = _hold_requests(engine, monkeypatch)
    with LiveServer(create_app(engine, ServeConfig(max_concurrent_requests=1))) as srv:
        first = threading.Thread(target=srv.client.post, args=("/v1/completions",), kwargs={"json": PROMPT})
        first.start()
        srv.wait_until(lambda: srv.health()["in_flight"] == 1)
        busy = srv.client.post("/v1/completions", json=PROMPT)
        release.set()
        first.join()
        metric = srv.metric('speculators_requests_total{endpoint="/v1/completions",status="429"}')
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert "server busy" in busy.json()["error"]["message"] and metric == 1.0


@pytest.fixture(scope="module")
def long_engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=512)


LONG = 480  # tokens a request would generate if nobody stopped it


def test_a_client_that_disconnects_frees_its_slot(long_engine: Engine) -> None:
    body = json.dumps({"prompt": "q", "max_tokens": LONG, "temperature": 0}).encode()
    full = long_engine.generate("q", max_new_tokens=LONG, temperature=0)
    assert full.stats.finish_reason == "length"  # run to the end, it really generates LONG tokens
    with LiveServer(create_app(long_engine, ServeConfig(max_new_tokens=LONG))) as srv:
        for stream in (False, True):
            payload = json.loads(body) | {"stream": stream}
            data = json.dumps(payload).encode()
            sock = srv.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(data) + data)
            srv.wait_until(lambda: srv.health()["running"] == 1)
            sock.close()  # the client goes away mid-generation
            srv.wait_until(lambda: srv.health()["in_flight"] == 0 and srv.health()["running"] == 0)
        runner = srv.app.state.batch_worker.runner
        gone = srv.metric('speculators_requests_total{endpoint="/v1/completions",status="499"}')
        ok = srv.metric('speculators_requests_total{endpoint="/v1/completions",status="200"}')
        after = srv.client.post("/v1/completions", json={"prompt": "q", "max_tokens": 4})
    assert runner.cancelled == 2 and runner.cancelled_tokens < LONG, runner.cancelled_tokens
    assert gone == 2.0 and ok == 0.0  # a dropped request is never counted as answered
    assert after.status_code == 200


def test_context_and_batch_that_do_not_fit_are_refused_at_start(engine: Engine, tiny_llama) -> None:
    """serve.max_model_len sizes each running request's KV cache; more caches than memory holds
    (max_batch_size of them) are refused when the app is made, in one line, before any is allocated."""
    from speculators.runtime.forward.memory import available_bytes
    from speculators.serving.commands import _command_engine

    with pytest.raises(SpeculatorsError, match="serve.max_model_len must be >= 2"):
        ServeConfig(max_model_len=1).validate()
    assert _command_engine(str(tiny_llama), "none", "cpu", "float32", False, max_len=96).max_len == 96
    too_many = available_bytes("cpu") // engine.runner.cache_bytes(engine.max_len) + 2
    with pytest.raises(SpeculatorsError) as exc:
        create_app(engine, ServeConfig(max_batch_size=too_many, max_concurrent_requests=too_many))
    assert "KV cache(s) of 128 tokens" in str(exc.value) and "\n" not in str(exc.value)
