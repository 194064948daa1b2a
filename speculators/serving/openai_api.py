"""The OpenAI request and response formats of `speculators serve`: strict request models, the one error shape, and
the response bodies (completions, chat completions, SSE chunks, log-probabilities).

Requests: a body is decoded (UTF-8, JSON object) and validated against `CompletionRequest` / `ChatRequest` without
type coercion (`max_tokens: true` or `stream: "yes"` are errors, as in the OpenAI API). A field this server does not
know is refused ("Unrecognized request argument supplied: X"); an OpenAI field it does not implement is accepted only
with the value that asks for nothing (`presence_penalty: 0`, `echo: false`, `tools: []`, `n: 1` ...) and refused
with `code: "unsupported_parameter"` otherwise — never silently ignored. Every string a request carries must be valid
Unicode (a lone surrogate is refused here, before it reaches the tokenizer).

Errors: `APIError(status, message, param, code, kind)` -> `{"error": {"message", "type", "param", "code"}}`, the
OpenAI shape (`code` a string or null). Log-probabilities (`logprobs` on completions, `logprobs` + `top_logprobs` on
chat) come from the target's unfiltered law (see `sampling.SamplingParams.logprobs`).

Not here: HTTP routing, admission and streaming (server.py), auth and body limits (http_guard.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from speculators.runtime.forward.target_rows import TokenLogprob
from speculators.runtime.requests import GenerateOutput

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`
MAX_STOP = 4
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability ~0 (JSON has no -inf)


class APIError(Exception):
    """A request answered with an HTTP error in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------------------------
# request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0 = off
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # OpenAI fields this server does not implement: accepted only with the value that asks for nothing
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


# field -> (the values that ask for nothing, what to say)
_NOOP: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "only n=1"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1"),
    "echo": (lambda v: not v, "echo is not implemented"),
    "suffix": (lambda v: not v, "suffix (insertion) is not implemented"),
    "presence_penalty": (lambda v: not v, "penalties are not implemented"),
    "frequency_penalty": (lambda v: not v, "penalties are not implemented"),
    "logit_bias": (lambda v: not v, "logit_bias is not implemented"),
    "store": (lambda v: not v, "this server stores nothing"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "there is one service tier"),
    "tools": (lambda v: not v, "tools / function calling are not implemented"),
    "functions": (lambda v: not v, "function calling is not implemented"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tools / function calling are not implemented"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calling is not implemented"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "only text output (no JSON mode or schemas)"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output"),
    "audio": (lambda v: v is None, "only text output"),
    "prediction": (lambda v: v is None, "predicted outputs are not implemented"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not implemented"),
    "web_search_options": (lambda v: v is None, "web search is not implemented"),
}


def parse_request(body: bytes, model: type[_Common]) -> Any:
    """Body bytes -> a validated request model, or APIError(400) with one line naming the field."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at position "
                            f"{exc.start})", code="invalid_body") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column "
                            f"{exc.colno})", code="invalid_body") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits, nesting too deep
        raise APIError(400, f"the request body is not valid JSON: {str(exc).splitlines()[0][:120]}",
                       code="invalid_body") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_body")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    for name, (noop, why) in _NOOP.items():
        value = getattr(req, name, None)
        if not noop(value):
            raise APIError(400, f"unsupported parameter: {name}={_short(value)} ({why}; this server accepts "
                                f"{name} only when it asks for nothing)", name, "unsupported_parameter")
    _check_unicode(data)
    return req


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())]
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", ".".join(loc))
    if first.get("type") == "missing":
        return APIError(400, f"missing required parameter: {'.'.join(loc)}", ".".join(loc), "missing_required_parameter")
    # a union reports one error per member type ("str", "list[int]" ...) in the location: name the field only
    path = ".".join(x for x in loc if x not in ("str", "int", "float", "bool") and "[" not in x) or "body"
    got = first.get("input")
    return APIError(400, f"invalid value for '{path}': {first.get('msg', 'invalid')}, got {_short(got)}",
                    path, "invalid_type" if str(first.get("type", "")).endswith("_type") else "invalid_value")


def _check_unicode(value: Any, where: str = "") -> None:
    """Every string must encode as UTF-8 (JSON allows lone surrogates such as \\ud800; tokenizers do not)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"'{where or 'body'}' is not valid Unicode: a lone surrogate "
                                f"(\\u{ord(value[exc.start]):04x}) at character {exc.start}", where or None,
                           "invalid_value") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, where)
            _check_unicode(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, f"{where}.{i}")


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP}", "stop", "invalid_value")
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop", "invalid_value")
    return stops or None


def logprobs_wanted(req: Any) -> int | None:
    """How many alternatives per token the request wants (None: no log-probabilities)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                           "top_logprobs", "invalid_value")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}", "logprobs",
                       "invalid_value")
    return req.logprobs


# ---------------------------------------------------------------------------------------------------------------
# responses


class TokenText:
    """Token id -> (text, UTF-8 bytes) for log-probabilities. A byte-level BPE token that is part of a multi-byte
    character has its exact bytes (its text shows U+FFFD for the incomplete character)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self.cache:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            if self.byte_level and isinstance(piece, str) and all(c in self.byte_of for c in piece):
                raw = bytes(self.byte_of[c] for c in piece)
            else:
                raw = self.tokenizer.decode([int(token_id)]).encode("utf-8")
            self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self.cache[token_id]


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def chat_logprobs(items: list[TokenLogprob], text_of: TokenText) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for it in items:
        tok, raw = text_of(it.token_id)
        top = [{"token": text_of(i)[0], "logprob": _lp(lp), "bytes": text_of(i)[1]} for i, lp in it.top]
        content.append({"token": tok, "logprob": _lp(it.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[TokenLogprob], text_of: TokenText, offset: int = 0) -> dict:
    """Legacy completions format: tokens, token_logprobs, top_logprobs (dict per token), text_offset (characters
    into the generated text, counted from `offset`)."""
    tokens, offsets = [], []
    for it in items:
        offsets.append(offset)
        tok = text_of(it.token_id)[0]
        tokens.append(tok)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [_lp(it.logprob) for it in items],
            "top_logprobs": [{text_of(i)[0]: _lp(lp) for i, lp in it.top} for it in items], "text_offset": offsets}


def object_name(kind: str, chunk: bool) -> str:
    if kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def usage(out: GenerateOutput) -> dict:
    p, c = out.stats.prompt_tokens, out.stats.generated_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chunk_body(kind: str, rid: str, created: int, model: str, delta: Any, finish: str | None,
               logprobs: dict | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "delta": delta, "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": delta, "logprobs": logprobs}
    choice["finish_reason"] = finish
    return {"id": rid, "object": object_name(kind, True), "created": created, "model": model, "choices": [choice]}


def final_body(kind: str, rid: str, created: int, model: str, out: GenerateOutput, text_of: TokenText) -> dict:
    lps = None
    if out.logprobs is not None:
        lps = chat_logprobs(out.logprobs, text_of) if kind == "chat" else completion_logprobs(out.logprobs, text_of)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": lps,
                  "finish_reason": out.stats.finish_reason}
    else:
        choice = {"index": 0, "text": out.text, "logprobs": lps, "finish_reason": out.stats.finish_reason}
    s = out.stats
    return {"id": rid, "object": object_name(kind, False), "created": created, "model": model, "choices": [choice],
            "usage": usage(out), "speculators": {"drafter": s.drafter, "tau": round(s.tau, 4),
                                                 "target_calls": s.target_calls,
                                                 "per_position_acceptance": [round(a, 4) for a in
                                                                             s.per_position_acceptance]}}


def sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
