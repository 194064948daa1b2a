"""A real HTTP server for the server tests: uvicorn serving an app on 127.0.0.1 (an ephemeral port) in a thread of
the test process, so tests talk to it over real sockets (disconnects, chunked bodies, Content-Length) and can
still look at the app's state."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx


class LiveServer:
    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(30)
        worker = getattr(self.app.state, "batch_worker", None)
        if worker is not None:
            worker.close()

    def health(self) -> dict:
        return self.client.get("/health").json()

    def metric(self, line_start: str) -> float:
        """The value of the first /metrics line that starts with `line_start` (0.0 when absent)."""
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith(line_start):
                return float(line.split()[-1])
        return 0.0

    def wait_until(self, predicate: Any, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not predicate():
            if time.time() > deadline:
                raise AssertionError(f"condition not reached in {timeout} s (health: {self.health()})")
            time.sleep(0.02)

    def raw(self, data: bytes) -> socket.socket:
        """A raw connection that has sent `data` (request line, headers, maybe part of a body)."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(data)
        return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    want = int(headers.get("content-length", len(body)))
    while len(body) < want:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return int(lines[0].split()[1]), headers, body
