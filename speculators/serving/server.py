"""OpenAI-compatible HTTP server over one `Engine`: `/v1/completions`, `/v1/chat/completions` (both with SSE
streaming), `/v1/models`, `/health` and Prometheus `/metrics`.

`create_app(engine, limits, api_key=None)` returns a FastAPI app (testable in-process with httpx);
`run_server(app, host, port)` serves it with uvicorn (127.0.0.1 by default). Requests run in a
`batching.BatchWorker` thread: up to `max_batch_size` of them share each target forward (continuous batching: a
request joins at the next step and leaves when done), so the event loop keeps answering health checks, metrics and
rejections meanwhile. More than `max_concurrent_requests` requests in flight (running + waiting) get 429; a client
that disconnects stops its request. Bad requests get a 4xx JSON error `{"error": {"message", "type", "param",
"code"}}` with one clear line and never disturb the server; an unexpected failure inside generation is a 500 for
that request only.

With an API key, `/v1/*` needs `Authorization: Bearer <key>` (401 otherwise); `/health` and `/metrics` stay
open, as in vLLM. Not here: n > 1, logprobs, tools / function calling, penalties.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request  # module level: FastAPI resolves handler annotations by name
from pydantic import BaseModel, ConfigDict, Field

from speculators.errors import SpeculatorsError
from speculators.serving.batching import BatchWorker
from speculators.serving.engine import Engine, GenerateOutput, StreamChunk
from speculators.serving.sampling import SamplingParams


@dataclass
class ServerLimits:
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    max_concurrent_requests: int = 4
    max_batch_size: int = 4  # running requests that share one target forward (the rest wait)


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(...)
    max_tokens: int | None = 16  # the OpenAI default for completions


class ChatRequest(_Common):
    messages: list[_Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = None


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_body(message: str, kind: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Metrics:
    """Prometheus metrics in a registry of their own (one per app)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "speculators_"
        self.requests = Counter(p + "requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter(p + "draft_tokens", "Draft tokens verified by the target", registry=r)
        self.accepted_tokens = Counter(p + "accepted_tokens", "Draft tokens accepted", registry=r)
        self.target_calls = Counter(p + "target_calls", "Target verification forwards", registry=r)
        self.tau = Gauge(p + "acceptance_length", "tau: committed tokens per target call since start", registry=r)
        self.per_position = Gauge(p + "per_position_acceptance", "a_k: P(depth k accepted | depths < k accepted)",
                                  ["position"], registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests running or waiting", registry=r)
        self.running = Gauge(p + "requests_running", "Requests in the running batch", registry=r)
        self.batch_size = Gauge(p + "mean_batch_size", "Requests per target forward, mean since start", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram(p + "request_latency_seconds", "End-to-end request latency", registry=r,
                                 buckets=buckets)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to the first generated token", registry=r,
                              buckets=buckets)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Decode seconds per generated token",
                              registry=r, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))

    def observe(self, out: GenerateOutput, engine: Engine, seconds: float) -> None:
        s = out.stats
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.generated_tokens)
        self.draft_tokens.inc(s.acceptance.drafted_tokens)
        self.accepted_tokens.inc(s.acceptance.accepted_tokens)
        self.target_calls.inc(s.acceptance.target_calls)
        self.tau.set(engine.totals.tau)
        for k, a in enumerate(engine.totals.per_position_acceptance, 1):
            self.per_position.labels(position=str(k)).set(a)
        self.latency.observe(seconds)
        self.ttft.observe(s.first_token_seconds)
        if s.generated_tokens:
            self.tpot.observe(s.decode_seconds / s.generated_tokens)


