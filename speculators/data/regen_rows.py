"""Row bookkeeping of `speculators regenerate`, the same for every backend: which rows are done, which must be tried
again, which can never be regenerated — kept on disk so that no row is ever lost between runs.

Every prepared row ends a run in one of three states:
- `complete`: regenerated (its new conversation is kept);
- `rejected`: this row can never be regenerated, and trying again gives the same answer (its prompt is longer than
  `data.max_length`, the chat template cannot render it, the server refuses its request as invalid);
- `failed`: it did not work this time (server error, timeout, refused connection, a malformed answer): it stays
  pending and every later run tries it again.
Rows not yet tried are pending too. `RowState` walks one conversation turn by turn, asking its backend for each
assistant turn to rewrite, and ends as a `RowResult`; `PartialStore` keeps the results in `regenerated.partial/`, one
`part-AAAAAAAA-BBBBBBBB.jsonl` per chunk of rows (written atomically after each chunk, so an interrupted run resumes),
tied to the stage's inputs hash (other inputs: the store starts over).

Not here: generating (the backends), re-encoding the rows, the stage's policy (regenerate.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.core.atomic import write_text_atomic
from speculators.data import artifacts
from speculators.data.schemas import Conversation

COMPLETE, REJECTED, FAILED = "complete", "rejected", "failed"


@dataclass
class RowResult:
    index: int
    id: str
    status: str  # COMPLETE | REJECTED | FAILED
    conversation: str | None = None
    error: str | None = None
    stats: dict = field(default_factory=dict)
    attempts: int = 1  # runs that tried this row

    @property
    def done(self) -> bool:
        """Nothing more to try: regenerated, or it never can be."""
        return self.status in (COMPLETE, REJECTED)

    def to_json(self) -> str:
        return json.dumps(vars(self), ensure_ascii=False)


@dataclass
class Turn:
    """One generated answer."""

    text: str
    finished: bool  # stopped on an end-of-turn token (not max tokens / another special token)
    tokens: int
    reasoning: str | None = None
    retokenized_same: bool | None = None  # local backend: decode -> encode gives back the generated ids


class RowFailed(Exception):
    """A row that could not be regenerated this time (one-line reason); `permanent`: trying again gives the same
    answer (the row is rejected, not retried)."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


# ----------------------------------------------------------------------------------------------------------------
# turn-by-turn driver (backend-independent)


class RowState:
    """Walks one conversation, asking for a generation at each assistant turn to rewrite."""

    def __init__(self, index: int, conv: Conversation, temperature: float = 0.0) -> None:
        self.index, self.conv, self.temperature = index, conv, temperature
        self.history: list[dict] = []
        self.pos = 0
        self.done = False
        self.failed: str | None = None
        self.permanent = False  # the failure is the row's own (it is rejected, not retried)
        self.stats = {"turns": 0, "unfinished": 0, "kept_tool_turns": 0, "generated_tokens": 0,
                      "retokenization_mismatch": 0, "cut_at_max_length": 0}
        self.completion: str | None = None
        if conv.is_chat:
            self._advance()

    def _advance(self) -> None:
        msgs = self.conv.messages
        while self.pos < len(msgs):
            m = msgs[self.pos]
            if m["role"] == "assistant" and not m.get("tool_calls"):
                return  # generation needed here
            if m["role"] == "assistant":
                self.stats["kept_tool_turns"] += 1
            self.history.append(dict(m))
            self.pos += 1
        if self.history and self.history[-1]["role"] != "assistant":
            return  # a final answer is needed
        self.done = True

    @property
    def needs_generation(self) -> bool:
        return not self.done and self.failed is None

    def accept(self, turn: Turn) -> None:
        self.stats["turns"] += 1
        self.stats["generated_tokens"] += turn.tokens
        self.stats["unfinished"] += int(not turn.finished)
        self.stats["retokenization_mismatch"] += int(turn.retokenized_same is False)
        if not self.conv.is_chat:
            self.completion = turn.text
            self.done = True
            return
        msg: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if turn.reasoning:
            msg["reasoning_content"] = turn.reasoning
        self.history.append(msg)
        if self.pos < len(self.conv.messages):
            self.pos += 1
            self._advance()
        else:
            self.done = True

    def fail(self, reason: str, permanent: bool = False) -> None:
        self.failed, self.permanent = reason, permanent

    def cut(self) -> None:
        """The prompt no longer fits data.max_length: keep what was regenerated so far."""
        if self.stats["turns"] == 0:
            self.fail("the prompt is longer than data.max_length (nothing left to generate)", permanent=True)
            return
        while self.history and self.history[-1]["role"] != "assistant":
            self.history.pop()
        self.stats["cut_at_max_length"] += 1
        self.done = True

    def result(self) -> RowResult:
        if self.failed:
            return RowResult(self.index, self.conv.id, REJECTED if self.permanent else FAILED, error=self.failed,
                             stats=self.stats)
        if self.conv.is_chat:
            out = Conversation(id=self.conv.id, messages=self.history, tools=self.conv.tools)
        else:
            out = Conversation(id=self.conv.id, prompt=self.conv.prompt, completion=self.completion)
        return RowResult(self.index, self.conv.id, COMPLETE, conversation=out.to_json(), stats=self.stats)


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class PartialStore:
    """Results of every row so far, in `<output>.partial/` (see the module docstring)."""

    def __init__(self, out_dir: Path, inputs_hash: str, inputs: dict, n_rows: int, chunk: int, force: bool) -> None:
        self.dir = Path(out_dir).with_name(Path(out_dir).name + ".partial")
        self.chunks = chunks(n_rows, chunk)
        artifacts.partial_dir(self.dir, inputs_hash, inputs, force)
        self.results: dict[int, RowResult] = {}
        for a, b in self.chunks:
            self.results.update(self._read(a, b))

    def _path(self, a: int, b: int) -> Path:
        return self.dir / f"part-{a:08d}-{b:08d}.jsonl"

    def _read(self, a: int, b: int) -> dict[int, RowResult]:
        path = self._path(a, b)
        if not path.is_file():
            return {}
        out = {}
        for line in path.read_text().splitlines():
            try:
                res = RowResult(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                return {}  # unreadable (or written by another version): redo the chunk
            out[res.index] = res
        return out

    def todo(self, a: int, b: int) -> list[int]:
        """Rows of a chunk still to try: never tried, or failed before."""
        return [i for i in range(a, b) if i not in self.results or not self.results[i].done]

    def pending(self) -> int:
        return sum(len(self.todo(a, b)) for a, b in self.chunks)

    def record(self, a: int, b: int, new: list[RowResult]) -> None:
        """Keep this run's results of chunk [a, b) (attempts counted across runs) and write the chunk atomically."""
        for res in new:
            old = self.results.get(res.index)
            res.attempts = (old.attempts + 1) if old is not None else 1
            self.results[res.index] = res
        write_text_atomic(self._path(a, b),
                          "".join(self.results[i].to_json() + "\n" for i in range(a, b) if i in self.results))

    def by_status(self, status: str) -> list[RowResult]:
        return [self.results[i] for i in sorted(self.results) if self.results[i].status == status]

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
