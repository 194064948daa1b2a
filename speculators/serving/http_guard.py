"""`RequestGuard`: the ASGI middleware in front of the OpenAI app — the API key, admission and the body-size limit,
checked before a request body is read or parsed.

- With an API key, every path except the open ones (`/health`, `/metrics`) needs `Authorization: Bearer <key>`;
  otherwise 401 with `WWW-Authenticate: Bearer` — before a byte of the body is read, so an unauthenticated caller
  learns nothing about the schema and costs no parsing.
- A generation request (POST to a generation path) is admitted only while fewer than the limit are in flight
  (`server_metrics.Admission`), else 429 with `Retry-After`; it stays in flight until its answer is complete (or
  its client has gone), so at most `limit` bodies are ever buffered.
- A declared `Content-Length` above `max_body_bytes` gets 413 at once; a chunked body is counted as it arrives and
  refused as soon as it passes the limit. Both answers close the connection (the rest of the body is never read).
- The accepted body (at most `max_body_bytes`) is buffered and handed to the app, after which the app's `receive`
  continues with the client's own messages, so the app still learns of a disconnect (`http.disconnect`).

Not here: request validation (openai_api.py), routes (server.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from speculators.serving.openai_api import APIError
from speculators.serving.server_metrics import Admission

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class RequestGuard:
    """See the module docstring. `on_reject(path, status)` is told of every request refused here."""

    def __init__(self, app: Any, *, api_key: str | None, max_body_bytes: int, open_paths: frozenset[str],
                 generation_paths: frozenset[str], admission: Admission,
                 on_reject: Callable[[str, int], None]) -> None:
        self.app, self.api_key, self.max_body = app, api_key, int(max_body_bytes)
        self.open_paths, self.generation_paths, self.admission = open_paths, generation_paths, admission
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refused = self._check_headers(path, headers)
        if refused is not None:
            await self._reject(send, path, refused)
            return
        if scope.get("method") != "POST" or path not in self.generation_paths:
            await self.app(scope, receive, send)
            return
        if not self.admission.enter():
            a = self.admission
            await self._reject(send, path, APIError(
                429, f"server busy: {a.in_flight} requests in flight (limit {a.limit}); retry later",
                code="rate_limit_exceeded", kind="rate_limit_error", headers={"retry-after": "1",
                                                                               "connection": "close"}))
            return
        try:
            body = await self._read_body(receive, send, path)
            if body is None:
                return
            delivered = False

            async def replay() -> dict:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: the client's disconnect, if it comes

            await self.app(scope, replay, send)
        finally:
            self.admission.leave()

    async def _read_body(self, receive: Receive, send: Send, path: str) -> bytes | None:
        """The whole body (None when it was refused as too large, or the client left before sending it)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body:
                await self._reject(send, path, self._too_large(f"the request body exceeds {self.max_body} bytes"))
                return None
            chunks.append(part)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_headers(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.api_key is not None and path not in self.open_paths:
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not secrets.compare_digest(token.encode("utf-8", "surrogateescape"), self.api_key.encode()):
                return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                code="invalid_api_key", headers={"www-authenticate": 'Bearer realm="speculators"'})
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                return APIError(400, "the Content-Length header is not a number", code="invalid_body",
                                headers={"connection": "close"})
            if length > self.max_body:
                return self._too_large(f"the request body has {length} bytes; this server accepts at most "
                                       f"{self.max_body}")
        return None

    @staticmethod
    def _too_large(message: str) -> APIError:
        return APIError(413, f"{message} (serve.max_request_bytes)", code="request_too_large",
                        headers={"connection": "close"})

    async def _reject(self, send: Send, path: str, err: APIError) -> None:
        self.on_reject(path, err.status)
        payload = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
