"""Whether the bundled runtime can run a loaded target: asked once per loaded model, the answer reused.

`runtime_refusal(target)` builds the runtime's target runner (`module_runner.make_runner`: the fused Llama path, or
the module path with its load-time probe of a few tokens) on the loaded target the first time it is asked about that
model, and returns None when the runtime runs it, or the one-line reason (the `UnsupportedTargetError` message, which
names the model type and why) when the runtime refuses the architecture. Later questions about the same model get
the recorded answer. Evaluation uses it to write the target's continuations with Hugging Face `generate` instead of
the runtime and to leave out the live / predicted-vs-live columns, saying why; regeneration (`backend: engine`) to
write the answers with HF `generate` (capture, training and teacher-forced acceptance need nothing of the runtime).

Only `UnsupportedTargetError` is an answer: every other error (a broken checkpoint, a bug) propagates. This module
does not run the target and does not decide what a caller does with the answer.
"""

from __future__ import annotations

import weakref
from typing import Any

from speculators.core.errors import UnsupportedTargetError
from speculators.runtime.forward.module_runner import make_runner

_ANSWERS: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()  # model -> refusal or None


def runtime_refusal(target: Any) -> str | None:
    """None when the bundled runtime can run `target` (a `speculators.core.target.LoadedTarget`), else why not (one
    line). The runner is built once per loaded model; the answer is reused."""
    model = target.model
    if model in _ANSWERS:
        return _ANSWERS[model]
    try:
        make_runner(model)
        reason = None
    except UnsupportedTargetError as exc:
        reason = str(exc)
    _ANSWERS[model] = reason
    return reason
