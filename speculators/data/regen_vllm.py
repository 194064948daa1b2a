"""`data.regenerate.backend: vllm`: the target writes the answers in a vLLM engine this stage starts itself
(vllm_engine.py, in the vLLM environment) — the same engine `capture.backend: vllm` captures with, so a `speculators
run` with both launches vLLM once. Token-id prompts in, token ids out (no detokenisation round trip in vLLM);
request j of a call samples with seed + j at the recipe's temperature and top_p, and stops at the template's
end-of-turn and the tokenizer's special tokens, as the in-process backends do (regen_tokens.py).

Not here: the row bookkeeping and the output format (regenerate.py), the engine process (vllm_engine.py).
"""

from __future__ import annotations

from speculators.core.config import Recipe
from speculators.core.target import load_tokenizer
from speculators.data.regen_tokens import TokenBackend
from speculators.data.vllm_engine import VllmEngine, engine_for, require_vllm_python


class VllmBackend(TokenBackend):
    """See the module docstring."""

    def __init__(self, recipe: Recipe) -> None:
        require_vllm_python(recipe)  # the vLLM environment exists, before anything is written
        super().__init__(recipe, load_tokenizer(recipe.target))
        self.vllm_engine: VllmEngine | None = None

    def generate_ids(self, prompts: list[list[int]], max_new: list[int], seed: int,
                     temperature: float) -> list[list[int]]:
        if self.vllm_engine is None:
            self.vllm_engine = engine_for(self.recipe)
        top_p = self.recipe.data.regenerate.top_p
        params = [{"max_tokens": m, "temperature": temperature, "top_p": top_p, "seed": (seed + j) % (2**31)}
                  for j, m in enumerate(max_new)]
        gens = self.vllm_engine.generate(prompts, params, self.stop_ids)
        self.finished(sum(len(g) for g in gens), len(gens))
        return gens
