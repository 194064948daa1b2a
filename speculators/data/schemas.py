"""Conversation sources and schemas: read rows from a hub dataset or a local file, normalise them to one shape.

Sources (`DataSource.path`): a local `.jsonl` / `.json` / `.parquet` / `.arrow` file, a directory written by
`datasets.save_to_disk`, or a `datasets` hub id (`org/name`, loaded with `datasets.load_dataset`).
Schemas (`DataSource.schema`, or `auto` to detect per row):
- `messages`: OpenAI chat rows `{"messages": [{"role", "content", "tool_calls"?, "reasoning_content"?, ...}],
  "tools"?: [...]}`; content may be a string or a list of `{"type": "text", "text": ...}` parts.
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system"|"tool"..., "value": str}]}`.
- `prompt_completion`: `{"prompt": str, "completion": str}` (raw text, no chat template, like TRL's standard
  format) or `{"prompt": [messages], "completion": [messages]}` (conversational).

Every row becomes a `Conversation` or a `RowError` carrying the row id and one-line reason; this module decides
nothing about what to do with bad rows (prepare does) and does not tokenize.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.hashing import sha256_file

ROLES = ("system", "user", "assistant", "tool")
# message keys passed through to chat templates (anything else is dropped)
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "tool": "tool",
    "function": "tool", "observation": "tool", "ipython": "tool",
}
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# a row regenerated at several temperatures (data.regenerate.temperature: [..]) is kept once per temperature, as
# "<row id>@T=<temperature>"; the copies share one source row (one side of the train / val split)
COPY_MARK = "@T="


def copy_id(row_id: str, temperature: float) -> str:
    """The id of `row_id`'s copy regenerated at `temperature`."""
    return f"{row_id}{COPY_MARK}{temperature:g}"


def source_row_id(row_id: str) -> str:
    """The source row of an id written by `copy_id` (any other id is its own source)."""
    head, mark, tail = row_id.rpartition(COPY_MARK)
    if not mark:
        return row_id
    try:
        float(tail)
    except ValueError:
        return row_id
    return head


@dataclass
class Conversation:
    """One normalised training row: chat `messages` (+ `tools`), or a raw `prompt` / `completion` pair."""

    id: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: str | None = None
    completion: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def to_json(self) -> str:
        data: dict[str, Any] = {"messages": self.messages} if self.is_chat else \
            {"prompt": self.prompt, "completion": self.completion}
        if self.tools:
            data["tools"] = self.tools
        return json.dumps(data, ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, row_id: str, text: str) -> Conversation:
        data = json.loads(text)
        return cls(id=row_id, messages=data.get("messages"), tools=data.get("tools"), prompt=data.get("prompt"),
                   completion=data.get("completion"))


@dataclass
class RowError:
    """A malformed row: its id and what is wrong with it (one line)."""

    id: str
    reason: str


