"""What one request of the runtime is made of and gives back (docs/architecture.md §7), apart from the generation loop itself.

- `encode_prompt` / `check_prompt`: a raw prompt, a chat or token ids -> checked token ids (one-line errors).
- `Slot`: one sequence's static KV cache and the prefix it holds; `Slot.prefill` puts a prompt into it, reusing the
  prefix it shares with the previous request (features included; `common_prefix_length`: how much that is).
- `take_committed` / `final_text`: where an output ends (EOS / stop token, stop string, length).
- `VerifyForward`: the verification forward a request's cycle loop asks whoever runs the target for.
- `StreamChunk`, `GenerateOutput`, `GenerationStats`: what a request streams and returns.

Nothing here drafts, verifies or samples (engine.py runs the cycles; batching.py runs several requests at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import AcceptanceStats
from speculators.core.sampling import SamplingParams
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.forward.target_rows import TokenLogprob
from speculators.runtime.forward.target_runner import RunnerBase, Segment

NO_LOGIT_ROWS = torch.empty(0, dtype=torch.long)  # forward without the output head (TargetRows makes the rows needed)


def encode_prompt(tokenizer: Any, prompt: str | list[dict] | list[int] | torch.Tensor) -> list[int]:
    """Token ids of a raw prompt, a chat (`messages`, through the chat template) or ids as given."""
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise SpeculatorsError("the target's tokenizer has no chat template; send a raw prompt instead")
        try:
            enc = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - template errors come as many types; report one line
            raise SpeculatorsError(f"cannot apply the chat template: {str(exc).splitlines()[0]}") from None
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        return [int(t) for t in ids]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise SpeculatorsError("prompt must be a string, a list of chat messages, or a list of token ids")


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab: int, max_len: int) -> None:
    """Raise SpeculatorsError (one line) for a request a runtime with this vocabulary and KV cache cannot serve."""
    try:
        params.validate()
    except ValueError as exc:
        raise SpeculatorsError(str(exc)) from None
    if not prompt_ids:
        raise SpeculatorsError("the prompt is empty; give at least one token")
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise SpeculatorsError(f"prompt token ids must be in [0, {vocab})")
    if len(prompt_ids) > max_len:
        raise SpeculatorsError(f"the prompt has {len(prompt_ids)} tokens but the KV cache holds {max_len}; "
                               f"shorten the prompt")
    if len(prompt_ids) + params.max_new_tokens - 1 > max_len:
        raise SpeculatorsError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                               f"exceed the KV cache ({max_len} tokens); lower max_new_tokens to at most "
                               f"{max_len - len(prompt_ids) + 1}")


def take_committed(committed: list[int], out: list[int], enders: set[int], stops: list[str], max_new_tokens: int,
                   decode: Callable[[list[int]], str]) -> tuple[list[int], str | None]:
    """Append a cycle's committed tokens to `out` up to the first EOS / stop token (`enders`), stop string or the
    length limit; return the tokens taken and the finish reason ("stop", "length", None: go on). Only the tail of
    the output is decoded to look for a stop string."""
    new: list[int] = []
    for tok in committed:
        out.append(tok)
        new.append(tok)
        if tok in enders or (stops and any(s in decode(out[-(4 * max(map(len, stops)) + 8):]) for s in stops)):
            return new, "stop"
        if len(out) >= max_new_tokens:
            return new, "length"
    return new, None


def final_text(text: str, stops: list[str]) -> str:
    """The output's text cut before the first stop string it contains."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share: what a slot's prefix cache keeps of its previous request (the
    speedup oracle's check predicts the same reuse)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i



@dataclass
class Slot:
    """One sequence's KV cache and what its committed prefix holds (reused by the next request it serves)."""

    cache: StaticKVCache
    prefix_ids: list[int] = field(default_factory=list)
    prefix_features: dict[str, torch.Tensor] = field(default_factory=dict)

    def prefill(self, runner: RunnerBase, prompt_ids: list[int], *, reuse_prefix: bool, capture: bool
                ) -> tuple[dict[str, torch.Tensor], int]:
        """Put the prompt minus its last token into the cache (reusing the prefix it shares with what the slot
        holds, when `reuse_prefix`); return the features of those positions and the reused length."""
        body = prompt_ids[:-1]
        reuse = common_prefix_length(self.prefix_ids, body) if reuse_prefix else 0
        self.cache.reset(reuse)
        new = body[reuse:]
        features = {k: v[:reuse] for k, v in self.prefix_features.items()} if reuse else {}
        if new:
            fwd = runner.forward(self.cache, torch.tensor(new, dtype=torch.long), logit_rows=NO_LOGIT_ROWS, capture=capture)
            self.cache.commit(list(range(len(new))))
            features = {k: torch.cat([features[k], v]) if k in features else v for k, v in fwd.features.items()}
        self.prefix_ids, self.prefix_features = list(body), features
        return features, reuse


@dataclass
class VerifyForward:
    """A request's verification forward, yielded by its cycle loop to whoever runs the target: the engine alone
    (`Engine.stream`) or `batching.BatchRunner` together with other requests' forwards. `shared` tells the loop
    whether the forward's time was shared (then it does not feed the cost model)."""

    segment: Segment
    shared: bool = False
    capture: bool = True  # the drafter wants the forward's hidden states (features) of these positions


@dataclass
class DraftWork:
    """What a request's speculation cost, counted (not timed): target forwards and the nodes they verified (root
    included), forwards that captured hidden states, positions the model drafter absorbed, its proposals, and how
    often it restarted after positions were skipped. Plain decoding of N tokens: N forwards, N nodes, nothing else."""

    target_forwards: int = 0
    target_nodes: int = 0
    captured_forwards: int = 0
    absorbed_positions: int = 0
    proposals: int = 0
    restarts: int = 0


@dataclass
class GenerationStats:
    """Per-request numbers. Acceptance counters come from `metrics.AcceptanceStats` (one target call = one
    verification forward; the prefill is not a target call)."""

    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    drafter: str = "none"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_prefix_tokens: int = 0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = ""
    adaptive: dict = field(default_factory=dict)
    work: DraftWork = field(default_factory=DraftWork)

    @property
    def tau(self) -> float:
        return self.acceptance.tau

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.acceptance.per_position_acceptance

    @property
    def target_calls(self) -> int:
        return self.acceptance.target_calls

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_seconds / self.generated_tokens if self.generated_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter, "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "reused_prefix_tokens": self.reused_prefix_tokens, "finish_reason": self.finish_reason,
            "prefill_seconds": round(self.prefill_seconds, 4), "first_token_seconds": round(self.first_token_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4), "total_seconds": round(self.total_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2), "ms_per_token": round(self.ms_per_token, 3),
            **self.acceptance.to_dict(), "adaptive": self.adaptive,
        }


@dataclass
class GenerateOutput:
    token_ids: list[int]  # generated ids only (EOS included when it ended the output)
    text: str  # decoded without special tokens, cut before a matched stop string
    stats: GenerationStats
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when SamplingParams.logprobs asked for them

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (held back while it could still become a stop string)
    token_ids: list[int]  # new committed token ids since the previous chunk
    output: GenerateOutput | None = None  # set on the last chunk only
    logprobs: list[TokenLogprob] | None = None  # of `token_ids`, when the request asked for them
