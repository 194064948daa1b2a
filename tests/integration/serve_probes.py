"""Bad requests a hostile or careless client sends to `speculators serve`, and what counts as handling one well.

`probes(key)` lists them (malformed bodies, wrong types, unsupported OpenAI fields, out-of-range values, limits, auth,
routing); `run_probes(url, key)` sends each over a fresh HTTP/1.1 connection and returns one `ProbeResult` per
probe. A probe is handled when the answer has the expected status, OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` (code a string or null) with a one-line message, the headers the
status calls for (`WWW-Authenticate` on 401, `Retry-After` on 429), and `/health` still answers afterwards. The
lenient reading (`strict=False`, for comparing with older servers) asks only for a 4xx of the right kind (any 4xx
where a 400 is expected), an `{"error": {"message"}}` body with one line, and a server that still answers.

Used by tests/integration/test_serve_abuse.py; also runnable against any server for a report:
    python -m tests.integration.serve_probes http://127.0.0.1:8000 KEY
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import dataclass, field
from urllib.parse import urlparse

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@dataclass
class Probe:
    name: str
    path: str
    body: bytes | dict | None
    status: int  # the right answer
    method: str = "POST"
    auth: bool = True  # send the right key
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ProbeResult:
    probe: Probe
    status: int
    handled: bool
    why: str


def _c(**kw: object) -> dict:
    return {"prompt": "def f(x):", "max_tokens": 4, **kw}


def _h(**kw: object) -> dict:
    return {"messages": MSG, "max_tokens": 4, **kw}


def probes() -> list[Probe]:
    p = [Probe(f"malformed body {b!r:.20}", COMP, b, 400) for b in
         (b"{", b"{not json", b"[1, 2]", b'"text"', b"null", b"", b'{"prompt": "x",}')]
    p += [Probe("invalid UTF-8", COMP, b'{"prompt": "\xff\xfe"}', 400),
          Probe("lone surrogate prompt", COMP, b'{"prompt": "\\ud800"}', 400),
          Probe("lone surrogate chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400),
          Probe("lone surrogate stop", COMP, b'{"prompt": "x", "stop": ["\\ud800"]}', 400),
          Probe("integer of 5000 digits", COMP, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
          Probe("nested 100000 deep", COMP, b"[" * 100000 + b"]" * 100000, 400)]
    wrong = {"max_tokens": [True, "5", 1.5, -1, 0, 10**9], "temperature": ["hot", -1, True],
             "top_p": [0, 1.5, "x"], "top_k": [-5, "a", 1.5], "stream": ["yes", 1], "seed": [2**70, -(2**70), "x", 1.5],
             "stop": [["a", "b", "c", "d", "e"], "", [1]], "n": [2, 0, "1"], "model": ["gpt-4", 123],
             "logprobs": [6, -1, "x"], "stream_options": ["x", {"include_usage": "yes"}]}
    p += [Probe(f"completions {k}={v!r}", COMP, _c(**{k: v}), 404 if (k, v) == ("model", "gpt-4") else 400)
          for k, values in wrong.items() for v in values]
    p += [Probe(f"completions prompt={v!r:.24}", COMP, {"prompt": v, "max_tokens": 4}, 400)
          for v in (123, None, {}, [[1, 2], [3]], [], "", ["a", "b"], [-1], [99999], [True])]
    p += [Probe("streamed seed out of range", COMP, _c(seed=2**70, stream=True), 400),
          Probe("missing prompt", COMP, {"max_tokens": 3}, 400)]
    unsupported = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                   "response_format": {"type": "json_object"}, "presence_penalty": 1.0, "frequency_penalty": 1.0,
                   "logit_bias": {"5": 10}, "functions": [{"name": "f"}], "top_logprobs": 2, "n": 2,
                   "max_tokens": True, "stream": "yes", "foo": 1, "reasoning_effort": "high"}
    p += [Probe(f"chat {k}={v!r:.30}", CHAT, _h(**{k: v}), 400) for k, v in unsupported.items()]
    p += [Probe(f"completions {k}={v!r}", COMP, _c(**{k: v}), 400) for k, v in
          {"echo": True, "best_of": 2, "suffix": "x", "max_completion_tokens": 3, "repetition_penalty": 1.2}.items()]
    p += [Probe("chat top_logprobs=21", CHAT, _h(logprobs=True, top_logprobs=21), 400),
          Probe("chat messages=[]", CHAT, {"messages": []}, 400),
          Probe("chat messages='x'", CHAT, {"messages": "x"}, 400),
          Probe("chat messages=[{}]", CHAT, {"messages": [{}]}, 400),
          Probe("chat role wizard", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
          Probe("chat content 5", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
          Probe("chat assistant last", CHAT, {"messages": [{"role": "assistant", "content": "x"}]}, 400),
          Probe("chat image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
          Probe("chat tool_calls", CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]},
                                                       {"role": "user", "content": "x"}]}, 400)]
    p += [Probe("max_tokens 100000", COMP, _c(max_tokens=100000), 400),
          Probe("prompt of 2000 tokens", COMP, {"prompt": "word " * 2000}, 400),
          Probe("prompt of 300k characters", COMP, {"prompt": "x" * 300_000}, 400),
          Probe("chat of 300k characters", CHAT, {"messages": [{"role": "user", "content": "y " * 150_000}]}, 400),
          Probe("max_tokens past the context", CHAT, {"messages": [{"role": "user", "content": "w " * 600}],
                                                      "max_tokens": 500}, 400),
          Probe("body of 5 MB", COMP, {"prompt": "z" * 5_000_000}, 413)]
    p += [Probe("no key: completions", COMP, _c(), 401, auth=False),
          Probe("no key: chat", CHAT, _h(), 401, auth=False),
          Probe("no key: models", "/v1/models", None, 401, method="GET", auth=False),
          Probe("no key: openapi.json", "/openapi.json", None, 401, method="GET", auth=False),
          Probe("no key, malformed body", COMP, b"{not json", 401, auth=False),
          Probe("no key, schema error", COMP, {"prompt": 5}, 401, auth=False),
          Probe("wrong key", COMP, _c(), 401, auth=False, headers={"Authorization": "Bearer wrong"}),
          Probe("Basic auth", COMP, _c(), 401, auth=False, headers={"Authorization": "Basic dXNlcjpwYXNz"})]
    p += [Probe("GET completions", COMP, None, 405, method="GET"),
          Probe("POST unknown path", "/v1/nothing", _c(), 404),
          Probe("GET unknown path", "/nothing", None, 404, method="GET"),
          Probe("PUT health", "/health", None, 405, method="PUT")]
    return p


def _request(host: str, port: int, probe: Probe, key: str | None) -> tuple[int, dict, bytes]:
    body = probe.body if isinstance(probe.body, bytes) else (b"" if probe.body is None else
                                                             json.dumps(probe.body).encode())
    headers = {"Host": f"{host}:{port}", "Content-Type": "application/json", "Connection": "close",
               **({"Authorization": f"Bearer {key}"} if key and probe.auth else {}), **probe.headers}
    head = f"{probe.method} {probe.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, port), timeout=120) as sock:
        sock.sendall(head.encode())
        try:
            sock.sendall(body)
        except OSError:
            pass  # the server answered (and closed) before the body was sent: read its answer
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    got = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
    if got.get("transfer-encoding") == "chunked":
        payload = _dechunk(payload)
    return int(lines[0].split()[1]) if lines and lines[0] else 0, got, payload


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size or b"0", 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def judge(probe: Probe, status: int, headers: dict, payload: bytes, strict: bool = True) -> tuple[bool, str]:
    """Whether an answer handles the probe well, and why not."""
    right_kind = status == probe.status or (not strict and probe.status == 400 and 400 <= status < 500
                                            and status not in (401, 404, 413, 429))
    if not right_kind:
        return False, f"status {status}, expected {probe.status}: {payload[:160]!r}"
    try:
        err = json.loads(payload)["error"]
        shape = set(err) == {"message", "type", "param", "code"} or not strict
    except (ValueError, KeyError, TypeError):
        return False, f"not OpenAI's error shape: {payload[:160]!r}"
    if not shape or not isinstance(err.get("message"), str) or "\n" in err["message"]:
        return False, f"not OpenAI's error shape / one line: {payload[:160]!r}"
    if not strict:
        return True, err["message"]
    if err["code"] is not None and not isinstance(err["code"], str):
        return False, f"error code {err['code']!r} is not a string (OpenAI's shape)"
    if status == 401 and "www-authenticate" not in headers:
        return False, "401 without WWW-Authenticate"
    if status == 429 and "retry-after" not in headers:
        return False, "429 without Retry-After"
    return True, err["message"]


def run_probes(url: str, key: str | None, strict: bool = True) -> list[ProbeResult]:
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    health = Probe("health", "/health", None, 200, method="GET")
    results = []
    for probe in probes():
        try:
            status, headers, payload = _request(host, port, probe, key)
            handled, why = judge(probe, status, headers, payload, strict)
        except OSError as exc:
            status, handled, why = 0, False, f"connection failed: {exc}"
        if _request(host, port, health, key)[0] != 200:
            handled, why = False, "the server stopped answering /health"
        results.append(ProbeResult(probe, status, handled, why))
    return results


if __name__ == "__main__":
    for strict in (False, True):
        found = run_probes(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, strict)
        bad = [r for r in found if not r.handled]
        for r in bad:
            print(f"BAD{' (strict)' if strict else ''}  {r.probe.name}: {r.why}")
        print(f"{'strict' if strict else 'lenient'}: {len(found)} bad requests tried, {len(found) - len(bad)} "
              f"handled, {len(bad)} handled badly")