def create_app(engine: Engine, limits: ServerLimits | None = None, api_key: str | None = None,
               model_name: str | None = None) -> Any:
    """The FastAPI app serving `engine` (see the module docstring)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    limits = limits or ServerLimits()
    name = model_name or engine.target.cfg.name_or_path.rstrip("/").split("/")[-1]
    accepted_names = {name, engine.target.cfg.name_or_path}
    metrics = _Metrics()
    worker = BatchWorker(engine, limits.max_batch_size)
    state = {"in_flight": 0}
    app = FastAPI(title="speculators runtime", docs_url=None, redoc_url=None)
    app.state.batch_worker = worker  # `worker.close()` stops it (tests; the thread is a daemon otherwise)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
              endpoint: str = "other") -> JSONResponse:
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        return JSONResponse(_error_body(message, kind, param, status), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"invalid request: {loc or 'body'}: {first.get('msg', 'malformed request')}"
        return error(422, msg, loc or None, endpoint=request.url.path)

    @app.exception_handler(_HTTPError)
    async def _http_error(request: Request, exc: _HTTPError) -> JSONResponse:
        return error(exc.status, exc.message, exc.param, exc.kind, endpoint=request.url.path)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise _HTTPError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             kind="authentication_error")

    def build(req: _Common, prompt: Any, max_tokens: int | None) -> tuple[list[int], SamplingParams]:
        if req.model is not None and req.model not in accepted_names:
            raise _HTTPError(404, f"model {req.model!r} is not served here; this server serves {name!r}", "model",
                             kind="not_found_error")
        if req.n != 1:
            raise _HTTPError(400, f"n={req.n} is not supported; only n=1", "n")
        if max_tokens is None:
            max_tokens = limits.max_new_tokens
        if isinstance(max_tokens, int) and max_tokens > limits.max_new_tokens:
            raise _HTTPError(400, f"max_tokens={max_tokens} exceeds this server's limit of "
                                  f"{limits.max_new_tokens}", "max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        params = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                                top_p=req.top_p, seed=req.seed, stop=stop or None)
        try:
            params.validate()
        except ValueError as exc:
            raise _HTTPError(400, str(exc).replace("max_new_tokens", "max_tokens"),
                             str(exc).split()[0].replace("max_new_tokens", "max_tokens")) from None
        try:
            ids = engine.encode(prompt)
        except SpeculatorsError as exc:
            raise _HTTPError(400, str(exc), "prompt") from None
        if len(ids) > limits.max_prompt_tokens:
            raise _HTTPError(400, f"the prompt has {len(ids)} tokens; this server accepts at most "
                                  f"{limits.max_prompt_tokens}", "prompt")
        try:
            engine.check_request(ids, params)
        except SpeculatorsError as exc:
            raise _HTTPError(400, str(exc)) from None
        return ids, params

    def admit() -> None:
        if state["in_flight"] >= limits.max_concurrent_requests:
            raise _HTTPError(429, f"server busy: {state['in_flight']} requests in flight (limit "
                                  f"{limits.max_concurrent_requests}); retry later", kind="rate_limit_error")
        state["in_flight"] += 1
        metrics.in_flight.set(state["in_flight"])

    def release() -> None:
        state["in_flight"] -= 1
        metrics.in_flight.set(state["in_flight"])

    def submit(ids: list[int], params: SamplingParams, text_deltas: bool) -> tuple[asyncio.Queue, threading.Event]:
        """Hand a request to the batch worker; its chunks, then None (done) or an exception, arrive on the queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                cancel.set()

        worker.submit(ids, params, put, cancel, text_deltas=text_deltas)
        return queue, cancel

    async def respond(kind: str, endpoint: str, ids: list[int], params: SamplingParams, stream: bool,
                      include_usage: bool) -> Any:
        admit()
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not stream:
            queue, cancel = submit(ids, params, text_deltas=False)
            out: GenerateOutput | None = None
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):  # one failed request must not take the server down
                        raise _HTTPError(500, f"generation failed: {type(item).__name__}: {item}",
                                         kind="server_error")
                    out = item.output or out
            finally:
                cancel.set()  # a client that went away stops its request
                release()
            if out is None:
                raise _HTTPError(500, "generation ended without an output", kind="server_error")
            metrics.observe(out, engine, time.perf_counter() - t0)
            metrics.requests.labels(endpoint=endpoint, status="200").inc()
            return JSONResponse(_final_body(kind, rid, created, name, out))
        return StreamingResponse(_sse(kind, endpoint, rid, created, ids, params, include_usage, t0),
                                 media_type="text/event-stream")

    async def _sse(kind: str, endpoint: str, rid: str, created: int, ids: list[int], params: SamplingParams,
                   include_usage: bool, t0: float) -> AsyncIterator[str]:
        queue, cancel = submit(ids, params, text_deltas=True)
        status = "200"
        try:
            if kind == "chat":
                yield _sse_line(_chunk(kind, rid, created, name, {"role": "assistant", "content": ""}, None))
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    status = "500"
                    yield _sse_line(_error_body(f"generation failed: {type(item).__name__}: {item}",
                                                "server_error", None, 500))
                    break
                chunk: StreamChunk = item
                if chunk.text:
                    delta = {"content": chunk.text} if kind == "chat" else chunk.text
                    yield _sse_line(_chunk(kind, rid, created, name, delta, None))
                if chunk.output is not None:
                    out = chunk.output
                    yield _sse_line(_chunk(kind, rid, created, name, {} if kind == "chat" else "",
                                           out.stats.finish_reason))
                    if include_usage:
                        yield _sse_line({"id": rid, "object": _object(kind, True), "created": created,
                                         "model": name, "choices": [], "usage": _usage(out)})
                    metrics.observe(out, engine, time.perf_counter() - t0)
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()
            release()
            metrics.requests.labels(endpoint=endpoint, status=status).inc()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": name, "drafter": engine.info.name, "in_flight": state["in_flight"],
                "running": len(worker.runner.running), "max_batch_size": limits.max_batch_size}

    @app.get("/metrics")
    async def prometheus() -> Any:
        runner = worker.runner
        metrics.running.set(len(runner.running))
        metrics.batch_size.set(runner.batched_requests / runner.steps if runner.steps else 0.0)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "speculators"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_auth(request)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise _HTTPError(400, "batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if prompt == "" or prompt == []:
            raise _HTTPError(400, "the prompt is empty", "prompt")
        ids, params = build(req, prompt, req.max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond("completion", "/v1/completions", ids, params, req.stream, include_usage)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        check_auth(request)
        messages = [m.model_dump() for m in req.messages]
        if messages[-1]["role"] == "assistant":
            raise _HTTPError(400, "the last message is the assistant's; end with a user (or tool) message",
                             "messages")
        ids, params = build(req, messages, req.max_completion_tokens or req.max_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond("chat", "/v1/chat/completions", ids, params, req.stream, include_usage)

    return app


def _object(kind: str, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _usage(out: GenerateOutput) -> dict:
    p, c = out.stats.prompt_tokens, out.stats.generated_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chunk(kind: str, rid: str, created: int, model: str, delta: Any, finish: str | None) -> dict:
    choice = {"index": 0, "delta": delta} if kind == "chat" else {"index": 0, "text": delta, "logprobs": None}
    choice["finish_reason"] = finish
    return {"id": rid, "object": _object(kind, True), "created": created, "model": model, "choices": [choice]}


def _final_body(kind: str, rid: str, created: int, model: str, out: GenerateOutput) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": out.stats.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.stats.finish_reason}
    s = out.stats
    return {"id": rid, "object": _object(kind, False), "created": created, "model": model, "choices": [choice],
            "usage": _usage(out), "speculators": {"drafter": s.drafter, "tau": round(s.tau, 4),
                                                  "target_calls": s.target_calls,
                                                  "per_position_acceptance": [round(a, 4) for a in
                                                                              s.per_position_acceptance]}}


def _sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)

