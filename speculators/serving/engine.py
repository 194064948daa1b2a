"""The bundled runtime's generation loop (DESIGN §7): prefill, then draft -> verify -> commit cycles.

    engine = Engine.from_pretrained(target="data/targets/stdlib-lm", speculator=None | dir | "ngram")
    out = engine.generate("def f(x):", SamplingParams(max_new_tokens=64, temperature=0))
    out.token_ids, out.text, out.stats.tau, out.stats.per_position_acceptance, out.stats.target_calls

Per request (batch 1 here; batching.py runs several in lockstep), one code path on CPU (fp32) and CUDA (bf16):
1. Prefill: the prompt minus its last token goes through `TargetRunner` into the static KV cache (a shared
   prefix with the previous request is reused, features included); the drafter absorbs those positions.
2. Each cycle: the root is the last committed token (not yet in the cache). The drafter proposes a tree
   (depth chosen by `AdaptiveDepth`; the root alone = plain decoding; at T > 0 with a drafter that samples its own
   law also the kind: the configured tree, a sampled chain verified by block verification, or a sampled tree
   verified by traversal verification: `SAMPLED_KINDS`), the target runs ONE forward over it with
   the ancestor mask at positions committed + depth, `verify_tree_lazy` picks the accepted path and the next
   token, reading the filtered target law (`sampling.logits_to_probs`, the operator plain decoding uses) of
   only the nodes it visits (`TargetRows` runs the output head for those), the cache keeps only the root +
   accepted path, and the drafter absorbs those positions with their features (next tokens = the accepted
   tokens + the corrected / bonus token).
3. EOS, a `stop_token_ids` token or a stop string inside the committed tokens truncates the output there;
   `max_new_tokens` caps it.

What holds, in which dtype (DESIGN §7):
- Every dtype: lossless in distribution. The output is distributed exactly as sampling the target rows the verify
  forward computed, with the same temperature / top-k / top-p, whatever the drafter (verification is exact; tested
  by chi-square through deep trees in float32 and bfloat16).
- float32 (CPU): at temperature 0 the output equals the target's own greedy decoding token for token, whatever the
  drafter — a tree-shaped verify forward rounds like the one-token forward here, up to exact near-ties (top-2 logit
  margin < 1e-4; tested on every held-out row).
- bfloat16 (the CUDA default): NOT token for token. A tree-shaped forward rounds differently from a one-token forward
  (on the house target the same logits differ by up to 0.25 between forward shapes), so a near-tie can flip and the
  rest of the output follows the other branch. Measured (tests/integration/test_runtime_dtypes.py, 72 held-out rows x
  n-gram and oracle trees, 24 tokens, CPU bf16): 8 of 144 greedy runs diverged from HF bf16 greedy decoding, every
  first divergence at a top-2 margin <= 0.0625 (one bf16 ulp there). Compare fp32 with fp32 when you need equality.
A seeded sampled request is reproducible (same engine settings, same seed -> same tokens): its draft depth is fixed
instead of timing-driven. Equal seeds do NOT give equal tokens with and without a drafter (lossless in distribution,
not per sample path).

Several requests share each target forward through `batching.generate_batch` / `batching.BatchRunner`, which drive the same
per-request coroutine (`request`) that `stream` drives alone. Not here: CUDA graphs, paged KV, penalties /
grammars, HTTP (server.py).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators.config import DEFAULT_NGRAM_GRAFT, TargetConfig, TreeConfig
from speculators.core.sampling import SamplingParams, logits_to_probs
from speculators.core.trees import DraftTree, ancestor_mask
from speculators.errors import SpeculatorsError
from speculators.metrics import AcceptanceStats
from speculators.serving.adaptive import AdaptiveDepth, CostModel
from speculators.serving.drafters import (
    DrafterInfo,
    NoDrafter,
    default_tree,
    depth_tree,
    load_drafter,
    paired_target,
    prune_tree,
)
from speculators.serving.kv_cache import StaticKVCache
from speculators.serving.target_rows import TargetRows, TokenLogprob, first_child_chain
from speculators.serving.target_runner import ForwardOutput, Segment, TargetRunner
from speculators.serving.verify import verify_tree_lazy

DEFAULT_MAX_LEN = 8192
# tree kinds the controller may choose at T > 0 besides the configured one, for drafters that sample their own law:
# sampled chains (block verification) and sampled trees (traversal verification)
SAMPLED_KINDS = ("chain", "sampled")
_NO_ROWS = torch.empty(0, dtype=torch.long)  # forward without the output head (TargetRows makes the rows needed)


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


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _is_chain(parents: torch.Tensor) -> bool:
    return parents.tolist() == list(range(-1, parents.shape[0] - 1))


@dataclass
class Slot:
    """One sequence's KV cache and what its committed prefix holds (reused by the next request it serves)."""

    cache: StaticKVCache
    prefix_ids: list[int] = field(default_factory=list)
    prefix_features: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class VerifyForward:
    """A request's verification forward, yielded by its cycle loop to whoever runs the target: the engine alone
    (`Engine.stream`) or `batching.BatchRunner` together with other requests' forwards. `shared` tells the loop
    whether the forward's time was shared (then it does not feed the cost model)."""

    segment: Segment
    shared: bool = False


