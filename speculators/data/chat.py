"""Tokenize a conversation with the target's chat template and mark exactly the assistant tokens.

`ChatEncoder(tokenizer, template_kwargs).encode(conversation) -> Encoded(input_ids, loss_mask, method)`.
The loss mask is 1 on every token the assistant writes in a turn (its content, its tool calls, any reasoning the
template renders for it) INCLUDING the end-of-turn token that stops generation, and 0 on template headers,
separators after the end-of-turn token, and every non-assistant message. Three methods, chosen per template:

1. `generation_markers`: the template wraps assistant output in `{% generation %}...{% endgeneration %}`; the
   mask comes from transformers' `return_assistant_tokens_mask` (exact by construction).
2. `prefix`: template-agnostic. The assistant turn i starts where `render(messages[:i], add_generation_prompt=
   True)` ends, provided that rendering is a prefix of the full rendering: the mask then covers exactly what the
   model would write after the generation prompt (e.g. Qwen3's think block in thinking mode, but not the empty
   think block the template injects into the prompt when `enable_thinking=False`).
3. `sentinel`: when the prefix test fails (a template that renders history differently from a generation prompt,
   e.g. Qwen3 non-thinking history turns, Mistral system prompts moved to the last user turn), the content is
   replaced by a unique sentinel string and the turn starts where the sentinel lands, provided the rendering
   before it is unchanged.
In methods 2 and 3 the turn ends at the first end-of-turn token at or after its start. End-of-turn tokens are
the tokenizer's EOS plus the terminator the template writes after an assistant message (found by rendering a
probe conversation); for a turn that other messages follow, also the token the template writes there if it
differs (gpt-oss's harmony format ends earlier turns with <|end|> and the last with <|return|>, and <|end|> also
closes the reasoning channel inside the last turn, so it must not end the last turn). A token that straddles the
start of a turn counts as an assistant token.
Raw `prompt`/`completion` rows skip the template: prompt tokens (+ BOS if the tokenizer adds one), completion
tokens and EOS; the mask covers completion + EOS.

This module does not read datasets or apply length policies (prepare does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.target import eos_token_ids
from speculators.data.schemas import Conversation

_SENTINEL = "\u2063SPECULATORSSENTINEL{}\u2063"
_PROBE_USER = "Probe question."
_PROBE_ANSWER = "Probe answer text."


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token (incl. its end-of-turn token)
    method: str  # generation_markers | prefix | sentinel | raw


class RowEncodeError(ValueError):
    """This row cannot be encoded (reason is one line)."""


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


class ChatEncoder:
    """Encodes conversations for one tokenizer + template (+ template kwargs such as `enable_thinking`)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None, extra_eos_ids: list[int] | None = None):
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        self.markers = has_generation_markers(self.template)
        self.special_texts = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)
        self.terminators = set(eos_token_ids(tokenizer)) | {int(i) for i in extra_eos_ids or [] if i is not None}
        # what ends an assistant turn that other messages follow: the same, plus the token the template writes
        # there when it differs from the last turn's (gpt-oss's harmony format: <|end|> there, <|return|> last)
        self.mid_terminators = set(self.terminators)
        self._probed = False

    # ---- helpers -----------------------------------------------------------------------------------------------
    def require_template(self) -> None:
        if not self.template:
            raise SpeculatorsError(
                f"the target tokenizer ({getattr(self.tok, 'name_or_path', '?')}) has no chat template and the "
                "recipe gives none; set target.chat_template to a .jinja file or a template string")

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError and friends
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RowEncodeError(f"the chat template rejected the conversation: {msg}") from None

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _probe_terminator(self) -> None:
        """Learn the token the template writes right after an assistant message (e.g. <|im_end|>, <|eot_id|>): after
        the last message of a one-turn probe (`terminators`), and after the first answer of a two-turn probe
        (`mid_terminators`; templates that end the last turn differently, like gpt-oss's, differ there)."""
        if self._probed:
            return
        self._probed = True
        turn = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
        last = self._special_after_answer(turn, first=False)
        if last is not None:
            self.terminators.add(last)
            self.mid_terminators.add(last)
        mid = self._special_after_answer(turn + turn, first=True)
        if mid is not None:
            self.mid_terminators.add(mid)

    def _special_after_answer(self, msgs: list[dict], first: bool) -> int | None:
        """The first special token the template renders after the first (or last) probe answer of `msgs`."""
        try:
            text = self.render(msgs, None, False)
        except RowEncodeError:
            return None
        end = text.find(_PROBE_ANSWER) if first else text.rfind(_PROBE_ANSWER)
        if end < 0:
            return None
        end += len(_PROBE_ANSWER)
        ids, offsets = self._tokenize(text)
        special = set(self.tok.all_special_ids)
        return next((int(tid) for tid, (s, _e) in zip(ids, offsets, strict=True) if s >= end and tid in special),
                    None)

    def _check_special_text(self, conv: Conversation) -> None:
        texts = [m.get("content") or "" for m in conv.messages or []] + [conv.prompt or "", conv.completion or ""]
        for text in texts:
            for sp in self.special_texts:
                if sp in text:
                    raise RowEncodeError(f"a message contains the special token text {sp!r}; remove it from the data")

    # ---- encoding ----------------------------------------------------------------------------------------------
    def encode(self, conv: Conversation) -> Encoded:
        self._check_special_text(conv)
        if not conv.is_chat:
            return self._encode_raw(conv)
        self.require_template()
        if self.markers:
            return self._encode_markers(conv)
        return self._encode_agnostic(conv)

    def _encode_raw(self, conv: Conversation) -> Encoded:
        if self.tok.eos_token_id is None:
            raise SpeculatorsError("the target tokenizer has no EOS token; raw prompt/completion rows need one")
        prompt = list(self.tok(conv.prompt, add_special_tokens=True)["input_ids"])
        completion = list(self.tok(conv.completion or "", add_special_tokens=False)["input_ids"])
        if prompt and prompt[-1] == self.tok.eos_token_id:
            prompt = prompt[:-1]  # tokenizers that append EOS on encode: the prompt must not end the document
        ids = prompt + completion + [int(self.tok.eos_token_id)]
        return Encoded(ids, [0] * len(prompt) + [1] * (len(completion) + 1), "raw")

    def _encode_markers(self, conv: Conversation) -> Encoded:
        try:
            out = self.tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True, **self.kwargs)
        except Exception as exc:  # noqa: BLE001
            msg = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RowEncodeError(f"the chat template rejected the conversation: {msg}") from None
        ids = list(out["input_ids"])
        mask = [int(m) for m in out["assistant_masks"]]
        n_turns = sum(1 for m in conv.messages if m["role"] == "assistant")
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        if n_turns and runs < n_turns:
            raise RowEncodeError(f"the template's generation markers cover {runs} of {n_turns} assistant turns")
        return Encoded(ids, mask, "generation_markers")

    def _turn_start(self, conv: Conversation, full: str, i: int) -> tuple[int, str]:
        """Character offset where assistant message i starts in the full rendering, and the method used."""
        prefix = self.render(conv.messages[:i], conv.tools, True)
        if full.startswith(prefix):
            return len(prefix), "prefix"
        sentinel = _SENTINEL.format(i)
        msgs = [dict(m) for m in conv.messages]
        msgs[i]["content"] = sentinel
        msgs[i].pop("reasoning_content", None)
        with_sentinel = self.render(msgs, conv.tools, False)
        at = with_sentinel.find(sentinel)
        if at >= 0 and with_sentinel[:at] == full[:at]:
            return at, "sentinel"
        raise RowEncodeError(f"cannot locate assistant turn {i} in the rendered template (neither the generation "
                             "prompt nor the content appears where expected); add {% generation %} markers to "
                             "the template (target.chat_template)")

    def _encode_agnostic(self, conv: Conversation) -> Encoded:
        self._probe_terminator()
        if not self.terminators:
            raise SpeculatorsError("cannot tell where assistant turns end: the tokenizer has no EOS token and the "
                                   "template writes no special token after an answer; set an eos_token")
        full = self.render(conv.messages, conv.tools, False)
        ids, offsets = self._tokenize(full)
        mask = [0] * len(ids)
        methods = set()
        cursor = 0  # first token index a new turn may start at
        for i, msg in enumerate(conv.messages):
            if msg["role"] != "assistant":
                continue
            start_char, how = self._turn_start(conv, full, i)
            methods.add(how)
            t0 = next((t for t in range(cursor, len(ids)) if offsets[t][1] > start_char), None)
            if t0 is None:
                raise RowEncodeError(f"assistant turn {i} renders no tokens")
            enders = self.terminators if i == len(conv.messages) - 1 else self.mid_terminators
            t1 = next((t for t in range(t0, len(ids)) if ids[t] in enders), None)
            if t1 is None:
                raise RowEncodeError(f"assistant turn {i} has no end-of-turn token after it in the rendered "
                                     "template; add {% generation %} markers to the template")
            for t in range(t0, t1 + 1):
                mask[t] = 1
            cursor = t1 + 1
        return Encoded(ids, mask, "sentinel" if "sentinel" in methods else "prefix")

    def prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        """Token ids of a conversation prefix followed by the generation prompt (what the target continues)."""
        self.require_template()
        text = self.render(messages, tools, True)
        ids, _ = self._tokenize(text)
        return ids
