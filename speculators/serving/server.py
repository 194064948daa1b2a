"""OpenAI-compatible HTTP server over one `Engine`: `/v1/completions`, `/v1/chat/completions` (both with SSE
streaming and log-probabilities), `/v1/models`, `/health` and Prometheus `/metrics`.

`create_app(engine, config, api_key=None)` returns a FastAPI app (`config`: the recipe's `ServeConfig`, the same
settings as the CLI flags); `run_server(app, host, port)` serves it with uvicorn (127.0.0.1 by default).

What a request goes through:
1. `http_guard.RequestGuard`, before any body is read: the API key (401 + `WWW-Authenticate`; `/health` and
   `/metrics` stay open, as in vLLM; `/openapi.json` needs the key too), admission (more than
   `max_concurrent_requests` in flight: 429 + `Retry-After`) and the body limit (`max_request_bytes`: 413).
   `/admin/draft-revision` (GET: the revisions and their acceptance; POST {"path": DIR} or {"rollback": true}: swap
   the draft revision at the next cycle boundary, no restart, no request dropped: runtime/revisions.py) needs the
   key too.
2. Parsing, validation and tokenizing run in a worker thread (`asyncio.to_thread`), never on the event loop, after a
   cheap length check (a prompt with more characters than `max_prompt_tokens` tokens can hold is refused without
   tokenizing); so `/health` keeps answering whatever the bodies. Bad requests get a 4xx in OpenAI's error shape
   (`openai_api.py`) with one clear line and never disturb the server.
3. The `batching.BatchWorker` thread runs the request: up to `max_batch_size` requests share each target forward.
   Without `max_tokens`, a request may generate `max_new_tokens` or what still fits in the context, whichever is
   less; an explicit `max_tokens` that does not fit is a 400 naming it.
4. A client that disconnects — streaming or not — stops its request at the next step and frees its slot; it is
   counted as status 499 in `/metrics`. An unexpected failure inside generation is a 500 for that request only.

Not here: n > 1, tools / function calling, penalties, echo, JSON mode (all refused with a 400 naming the field).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request  # module level: FastAPI resolves handler annotations by name

from speculators.core.config import ServeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.runtime.batching import BatchWorker
from speculators.runtime.engine import Engine
from speculators.runtime.requests import GenerateOutput, StreamChunk
from speculators.serving import openai_api as api
from speculators.serving.admin_routes import add_revision_routes
from speculators.serving.http_guard import RequestGuard
from speculators.serving.openai_api import APIError
from speculators.serving.server_metrics import CLIENT_GONE, Admission, ServerMetrics

OPEN_PATHS = frozenset({"/health", "/metrics"})
GENERATION_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
_GONE = object()  # put on a request's queue when its client disconnects


@dataclass
class Prepared:
    """A validated request, tokenized."""

    kind: str  # "completion" | "chat"
    ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def resolve_limits(engine: Engine, config: ServeConfig) -> int:
    """The longest prompt accepted (tokens); SpeculatorsError when the settings contradict the model's context."""
    config.validate()
    context = engine.max_len
    if config.max_prompt_tokens is None:
        return context - 1
    if config.max_prompt_tokens >= context:
        raise SpeculatorsError(f"serve.max_prompt_tokens={config.max_prompt_tokens} leaves no room to generate in "
                               f"the model's {context}-token context; use at most {context - 1} (or leave it unset)")
    return config.max_prompt_tokens


