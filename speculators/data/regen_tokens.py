"""What the regeneration backends that produce token ids share (`local` / `engine` in regenerate.py, `vllm` in
regen_vllm.py): the chat-template prompt of a row's next turn, its token budget within `data.max_length`, one
generation call per temperature with its own seed, and the `Turn` made of generated ids (cut at the first stop
token, decoded, and checked to re-encode to the same ids). A backend only implements `generate_ids`.

Not here: the generation itself, the row bookkeeping (regen_rows.py), the OpenAI backend (text in, text out).
"""

from __future__ import annotations

from typing import Any

from speculators.core.config import Recipe
from speculators.data.prepare import make_encoder
from speculators.data.regen_progress import RegenProgress
from speculators.data.regen_rows import RowState, Turn


class TokenBackend:
    """See the module docstring."""

    progress: RegenProgress | None = None  # the stage's progress line, fed as requests finish (`finished`)

    def __init__(self, recipe: Recipe, tokenizer: Any) -> None:
        self.recipe = recipe
        self.tok = tokenizer
        self.encoder = make_encoder(recipe, tokenizer)
        self.encoder._probe_terminator()
        self.terminators = set(self.encoder.terminators)
        self.stop_ids = sorted(self.terminators | {int(i) for i in tokenizer.all_special_ids if i is not None})
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def prompt_ids(self, st: RowState) -> list[int]:
        if st.conv.is_chat:
            return self.encoder.prompt_ids(st.history, st.conv.tools)
        ids = list(self.tok(st.conv.prompt, add_special_tokens=True)["input_ids"])
        return ids[:-1] if ids and ids[-1] == self.tok.eos_token_id else ids

    def generate_ids(self, prompts: list[list[int]], max_new: list[int], seed: int,
                     temperature: float) -> list[list[int]]:
        """Generated ids per prompt (up to and including the first stop token); request j samples with seed + j."""
        raise NotImplementedError

    def finished(self, tokens: int, requests: int = 1) -> None:
        """`requests` generations ended, `tokens` tokens between them: the progress line moves."""
        if self.progress is not None:
            self.progress.generated(tokens, requests)

    def generate(self, prompts: list[list[int]], max_new: list[int], seed: int, temperature: float) -> list[Turn]:
        turns = []
        for gen in self.generate_ids(prompts, max_new, seed, temperature):
            stop = next((t for t, x in enumerate(gen) if x in self.stop_ids), None)
            body = gen if stop is None else gen[:stop]
            finished = stop is not None and gen[stop] in self.terminators
            text = self.tok.decode(body, skip_special_tokens=False)
            same = list(self.tok(text, add_special_tokens=False)["input_ids"]) == body
            turns.append(Turn(text=text, finished=finished, tokens=len(body) + int(stop is not None),
                              retokenized_same=same))
        return turns

    def run_chunk(self, states: list[RowState], seed: int) -> None:
        rg, max_len = self.recipe.data.regenerate, self.recipe.data.max_length
        round_ = 0
        while True:
            active = [st for st in states if st.needs_generation]
            if not active:
                return
            prompts, budgets, ready = [], [], []
            for st in active:
                try:
                    p = self.prompt_ids(st)
                except Exception as exc:  # noqa: BLE001 - template errors on a regenerated history
                    st.fail(f"cannot render the conversation: {(str(exc).splitlines() or ['?'])[0]}", permanent=True)
                    continue
                budget = min(rg.max_new_tokens, max_len - len(p) - 1)  # room for the end-of-turn token
                if budget < 1:
                    st.cut()
                    continue
                prompts.append(p)
                budgets.append(budget)
                ready.append(st)
            for k, t in enumerate(rg.temperatures):  # one generation call per temperature (own seeds)
                group = [j for j, st in enumerate(ready) if st.temperature == t]
                if not group:
                    continue
                turns = self.generate([prompts[j] for j in group], [budgets[j] for j in group],
                                      seed * 1_000_003 + round_ + 7919 * k, t)
                for j, turn in zip(group, turns, strict=True):
                    ready[j].accept(turn)
            round_ += 1
