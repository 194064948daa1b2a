"""The one exception type for user errors (bad input, bad recipe, mismatched artifacts).

Stages raise `SpeculatorsError` with ONE line that says what is wrong, where, and how to fix it; `cli.py` prints
it as `error: <message>` and exits with status 2, without a traceback. Programming errors stay ordinary
exceptions (with tracebacks). This module does nothing else.
"""

from __future__ import annotations


class SpeculatorsError(Exception):
    """A user-facing error: the message is one line, printed without a traceback."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class PairingError(SpeculatorsError):
    """A speculator was paired with a target (or tokenizer) it was not trained for."""


class UnsupportedTargetError(SpeculatorsError):
    """The bundled runtime cannot run this target's architecture (the message names the model type and why).
    Stages that only need the target's tokens (evaluation's continuations) fall back to Hugging Face `generate`."""