@dataclass
class SourceInfo:
    """What was read from one source (for the manifest)."""

    path: str
    split: str
    kind: str  # jsonl | json | parquet | arrow | disk | hub
    fingerprint: str  # sha256 of the local file(s), or the hub dataset's fingerprint
    rows_read: int = 0
    schemas: dict[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# reading


def source_kind(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        return "disk"
    if p.is_file():
        if p.suffix not in _LOCAL_SUFFIXES:
            raise SpeculatorsError(f"data source {path}: unsupported file type {p.suffix!r}; use one of "
                                   f"{', '.join(_LOCAL_SUFFIXES)} or a datasets directory")
        return p.suffix.lstrip(".")
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or any(path.endswith(s) for s in _LOCAL_SUFFIXES):
        raise SpeculatorsError(f"data source not found: {path} (no such file; a hub dataset id looks like 'org/name')")
    return "hub"


def source_fingerprint(path: str, split: str) -> str:
    """Cheap identity of a source: content hash of local files; `hub:<id>:<split>` for hub datasets."""
    kind = source_kind(path)
    p = Path(path)
    if kind == "hub":
        return f"hub:{path}:{split}"
    if kind == "disk":
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(str(f.relative_to(p)).encode())
            h.update(sha256_file(f).encode())
        return h.hexdigest()
    return sha256_file(p)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("r", encoding="utf-8", errors="strict") as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path.name}:{lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    yield f"{path.name}:{lineno}", RowError(f"{path.name}:{lineno}", f"not valid JSON ({exc.msg})")
        except UnicodeDecodeError as exc:
            raise SpeculatorsError(f"data source {path} is not UTF-8 text ({exc.reason}); convert it") from None


def _iter_dataset(ds: Any, name: str) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(ds):
        yield f"{name}:{i}", row


def iter_source(path: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield `(location, raw_row)` for every row of a source (raw_row is a RowError for undecodable lines)."""
    kind = source_kind(path)
    p = Path(path)
    if kind == "jsonl":
        yield from _iter_jsonl(p)
        return
    if kind == "json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpeculatorsError(f"data source {path} is not valid JSON ({exc}); use a list of rows or jsonl") \
                from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise SpeculatorsError(f"data source {path}: expected a JSON list of rows, got {type(data).__name__}")
        for i, row in enumerate(data):
            yield f"{p.name}:{i}", row
        return
    import datasets

    try:
        if kind == "parquet":
            ds = datasets.Dataset.from_parquet(str(p))
        elif kind == "arrow":
            ds = datasets.Dataset.from_file(str(p))
        elif kind == "disk":
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise SpeculatorsError(f"data source {path} has no split {split!r} (splits: {list(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, split=split)
    except SpeculatorsError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; report one line
        raise SpeculatorsError(f"cannot read data source {path} (split {split}): "
                               f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
    yield from _iter_dataset(ds, p.name if kind != "hub" else path)


# ----------------------------------------------------------------------------------------------------------------
# schemas


def detect_schema(row: dict) -> str | None:
    if "messages" in row:
        msgs = row["messages"]
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and "from" in msgs[0]:
            return "sharegpt"
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    return None


def _text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")


def _clean_message(msg: Any, i: int) -> dict:
    if not isinstance(msg, dict):
        raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}] has role {role!r}; expected one of {list(ROLES)}")
    out = {k: msg[k] for k in _MESSAGE_KEYS if k in msg and msg[k] is not None}
    out["content"] = _text_content(msg.get("content"), f"messages[{i}]")
    if out["content"] is None:
        if role != "assistant" or not msg.get("tool_calls"):
            raise ValueError(f"messages[{i}] ({role}) has no content")
        out["content"] = ""
    if "tool_calls" in out and not isinstance(out["tool_calls"], list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    return out


def _sharegpt_messages(turns: Any) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise ValueError("'conversations' must be a non-empty list of {from, value} turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ValueError(f"conversations[{i}] must be an object with 'from' and 'value'")
        role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ValueError(f"conversations[{i}] has unknown speaker {turn['from']!r}")
        if not isinstance(turn["value"], str):
            raise ValueError(f"conversations[{i}].value must be a string")
        out.append({"role": role, "content": turn["value"]})
    return out


def check_messages(messages: list[dict], *, require_answer: bool, allow_empty_answer: bool = False) -> None:
    """Structural checks shared by prepare and regenerate (raise ValueError with the reason)."""
    if not messages:
        raise ValueError("the conversation has no messages")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls") and \
                not allow_empty_answer:
            raise ValueError(f"messages[{i}] is an empty assistant turn")
    if require_answer and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn to train on")
    if all(m["role"] == "system" for m in messages):
        raise ValueError("the conversation has only system messages")


def normalize_row(row_id: str, raw: Any, schema: str, *, require_answer: bool = True) -> Conversation | RowError:
    """Turn one raw row into a Conversation, or a RowError saying why it cannot be used."""
    if isinstance(raw, RowError):
        return raw
    if not isinstance(raw, dict):
        return RowError(row_id, f"a row must be a JSON object, got {type(raw).__name__}")
    kind = detect_schema(raw) if schema == "auto" else schema
    try:
        if kind is None:
            raise ValueError("unknown schema: expected 'messages', 'conversations' or 'prompt'+'completion' keys")
        tools = raw.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be a list of tool definitions")
        if kind == "messages":
            msgs = raw.get("messages")
            if not isinstance(msgs, list):
                raise ValueError("'messages' must be a list")
            messages = [_clean_message(m, i) for i, m in enumerate(msgs)]
        elif kind == "sharegpt":
            messages = _sharegpt_messages(raw.get("conversations", raw.get("messages")))
        else:
            prompt, completion = raw.get("prompt"), raw.get("completion")
            if isinstance(prompt, str) and isinstance(completion, str):
                if not prompt:
                    raise ValueError("'prompt' is empty")
                if not completion.strip() and require_answer:
                    raise ValueError("'completion' is empty")
                return Conversation(id=row_id, prompt=prompt, completion=completion)
            if isinstance(prompt, list) and isinstance(completion, list):
                messages = [_clean_message(m, i) for i, m in enumerate(prompt + completion)]
            else:
                raise ValueError("'prompt' and 'completion' must both be strings or both be message lists")
        check_messages(messages, require_answer=require_answer)
    except ValueError as exc:
        return RowError(row_id, str(exc))
    return Conversation(id=row_id, messages=messages, tools=tools or None)


def row_id_of(raw: Any, location: str) -> str:
    if isinstance(raw, dict) and isinstance(raw.get("id"), (str, int)) and not isinstance(raw.get("id"), bool):
        return str(raw["id"])
    return location
