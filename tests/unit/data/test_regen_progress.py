"""The regenerate stage's progress line (data/regen_progress.py): it moves as requests finish within a chunk, never
past the chunk's rows, lands on the rows recorded, and says how fast tokens come, the time left and the age of the
last finished request (a stall reads differently from slow work)."""

from __future__ import annotations

import io

from speculators.data.regen_progress import RegenProgress


def test_the_line_moves_per_request_and_lands_on_the_rows_recorded() -> None:
    out = io.StringIO()
    with RegenProgress(10, 2, refresh_s=3600, file=out) as progress:
        assert "no request finished yet" in progress.postfix()
        progress.chunk_started(4)  # rows 3-6 being generated
        progress.generated(30)
        progress.generated(50)
        assert progress.bar.n == 4 and progress.tokens == 80
        for _ in range(5):  # more requests than rows (multi-turn rows): held below the chunk's end
            progress.generated(10)
        assert progress.bar.n == 6
        progress.rows_recorded(5)  # one row of the chunk failed: the bar says what was recorded
        assert progress.bar.n == 5
        now = progress.t0 + 10.0
        progress.last = progress.t0 + 9.5
        line = progress.postfix(now)
    assert line.startswith("13 tok/s") and "last request 0 s ago" in line, line
    assert "~1 s left" in line, line  # 1 row left at 7 requests in 10 s
    assert "tok/s" in out.getvalue() and "6/10" in out.getvalue()


def test_a_stall_shows_as_the_age_of_the_last_request() -> None:
    with RegenProgress(100, 0, refresh_s=3600, file=io.StringIO()) as progress:
        progress.chunk_started(100)
        progress.generated(64)
        progress.last = progress.t0 + 1.0
        line = progress.postfix(progress.t0 + 601.0)
    assert "last request 10.0 min ago" in line and "0 tok/s" in line, line
