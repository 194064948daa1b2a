"""The regenerate stage's progress line: rows done of all, the target's generated tokens per second, the time left,
and how long ago the last request finished, refreshed every few seconds by a thread of its own.

Backends feed it as their requests finish (`generated(tokens)`: per request for the engine and OpenAI backends, per
`generate` batch for HF and vLLM), so the line moves within a chunk of rows, and a stall (no request finishing while
the clock runs) reads differently from slow work (requests finishing, at a low rate). The bar counts requests
finished this run, held below the rows of the chunks not yet recorded; the stage sets it to the rows recorded at each
chunk's end (`rows_recorded`). A conversation with several assistant turns makes several requests, so the time left
is measured in requests (one a row for single-turn data). Not here: what is generated, how it is stored
(regenerate.py, regen_rows.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tqdm import tqdm

REFRESH_S = 2.0


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


class RegenProgress:
    """A tqdm line over the stage's rows with tokens/s, time left and the age of the last finished request."""

    def __init__(self, total_rows: int, rows_done: int, *, desc: str = "regenerate", refresh_s: float = REFRESH_S,
                 file: Any = None) -> None:
        self.bar = tqdm(total=total_rows, initial=rows_done, desc=desc, unit=" rows", dynamic_ncols=True, file=file)
        self.total, self.recorded, self.ceiling = total_rows, rows_done, rows_done
        self.tokens = self.requests = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._heartbeat, args=(refresh_s,), daemon=True)
        self.thread.start()

    def chunk_started(self, rows: int) -> None:
        """The next `rows` rows are being generated: the bar may move up to them before they are recorded."""
        with self.lock:
            self.ceiling = min(self.total, self.recorded + rows)

    def generated(self, tokens: int, requests: int = 1) -> None:
        """`requests` requests finished, having generated `tokens` tokens."""
        with self.lock:
            self.tokens += int(tokens)
            self.requests += int(requests)
            self.last = time.monotonic()
            self.bar.n = max(self.bar.n, min(self.ceiling, self.recorded_at_start + self.requests))
            self._refresh()

    def rows_recorded(self, rows_done: int) -> None:
        """The stage recorded a chunk: `rows_done` rows of all are now done."""
        with self.lock:
            self.recorded = self.ceiling = rows_done
            self.bar.n = rows_done
            self._refresh()

    @property
    def recorded_at_start(self) -> int:
        return int(self.bar.initial)

    def postfix(self, now: float | None = None) -> str:
        """'412 tok/s, ~3.2 min left, last request 0.4 s ago' (what is known so far)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.t0, 1e-9)
        parts = [f"{self.tokens / elapsed:.0f} tok/s"]
        if self.requests:
            left = max(self.total - self.recorded_at_start - self.requests, 0) * elapsed / self.requests
            parts.append(f"~{_minutes(left)} left")
            parts.append(f"last request {_minutes(now - self.last)} ago")
        else:
            parts.append(f"no request finished yet ({_minutes(elapsed)})")
        return ", ".join(parts)

    def _refresh(self) -> None:
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.refresh()

    def _heartbeat(self, refresh_s: float) -> None:
        while not self.closed.wait(refresh_s):
            with self.lock:
                self._refresh()

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=5)
        with self.lock:
            self._refresh()
            self.bar.close()

    def __enter__(self) -> RegenProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