class Engine:
    """A target + a drafter + a static KV cache. Not thread-safe: one `generate` at a time."""

    def __init__(self, target: Any, drafter: Any = None, *, info: DrafterInfo | None = None,
                 tree: TreeConfig | None = None, max_len: int | None = None, adaptive: bool | None = None,
                 prefix_caching: bool = True) -> None:
        self.target = target  # speculators.target.LoadedTarget
        self.tokenizer = target.tokenizer
        self.drafter = drafter if drafter is not None else NoDrafter()
        self.info = info or DrafterInfo(getattr(self.drafter, "name", type(self.drafter).__name__),
                                        getattr(self.drafter, "family", getattr(self.drafter, "name", "?")))
        self.speculative = not isinstance(self.drafter, NoDrafter)
        self.runner = TargetRunner(target.model, self.drafter.required_features())
        self.set_tree(tree or default_tree(self.drafter, self.runner.device), adaptive)
        limit = int(getattr(self.target.config, "max_position_embeddings", 0) or DEFAULT_MAX_LEN)
        self.max_len = int(max_len or min(limit, DEFAULT_MAX_LEN))
        self.slot = Slot(self.runner.new_cache(self.max_len))  # batch-1 requests run here
        self.eos_ids = _eos_ids(target.model, self.tokenizer)
        self.prefix_caching = prefix_caching
        self.cost = CostModel()
        self._acceptance_prior: dict[str, list[float]] = {}  # per tree kind, from the previous adaptive request
        self.totals = AcceptanceStats()  # over every request served (the server's /metrics reads it)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: str | Any | None, speculator: str | None = None, *, device: str = "auto",
                        dtype: str = "auto", tree: TreeConfig | None = None, max_len: int | None = None,
                        adaptive: bool | None = None, allow_revision_mismatch: bool = False,
                        revision: str | None = None, draft_dtype: str = "auto",
                        ngram_graft: int = DEFAULT_NGRAM_GRAFT) -> Engine:
        """Load a target (dir / hub id, an already loaded `LoadedTarget`, or None: the target a speculator
        directory's pairing.json names, else the house target) and a drafter: None or "none"
        (plain decoding), "ngram" (prompt lookup) or a speculator directory (its pairing.json is checked against
        the target: another tokenizer is always refused, another revision unless `allow_revision_mismatch`),
        drafting in `draft_dtype` (see `drafters.draft_dtype_for`; the target's dtype is never changed).
        A speculator's trees also carry up to `ngram_graft` prompt-lookup nodes (`graft.NgramGraft`; 0 = the
        speculator alone)."""
        from speculators.target import load_target

        if hasattr(target, "model") and hasattr(target, "tokenizer"):
            loaded = target
        else:
            cfg = TargetConfig(name_or_path=str(target), revision=revision) if target is not None \
                else paired_target(speculator)
            loaded = load_target(dataclasses.replace(cfg, device=device, dtype=dtype))
        drafter, info = load_drafter(speculator, loaded, allow_revision_mismatch=allow_revision_mismatch,
                                     draft_dtype=draft_dtype, ngram_graft=ngram_graft)
        return cls(loaded, drafter, info=info, tree=tree, max_len=max_len, adaptive=adaptive)

    def set_tree(self, tree: TreeConfig, adaptive: bool | None = None) -> None:
        """Drafting settings for the next requests (max depth, top-k, node budget, kind, verification of sampled
        drafts, adaptive on/off: with it on, at T > 0 the kind too is chosen per cycle, see `kinds_for`)."""
        if tree.depth < 1 or tree.budget < 1 or tree.topk < 1:
            raise SpeculatorsError(f"tree depth, topk and budget must be >= 1, got depth={tree.depth}, "
                                   f"topk={tree.topk}, budget={tree.budget}")
        if tree.kind not in ("dynamic", "static", "chain", "sampled"):
            raise SpeculatorsError(f"tree kind must be dynamic, static, chain or sampled, got {tree.kind!r}")
        if tree.verify not in ("sequence", "token"):
            raise SpeculatorsError(f"tree verify must be sequence or token, got {tree.verify!r}")
        self.tree = tree
        self.adaptive = tree.adaptive if adaptive is None else adaptive

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def kinds_for(self, params: SamplingParams, adaptive: bool) -> tuple[str, ...]:
        """Tree kinds a request may draft, the configured one first: at T > 0 an adaptive request of a drafter that
        samples its own law may also draft sampled chains and sampled trees (`SAMPLED_KINDS`)."""
        kinds = (self.tree.kind,)
        if adaptive and not params.greedy and getattr(self.drafter, "samples_drafts", False):
            kinds += tuple(k for k in SAMPLED_KINDS if k != self.tree.kind)
        return kinds

    @property
    def cache(self) -> StaticKVCache:
        return self.slot.cache

    def new_slot(self) -> Slot:
        """Another KV cache of this engine's size (a batch runs each request in its own slot)."""
        return Slot(self.runner.new_cache(self.max_len))

    # ---- input ----------------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict] | list[int] | torch.Tensor) -> list[int]:
        """Token ids of a raw prompt, a chat (`messages`, through the chat template) or ids as given."""
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not getattr(self.tokenizer, "chat_template", None):
                raise SpeculatorsError("the target's tokenizer has no chat template; send a raw prompt instead")
            try:
                enc = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001 - template errors come as many types; report one line
                raise SpeculatorsError(f"cannot apply the chat template: {str(exc).splitlines()[0]}") from None
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
            return [int(t) for t in ids]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise SpeculatorsError("prompt must be a string, a list of chat messages, or a list of token ids")

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise SpeculatorsError (one line) for a request this engine cannot serve."""
        try:
            params.validate()
        except ValueError as exc:
            raise SpeculatorsError(str(exc)) from None
        if not prompt_ids:
            raise SpeculatorsError("the prompt is empty; give at least one token")
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise SpeculatorsError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) > self.max_len:
            raise SpeculatorsError(f"the prompt has {len(prompt_ids)} tokens but the KV cache holds {self.max_len}; "
                                   f"shorten the prompt")
        if len(prompt_ids) + params.max_new_tokens - 1 > self.max_len:
            raise SpeculatorsError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                   f"exceed the KV cache ({self.max_len} tokens); lower max_new_tokens to at most "
                                   f"{self.max_len - len(prompt_ids) + 1}")

    # ---- generation ---------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[dict] | list[int] | torch.Tensor, params: SamplingParams | None = None,
                 **kwargs: Any) -> GenerateOutput:
        """Generate for one prompt; keyword arguments build `SamplingParams` when `params` is not given."""
        out = None
        for chunk in self.stream(prompt, params, text_deltas=False, **kwargs):
            out = chunk.output
        assert out is not None
        return out

    def stream(self, prompt: str | list[dict] | list[int] | torch.Tensor, params: SamplingParams | None = None,
               *, text_deltas: bool = True, **kwargs: Any) -> Iterator[StreamChunk]:
        """Like `generate`, yielding a `StreamChunk` per verification cycle; the last one carries the output.
        Without `text_deltas` the intermediate chunks carry token ids only (text ""), so the output is not
        re-decoded every cycle (a cost that grows with the output's length; `generate` needs the final text only)."""
        params = params or SamplingParams(**kwargs)
        prompt_ids = self.encode(prompt)
        self.check_request(prompt_ids, params)
        return self._alone(self.request(prompt_ids, params, self.slot, text_deltas))

    def _alone(self, request: Generator[VerifyForward | StreamChunk, ForwardOutput | None, None]
               ) -> Iterator[StreamChunk]:
        """Drive one request: run each verification forward it asks for, pass its chunks on."""
        reply: ForwardOutput | None = None
        while True:
            try:
                item = request.send(reply)
            except StopIteration:
                return
            if isinstance(item, VerifyForward):
                reply = self.runner.forward_batch([item.segment], capture=self.speculative)[0]
                continue
            reply = None
            yield item

    def request(self, prompt_ids: list[int], params: SamplingParams, slot: Slot, text_deltas: bool = True
                ) -> Generator[VerifyForward | StreamChunk, ForwardOutput | None, None]:
        """One checked request (`check_request`) in `slot`, as a coroutine: it yields a `VerifyForward` per
        cycle and must be sent that forward's `ForwardOutput`, and yields a `StreamChunk` per cycle (the last
        one carries the output). Prefill and drafting run inside it."""
        t_start = time.perf_counter()
        stops = list(params.stop or [])
        hold = max((len(s) for s in stops), default=1) - 1
        out: list[int] = []
        emitted_text = 0
        stats = GenerationStats(drafter=self.info.name, prompt_tokens=len(prompt_ids))
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        cycles = self._cycles(prompt_ids, params, out, stats, stops, slot, logprobs)
        reply: ForwardOutput | None = None
        while True:
            item = cycles.send(reply)
            if isinstance(item, VerifyForward):
                reply = yield item
                continue
            reply = None
            new_tokens, finish = item
            new_logprobs = logprobs[len(out) - len(new_tokens):] if logprobs is not None else None
            if finish is None:
                if not text_deltas:
                    yield StreamChunk(text="", token_ids=new_tokens, logprobs=new_logprobs)
                    continue
                text = self._decode(out).rstrip("\ufffd")
                safe = len(text) - hold if stops else len(text)
                delta = text[emitted_text:safe] if safe > emitted_text else ""
                emitted_text += len(delta)
                yield StreamChunk(text=delta, token_ids=new_tokens, logprobs=new_logprobs)
                continue
            text = self._final_text(out, stops)
            stats.generated_tokens = len(out)
            stats.finish_reason = finish
            stats.total_seconds = time.perf_counter() - t_start
            stats.decode_seconds = stats.total_seconds - stats.prefill_seconds
            self.totals.merge(stats.acceptance)
            output = GenerateOutput(token_ids=list(out), text=text, stats=stats, prompt_token_ids=list(prompt_ids),
                                    logprobs=list(logprobs) if logprobs is not None else None)
            yield StreamChunk(text=text[emitted_text:], token_ids=new_tokens, output=output, logprobs=new_logprobs)
            return

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _final_text(self, out: list[int], stops: list[str]) -> str:
        text = self._decode(out)
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        return text[: min(cuts)] if cuts else text

    def _hit_stop(self, out: list[int], stops: list[str]) -> bool:
        """Whether the last token completed a stop string (only the tail of the output is decoded)."""
        tail = self._decode(out[-(4 * max(len(s) for s in stops) + 8):])
        return any(s in tail for s in stops)

    def _cycles(self, prompt_ids: list[int], params: SamplingParams, out: list[int], stats: GenerationStats,
                stops: list[str], slot: Slot, logprobs: list[TokenLogprob] | None = None
                ) -> Generator[VerifyForward | tuple[list[int], str | None], ForwardOutput | None, None]:
        """The generation loop; appends to `out` (and each token's log-probabilities to `logprobs`, when given) and
        yields (new tokens, finish reason or None) per cycle, and a `VerifyForward` before that (answered with its
        output)."""
        t0 = time.perf_counter()
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        drafter, acc = self.drafter, stats.acceptance
        # the drafter's own cache also holds its speculative nodes past the committed positions
        t = self.tree
        state = drafter.new_state(self.max_len + t.budget + t.depth * t.topk * (t.topk + 1) + 8, self.device)
        wants_ids = getattr(drafter, "needs_token_ids", False)
        cache = slot.cache
        features, stats.reused_prefix_tokens = self._prefill(prompt_ids, slot)
        # committed positions the drafter has not absorbed yet: absorbed in one batch right before the next
        # proposal, so plain cycles (speculation off) cost what plain decoding costs
        pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
        if len(prompt_ids) > 1 and self.speculative:
            ids = torch.tensor(prompt_ids, dtype=torch.long)
            if wants_ids:
                features = {**features, "input_ids": ids[:-1]}
            pending.append((features, ids[1:].to(self.device)))
        if self.speculative and self.adaptive and not self.cost.calibrated:
            self._calibrate(prompt_ids[-1], cache)
            if pending:  # the drafter absorbs the prompt now (it would before its first proposal anyway)
                self._absorb(drafter, state, pending)
            self._calibrate_drafting(drafter, state, prompt_ids[-1])
        stats.prefill_seconds = time.perf_counter() - t0
        # a seeded sampled request must be reproducible: its depths may not depend on measured timings
        seeded = params.seed is not None and not params.greedy
        adaptive = self.adaptive and not seeded
        ctrl = AdaptiveDepth(cost=self.cost, max_depth=self.tree.depth if self.speculative else 0,
                             max_new_tokens=params.max_new_tokens, enabled=adaptive, prior=self._acceptance_prior,
                             kinds=self.kinds_for(params, adaptive))
        if seeded and self.adaptive and ctrl.mode.startswith("fixed"):
            ctrl.mode += " (seeded sampled request: reproducible)"
        root = prompt_ids[-1]
        root_mode = "greedy" if params.greedy else "deterministic"
        enders = self.eos_ids | set(params.stop_token_ids or ())
        while True:
            remaining = params.max_new_tokens - len(out)
            t_draft = time.perf_counter()
            kind, depth = ctrl.choose_plan(remaining)
            if depth > 0:
                if pending:
                    one_cycle = len(pending) == 1  # the last cycle's tokens only (not a plain streak's backlog)
                    self._absorb(drafter, state, pending)
                    if one_cycle:
                        self.cost.observe_absorb(time.perf_counter() - t_draft)
                t_propose = time.perf_counter()
                tree = drafter.propose(state, root, self._tree_for(depth, kind), params, generator)
                # drafts past the last token the request can take are never verified (a graft may reach past `depth`)
                tree = prune_tree(tree, max_depth=remaining - 1, max_nodes=cache.free)
            else:
                tree = DraftTree.root_only(root, root_mode)
            t_verify = time.perf_counter()
            # the forward also runs the output head for the root's first-child chain, the rows verification reads
            # first (shared with the other requests of a batched forward: one product for all of them)
            chain_rows = first_child_chain(tree.parents)
            head_rows = torch.tensor(chain_rows, dtype=torch.long)
            if tree.size == 1 or _is_chain(tree.parents):
                call = VerifyForward(Segment(cache, tree.tokens, logit_rows=head_rows))
            else:
                call = VerifyForward(Segment(cache, tree.tokens, tree.depths, ancestor_mask(tree.parents),
                                             logit_rows=head_rows))
            fwd = yield call
            t_accept = time.perf_counter()
            accepted, next_token, rows = self._accept(tree, fwd, params, generator, chain_rows)
            path = [0, *accepted]
            cache.commit(path)
            t_done = time.perf_counter()
            drafted_depth = tree.max_depth
            acc.draft_seconds += t_verify - t_draft
            acc.verify_seconds += t_accept - t_verify
            acc.accept_seconds += t_done - t_accept
            if drafted_depth > 0:  # the controller models the drafter's own depths (not a graft beyond them)
                ctrl.observe(min(drafted_depth, depth), min(len(accepted), depth), kind)
                self.cost.observe_draft(depth, tree.size - 1, t_verify - t_propose, kind)
            if not call.shared:  # a forward shared with other requests says little about this tree's cost
                self.cost.observe_cycle(tree.size, t_done - t_verify)
            if not out:
                stats.first_token_seconds = t_done - t0
            committed = [int(t) for t in tree.tokens[accepted].tolist()] + [int(next_token)]
            new: list[int] = []
            finish = None
            for tok in committed:
                out.append(tok)
                new.append(tok)
                if tok in enders or (stops and self._hit_stop(out, stops)):
                    finish = "stop"
                elif len(out) >= params.max_new_tokens:
                    finish = "length"
                if finish:
                    break
            # acceptance counts what reached the output: drafts accepted past an EOS / stop are not committed
            acc.record(min(len(accepted), len(new)), drafted_depth=min(drafted_depth, len(new)) if finish
                       else drafted_depth, verified_nodes=tree.size - 1, committed=len(new))
            if logprobs is not None:  # committed token j was drawn from the target's law at node path[j]
                logprobs.extend(rows.token_logprobs(path[:len(new)], new, int(params.logprobs or 0)))
            if finish:
                stats.adaptive = ctrl.report()
                if ctrl.mode == "adaptive":
                    self._acceptance_prior = {k: list(v) for k, v in ctrl.estimates.items()}
                yield new, finish
                return
            if self.speculative:
                idx = torch.tensor(path, device=self.device)
                feats = {k: v[idx] for k, v in fwd.features.items()}
                if wants_ids:
                    feats["input_ids"] = tree.tokens[path]
                pending.append((feats, torch.tensor(committed, dtype=torch.long, device=self.device)))
            yield new, None
            root = int(next_token)

    def _tree_for(self, depth: int, kind: str | None = None) -> TreeConfig:
        """The tree settings of one cycle: the chosen kind (default: the configured one) at the chosen depth
        (`drafters.depth_tree`)."""
        return depth_tree(dataclasses.replace(self.tree, kind=kind) if kind else self.tree, depth)

    @staticmethod
    def _absorb(drafter: Any, state: Any, pending: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """Hand the drafter every pending committed position at once (consecutive positions concatenate)."""
        if len(pending) == 1:
            features, next_tokens = pending[0]
        else:
            keys = pending[0][0].keys()
            features = {k: torch.cat([f[k] for f, _ in pending]) for k in keys}
            next_tokens = torch.cat([n for _, n in pending])
        drafter.absorb(state, features, next_tokens)
        pending.clear()

    def _accept(self, tree: DraftTree, fwd: ForwardOutput, params: SamplingParams,
                generator: torch.Generator | None, premade: list[int] | None = None
                ) -> tuple[list[int], int, TargetRows]:
        """Verify `tree` from its forward: the target rows are made only for the nodes the walk visits (`premade`:
        the nodes whose logits the forward already made, in the order of `fwd.logits`), and kept with their raw
        logits when the request asked for log-probabilities."""
        made = (premade, fwd.logits) if premade and fwd.logits.shape[0] == len(premade) else None
        rows = TargetRows(fwd.hidden, tree.parents, self.runner.logits,
                          lambda logits: self._target_probs(logits, params, tree), premade=made,
                          keep_logits=params.logprobs is not None)
        accepted, next_token = self._verify(tree, rows, params, generator)
        return accepted, next_token, rows

    def _target_probs(self, logits: torch.Tensor, params: SamplingParams, tree: DraftTree) -> torch.Tensor:
        """The filtered target law at some of the tree's nodes: logits [R, V] -> [R, V] (the one sampling
        operator, as plain decoding uses)."""
        return logits_to_probs(logits, params)

    def _verify(self, tree: DraftTree, target_row: Callable[[int], torch.Tensor], params: SamplingParams,
                generator: torch.Generator) -> tuple[list[int], int]:
        """(accepted node indices, next token): `verify_tree_lazy` in the tree's mode ("greedy" at temperature
        0), reading the target law of node i as target_row(i)."""
        return verify_tree_lazy(tree.tokens, tree.parents, target_row, tree.draft_probs,
                                vocab_size=self.runner.vocab_size, mode="greedy" if params.greedy else tree.mode,
                                generator=generator)

    def _prefill(self, prompt_ids: list[int], slot: Slot) -> tuple[dict[str, torch.Tensor], int]:
        """Put the prompt minus its last token into the slot's cache; return its features and the reused length."""
        body = prompt_ids[:-1]
        reuse = _common_prefix(slot.prefix_ids, body) if self.prefix_caching else 0
        slot.cache.reset(reuse)
        new = body[reuse:]
        features = {k: v[:reuse] for k, v in slot.prefix_features.items()} if reuse else {}
        if new:
            fwd = self.runner.forward(slot.cache, torch.tensor(new, dtype=torch.long), logit_rows=_NO_ROWS,
                                      capture=self.speculative)
            slot.cache.commit(list(range(len(new))))
            features = {k: torch.cat([features[k], v]) if k in features else v for k, v in fwd.features.items()}
        slot.prefix_ids, slot.prefix_features = list(body), features
        return features, reuse

    def _calibrate(self, token: int, cache: StaticKVCache) -> None:
        """Measure cycles of 1, 2, 4, 8, ... and budget + 1 nodes (best of 3 after a warm-up) in the scratch slots
        past the committed ones, so the first request's depth choices already rest on this machine's costs. Each is
        timed through the cycle's own forward and verification (`_accept`) on a greedy chain."""
        top = min(self.tree.budget + 1, cache.free)
        sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s < top} | {top})
        if top < 2:
            return
        params = SamplingParams(max_new_tokens=1)
        best: dict[int, float] = {}
        for rep in range(4):
            for size in sizes:
                chain = DraftTree.chain(int(token), [int(token)] * (size - 1), mode="greedy")
                t = time.perf_counter()
                fwd = self.runner.forward(cache, chain.tokens, logit_rows=_NO_ROWS, capture=self.speculative)
                self._accept(chain, fwd, params, None)
                if rep > 0:  # rep 0 warms up
                    best[size] = min(best.get(size, float("inf")), time.perf_counter() - t)
        for size, seconds in best.items():
            self.cost.set_cycle(size, seconds)

    def _calibrate_drafting(self, drafter: Any, state: Any, root: int) -> None:
        """Time proposals of every kind a request may draft (`kinds_for` at T = 1) at every depth (best of 3 after a
        warm-up) on the request's real drafter state: proposing writes only scratch slots, so the state is left as
        it was; sampled kinds draw from a generator of their own (the request's random stream is untouched)."""
        if getattr(state, "last_token", root) != root:
            return
        greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
        warm = SamplingParams(max_new_tokens=1, temperature=1.0)
        for kind in self.kinds_for(warm, adaptive=True):
            params = warm if kind in SAMPLED_KINDS else greedy
            generator = torch.Generator(device=self.device).manual_seed(0) if kind in SAMPLED_KINDS else None
            for depth in range(1, self.tree.depth + 1):
                times, nodes = [], 0
                for _ in range(4):
                    t = time.perf_counter()
                    nodes = drafter.propose(state, root, self._tree_for(depth, kind), params, generator).size - 1
                    times.append(time.perf_counter() - t)
                if nodes > 0:
                    self.cost.set_draft(depth, nodes, min(times[1:]), kind)