class _Service:
    """The app's state and request handling (routes in `create_app`)."""

    def __init__(self, engine: Engine, config: ServeConfig, model_name: str | None) -> None:
        self.engine, self.config = engine, config
        self.max_prompt_tokens = resolve_limits(engine, config)
        self.name = model_name or engine.target.cfg.name_or_path.rstrip("/").split("/")[-1]
        self.accepted_names = {self.name, engine.target.cfg.name_or_path}
        self.metrics = ServerMetrics()
        self.admission = Admission(config.max_concurrent_requests, self.metrics)
        self.worker = BatchWorker(engine, config.max_batch_size)
        self.text_of = api.TokenText(engine.tokenizer)
        # a prompt of more characters cannot fit in max_prompt_tokens tokens (x4: normalisers may merge characters)
        longest = max((len(t) for t in engine.tokenizer.get_vocab()), default=16)
        self.max_prompt_chars = 4 * longest * self.max_prompt_tokens

    # ---- preparing (worker thread) ------------------------------------------------------------------------------
    def prepare(self, kind: str, body: bytes) -> Prepared:
        req = api.parse_request(body, api.ChatRequest if kind == "chat" else api.CompletionRequest)
        if req.model is not None and req.model not in self.accepted_names:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{self.name}'", "model",
                           "model_not_found")
        prompt, param = self._prompt(kind, req)
        try:
            ids = self.engine.encode(prompt)
        except SpeculatorsError as exc:
            raise APIError(400, str(exc), param) from None
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most "
                                f"{self.max_prompt_tokens}", param, "context_length_exceeded")
        params = self._params(kind, req, len(ids))
        try:
            self.engine.check_request(ids, params)
        except SpeculatorsError as exc:
            raise APIError(400, str(exc), param) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Prepared(kind, ids, params, req.stream, include_usage)

    def _prompt(self, kind: str, req: Any) -> tuple[Any, str]:
        if kind == "chat":
            if not req.messages:
                raise APIError(400, "messages is empty; send at least one message", "messages")
            if req.messages[-1].role == "assistant":
                raise APIError(400, "the last message is the assistant's; end with a user (or tool) message",
                               "messages")
            if any(m.tool_calls for m in req.messages):
                raise APIError(400, "messages with tool_calls are not supported (no function calling here)",
                               "messages", "unsupported_parameter")
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            return messages, "messages"
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if prompt == "" or prompt == []:
            raise APIError(400, "the prompt is empty", "prompt")
        self._check_chars(len(prompt), "prompt")
        return prompt, "prompt"

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {chars} characters, more than {self.max_prompt_tokens} tokens can "
                                f"hold; this server accepts at most {self.max_prompt_tokens} tokens", param,
                           "context_length_exceeded")

    def _params(self, kind: str, req: Any, prompt_tokens: int) -> SamplingParams:
        room = self.engine.max_len - prompt_tokens + 1  # new tokens that still fit in the context
        cap = self.config.max_new_tokens
        given = req.max_completion_tokens if kind == "chat" and req.max_completion_tokens is not None \
            else req.max_tokens
        name = "max_completion_tokens" if kind == "chat" and req.max_completion_tokens is not None else "max_tokens"
        if given is None:
            max_tokens = min(cap, room, DEFAULT_COMPLETION_TOKENS if kind == "completion" else cap)
        elif given > cap:
            raise APIError(400, f"{name}={given} exceeds this server's limit of {cap}", name, "invalid_value")
        elif given > room:
            raise APIError(400, f"{name}={given} does not fit: the prompt has {prompt_tokens} tokens and the context "
                                f"holds {self.engine.max_len}; lower {name} to at most {room}", name,
                           "context_length_exceeded")
        else:
            max_tokens = given
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None
                                else req.temperature, top_k=top_k, top_p=1.0 if req.top_p is None else req.top_p,
                                seed=req.seed, stop=api.stop_list(req.stop), logprobs=api.logprobs_wanted(req))
        try:
            params.validate()
        except ValueError as exc:
            message = str(exc).replace("max_new_tokens", name)
            raise APIError(400, message, message.split()[0], "invalid_value") from None
        return params

    # ---- running (event loop) -----------------------------------------------------------------------------------
    def submit(self, p: Prepared, receive: Callable[[], Any]) -> tuple[asyncio.Queue, threading.Event, asyncio.Task]:
        """Hand a request to the batch worker. Its chunks, then None (done) or an exception, arrive on the queue;
        `_GONE` arrives when the client disconnects (the returned task watches for that)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                cancel.set()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait(_GONE)

        self.worker.submit(p.ids, p.params, put, cancel, text_deltas=p.stream)
        return queue, cancel, asyncio.ensure_future(watch())

    async def respond(self, request: Request, path: str) -> Any:
        from fastapi.responses import JSONResponse, StreamingResponse

        p = await asyncio.to_thread(self.prepare, GENERATION_PATHS[path], await request.body())
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if p.stream:
            return StreamingResponse(self._sse(p, path, rid, created, t0, request.receive),
                                     media_type="text/event-stream")
        queue, cancel, watcher = self.submit(p, request.receive)
        out: GenerateOutput | None = None
        try:
            while (item := await queue.get()) is not None:
                if item is _GONE:
                    self.metrics.count(path, CLIENT_GONE)
                    return JSONResponse(api.error_body("the client went away", "client_closed_request"),
                                        status_code=CLIENT_GONE)
                if isinstance(item, BaseException):  # one failed request must not take the server down
                    raise APIError(500, f"generation failed: {type(item).__name__}: {item}", kind="server_error")
                out = item.output or out
        finally:
            cancel.set()  # stops the request if it is still running (client gone, or an error)
            watcher.cancel()
        if out is None:
            raise APIError(500, "generation ended without an output", kind="server_error")
        self.metrics.observe(out, self.engine, time.perf_counter() - t0)
        self.metrics.count(path, 200)
        return JSONResponse(api.final_body(p.kind, rid, created, self.name, out, self.text_of))

    async def _sse(self, p: Prepared, path: str, rid: str, created: int, t0: float,
                   receive: Callable[[], Any]) -> AsyncIterator[str]:
        queue, cancel, watcher = self.submit(p, receive)
        status = CLIENT_GONE  # unless the stream reaches its end (or fails)
        try:
            if p.kind == "chat":
                yield api.sse_line(api.chunk_body(p.kind, rid, created, self.name, {"role": "assistant",
                                                                                    "content": ""}, None))
            while (item := await queue.get()) is not None:
                if item is _GONE:
                    return
                if isinstance(item, BaseException):
                    status = 500
                    yield api.sse_line(api.error_body(f"generation failed: {type(item).__name__}: {item}",
                                                      "server_error"))
                    return
                for line in self._chunk_lines(p, rid, created, item, t0):
                    yield line
            yield "data: [DONE]\n\n"
            status = 200
        finally:
            cancel.set()
            watcher.cancel()
            self.metrics.count(path, status)

    def _chunk_lines(self, p: Prepared, rid: str, created: int, chunk: StreamChunk, t0: float) -> list[str]:
        lines = []
        lps = None
        if chunk.logprobs:
            lps = (api.chat_logprobs if p.kind == "chat" else api.completion_logprobs)(chunk.logprobs, self.text_of)
        if chunk.text or lps:
            delta = {"content": chunk.text} if p.kind == "chat" else chunk.text
            lines.append(api.sse_line(api.chunk_body(p.kind, rid, created, self.name, delta, None, lps)))
        if chunk.output is not None:
            out = chunk.output
            lines.append(api.sse_line(api.chunk_body(p.kind, rid, created, self.name, {} if p.kind == "chat" else "",
                                                     out.stats.finish_reason)))
            if p.include_usage:
                lines.append(api.sse_line({"id": rid, "object": api.object_name(p.kind, True), "created": created,
                                           "model": self.name, "choices": [], "usage": api.usage(out)}))
            self.metrics.observe(out, self.engine, time.perf_counter() - t0)
        return lines

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "drafter": self.engine.info.name,
                "in_flight": self.admission.in_flight, "running": len(self.worker.runner.running),
                "max_batch_size": self.config.max_batch_size,
                "max_concurrent_requests": self.config.max_concurrent_requests}


def create_app(engine: Engine, config: ServeConfig | None = None, api_key: str | None = None,
               model_name: str | None = None) -> Any:
    """The FastAPI app serving `engine` (see the module docstring). SpeculatorsError for contradictory settings."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException

    svc = _Service(engine, config or ServeConfig(), model_name)
    app = FastAPI(title="speculators runtime", docs_url=None, redoc_url=None)
    app.state.batch_worker = svc.worker  # `worker.close()` stops it (tests; the thread is a daemon otherwise)
    app.state.service = svc
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=svc.config.max_request_bytes,
                       open_paths=OPEN_PATHS, generation_paths=frozenset(GENERATION_PATHS), admission=svc.admission,
                       on_reject=svc.metrics.count)

    def answer(request: Request, err: APIError) -> JSONResponse:
        svc.metrics.count(request.url.path, err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods: the same error shape
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return answer(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)  # a bug must still answer in the error shape (and is logged by uvicorn)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, APIError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}",
                                        kind="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return svc.health()

    @app.get("/metrics")
    async def prometheus() -> Any:
        runner = svc.worker.runner
        svc.metrics.running.set(len(runner.running))
        svc.metrics.batch_size.set(runner.batched_requests / runner.steps if runner.steps else 0.0)
        svc.metrics.cancelled.set(runner.cancelled)
        svc.metrics.cancelled_tokens.set(runner.cancelled_tokens)
        return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": svc.name, "object": "model", "created": 0,
                                            "owned_by": "speculators", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await svc.respond(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await svc.respond(request, "/v1/chat/completions")

    add_revision_routes(app, engine, svc.metrics.count)
    return app


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
