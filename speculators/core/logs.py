"""Console logging of the `speculators` package: one stderr handler on the `speculators` logger, lines as the CLI
prints them (`warning: ...` for warnings, the bare message for information).

`configure()` is called by the entry points (cli.py, launched training workers); library use of the package keeps
Python's logging defaults. Not here: progress bars (tqdm), experiment tracking (core/tracking.py).
"""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        return f"{record.levelname.lower()}: {message}" if record.levelno >= logging.WARNING else message


def configure(level: int = logging.INFO) -> None:
    """Show the package's log lines on stderr (idempotent)."""
    logger = logging.getLogger("speculators")
    logger.setLevel(level)
    if not any(getattr(h, "speculators_console", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        handler.speculators_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
