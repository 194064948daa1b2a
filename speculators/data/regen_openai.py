"""The `openai` backend of `speculators regenerate`: an OpenAI-compatible server (vLLM, SGLang, `speculators serve`)
writes the answers, through the `openai` client library (its retries: timeouts, connection errors, 408 / 409 / 429 /
5xx, up to `data.regenerate.max_retries` per request with exponential backoff).

`check()` runs before the first row: the endpoint answers `GET /models` (with the key, if any) and serves the model
(`data.regenerate.model`; when unset, the one model the server serves, if its name is the target's). Each turn is
`POST /chat/completions` (chat rows) or `/completions` (raw rows) from a pool of `concurrency` threads. A request the
server refuses as invalid (400 / 413 / 422: e.g. a prompt over its context) rejects that row; any other failure
leaves it pending for the next run (`regen_rows`).

Not here: the row bookkeeping (regen_rows.py), the stage (regenerate.py), the in-process backend (regenerate.py).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import Any

from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.data.regen_progress import RegenProgress
from speculators.data.regen_rows import RowFailed, RowState, Turn

log = logging.getLogger(__name__)
_PERMANENT = (400, 413, 422)  # the server refuses this row's request as invalid: the same answer every time


class OpenAIBackend:
    """See the module docstring."""

    def __init__(self, recipe: Recipe) -> None:
        rg = recipe.data.regenerate
        if not rg.endpoint:
            raise SpeculatorsError("data.regenerate.backend=openai needs data.regenerate.endpoint "
                                   "(e.g. http://127.0.0.1:8000/v1)")
        if not rg.endpoint.startswith(("http://", "https://")):
            raise SpeculatorsError(f"data.regenerate.endpoint {rg.endpoint!r} must start with http:// or https://")
        try:
            import openai
        except ImportError:
            raise SpeculatorsError("data.regenerate.backend=openai needs the openai client: "
                                   "pip install 'speculators[regenerate]'") from None
        self.openai = openai
        self.recipe = recipe
        self.base = rg.endpoint.rstrip("/")
        self.model = rg.model or recipe.target.name_or_path
        key = os.environ.get(rg.api_key_env) if rg.api_key_env else None
        self.client = openai.OpenAI(base_url=self.base, api_key=key or "EMPTY", max_retries=rg.max_retries,
                                    timeout=rg.request_timeout)

    def check(self) -> None:
        """The endpoint answers and serves the model (one-line SpeculatorsError otherwise), before any row."""
        o, rg = self.openai, self.recipe.data.regenerate
        try:
            served = [m.id for m in self.client.models.list()]
        except o.AuthenticationError:
            raise SpeculatorsError(f"{self.base} refused the API key (HTTP 401); put the right key in "
                                   f"${rg.api_key_env} (data.regenerate.api_key_env)") from None
        except o.APIConnectionError as exc:
            raise SpeculatorsError(f"cannot reach data.regenerate.endpoint {self.base} ({_cause(exc)}); start the "
                                   f"server or fix the endpoint") from None
        except o.APIStatusError as exc:
            raise SpeculatorsError(f"{self.base}/models answered HTTP {exc.status_code}: {_detail(exc)}; is "
                                   f"data.regenerate.endpoint an OpenAI-compatible base URL (ending in /v1)?") from None
        if self.model in served:
            return
        same_name = [m for m in served if PurePosixPath(m).name == PurePosixPath(self.model).name]
        if rg.model is None and len(served) == 1 and same_name:
            log.info("regenerate: %s serves the target as %r", self.base, served[0])
            self.model = served[0]
            return
        raise SpeculatorsError(f"{self.base} does not serve model {self.model!r} (it serves: "
                               f"{', '.join(served) or 'nothing'}); set data.regenerate.model to the target's name "
                               f"there")

    def _turn(self, st: RowState) -> Turn:
        rg = self.recipe.data.regenerate
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": rg.max_new_tokens, "temperature": st.temperature,
                                  "top_p": rg.top_p, "seed": self.recipe.seed * 1_000_003 + st.index + st.stats["turns"]}
        try:
            if st.conv.is_chat:
                if st.conv.tools:
                    kwargs["tools"] = st.conv.tools
                if self.recipe.data.chat_template_kwargs:
                    kwargs["extra_body"] = {"chat_template_kwargs": self.recipe.data.chat_template_kwargs}
                resp = self.client.chat.completions.create(messages=st.history, **kwargs)
            else:
                resp = self.client.completions.create(prompt=st.conv.prompt, **kwargs)
        except self.openai.APIStatusError as exc:
            raise RowFailed(f"HTTP {exc.status_code} from {self.base}: {_detail(exc)}",
                            permanent=exc.status_code in _PERMANENT) from None
        except self.openai.APIConnectionError as exc:  # timeouts included, after the client's retries
            raise RowFailed(f"{self.base}: {_cause(exc)}") from None
        try:
            choice = resp.choices[0]
            if st.conv.is_chat:
                msg = choice.message
                extra = msg.model_extra or {}
                text, reasoning = msg.content or "", extra.get("reasoning_content") or extra.get("reasoning")
            else:
                text, reasoning = choice.text, None
        except (AttributeError, IndexError, TypeError):
            raise RowFailed(f"unexpected response from {self.base}: {str(resp)[:200]}") from None
        tokens = int(getattr(resp.usage, "completion_tokens", 0) or 0) if resp.usage else 0
        return Turn(text=text, finished=choice.finish_reason != "length", reasoning=reasoning, tokens=tokens)

    progress: RegenProgress | None = None  # the stage's progress line, fed as each request finishes

    def _row(self, st: RowState) -> None:
        try:
            while st.needs_generation:
                turn = self._turn(st)
                st.accept(turn)
                if self.progress is not None:
                    self.progress.generated(turn.tokens)
        except RowFailed as exc:
            st.fail(str(exc), exc.permanent)

    def run_chunk(self, states: list[RowState], seed: int) -> None:
        del seed  # per-request seeds come from the row index
        with ThreadPoolExecutor(max_workers=max(1, self.recipe.data.regenerate.concurrency)) as pool:
            list(pool.map(self._row, states))


def _detail(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else None
        if message:
            return str(message).replace("\n", " ")[:200]
    return str(exc).replace("\n", " ")[:200]


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = f"{type(exc).__name__}: {cause}" if cause else str(exc)
    return text.replace("\n", " ")[:200]
