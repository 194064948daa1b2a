"""The bundled runtime's generation loop (docs/architecture.md §7): prefill, then draft -> verify -> commit cycles.

    engine = Engine.from_pretrained(target="data/targets/stdlib-lm", speculator=None | dir | "ngram")
    out = engine.generate("def f(x):", SamplingParams(max_new_tokens=64, temperature=0))
    out.token_ids, out.text, out.stats.tau, out.stats.per_position_acceptance, out.stats.target_calls

Per request (batch 1 here; batching.py runs several in lockstep), one code path on CPU (fp32) and CUDA (bf16):
1. Prefill: the prompt minus its last token goes through the target runner (`module_runner.make_runner`) into the
   static KV cache (a shared prefix with the previous request is reused, features included); the drafter absorbs
   those positions.
2. Each cycle: the root is the last committed token (not yet in the cache). The drafter proposes a tree (its plan
   chosen per cycle by the controller, `adaptive.AdaptiveDepth.choose_plan`: plain = the root alone, prompt lookup
   alone, the model drafter at a depth, or the model drafter with the lookup grafted on; at T > 0 with a drafter
   that samples its own law also the kind: the configured tree, a sampled chain verified by block verification, or
   a sampled tree verified by traversal verification: `SAMPLED_KINDS`), the target runs ONE forward over it with
   the ancestor mask at positions committed + depth, `verify_tree_lazy` picks the accepted path and the next
   token, reading the filtered target law (`sampling.logits_to_probs`, the operator plain decoding uses) of
   only the nodes it visits (`TargetRows` runs the output head for those), the cache keeps only the root +
   accepted path, and the drafter absorbs those positions with their features (next tokens = the accepted
   tokens + the corrected / bonus token).
3. EOS, a `stop_token_ids` token or a stop string inside the committed tokens truncates the output there;
   `max_new_tokens` caps it.

What holds, in which dtype (docs/architecture.md §7):
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

Several requests share each target forward through `batching.generate_batch` / `batching.BatchRunner`, which drive
the same per-request coroutine (`request`) that `stream` drives alone. The steps around a cycle (opening a request,
drafting, observing, closing) are in cycle_steps.py. Not here: CUDA graphs, paged KV, penalties / grammars, HTTP
(server.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from speculators.core.config import DEFAULT_NGRAM_GRAFT, TREE_KINDS, TargetConfig, TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import AcceptanceStats
from speculators.core.sampling import SamplingParams, logits_to_probs
from speculators.core.target import default_tap_layers, eos_token_ids, load_target
from speculators.core.trees import SAMPLED_KINDS, DraftTree, ancestor_mask, verify_mode
from speculators.models.base import FeatureRequest
from speculators.runtime.acceptance_memory import AcceptanceMemory
from speculators.runtime.cycle_costs import CostModel
from speculators.runtime.cycle_steps import (
    choose_plan,
    close_request,
    commit_cycle,
    draft_tree,
    is_chain,
    observe_cycle,
    open_request,
    rebind_request,
    time_last_cycle,
)
from speculators.runtime.drafters.graft import NgramGraft
from speculators.runtime.drafters.load import (
    DrafterInfo,
    NoDrafter,
    default_tree,
    depth_tree,
    load_drafter,
    paired_target,
    target_fingerprint,
)
from speculators.runtime.drafters.model_free import LOOKUP_DEPTH
from speculators.runtime.forward.memory import check_fits
from speculators.runtime.forward.module_runner import make_runner
from speculators.runtime.forward.target_cache import StaticKVCache
from speculators.runtime.forward.target_rows import TargetRows, TokenLogprob, first_child_chain
from speculators.runtime.forward.target_runner import ForwardOutput, Segment
from speculators.runtime.recording import RecordingSpec, TrafficRecorder
from speculators.runtime.requests import (
    GenerateOutput,
    GenerationStats,
    Slot,
    StreamChunk,
    VerifyForward,
    check_prompt,
    encode_prompt,
    final_text,
    take_committed,
)
from speculators.runtime.revisions import DraftRevisions, apply_staged_revision, revision_name, stage_revision
from speculators.runtime.verify.lossless import verify_tree_lazy

DEFAULT_MAX_LEN = 8192


class Engine:
    """A target + a drafter + a static KV cache. Not thread-safe: one `generate` at a time."""

    def __init__(self, target: Any, drafter: Any = None, *, info: DrafterInfo | None = None,
                 tree: TreeConfig | None = None, max_len: int | None = None, adaptive: bool | None = None,
                 prefix_caching: bool = True) -> None:
        self.target = target  # speculators.core.target.LoadedTarget
        self.tokenizer = target.tokenizer
        # a speculator with prompt lookup grafted on: the controller drafts with either, both or neither per cycle
        self.lookup = drafter.lookup if isinstance(drafter, NgramGraft) else None
        self.graft_nodes = drafter.max_new_nodes if isinstance(drafter, NgramGraft) else 0
        self.lookup_depth = LOOKUP_DEPTH if self.lookup is not None else 0  # the lookup's chain drafted alone
        drafter = drafter.drafter if isinstance(drafter, NgramGraft) else drafter
        self.drafter = drafter if drafter is not None else NoDrafter()
        self.info = info or DrafterInfo(getattr(self.drafter, "name", type(self.drafter).__name__),
                                        getattr(self.drafter, "family", getattr(self.drafter, "name", "?")))
        self.speculative = not isinstance(self.drafter, NoDrafter)
        wants = self.drafter.required_features()
        # a drafter that reads hidden states: while it is out, forwards skip capturing them (token ids are free)
        self.reads_hidden = bool(wants.tap_layer_ids) or bool(wants.last_hidden)
        self.runner = make_runner(target.model, wants)
        self.set_tree(tree or default_tree(self.drafter, self.runner.device), adaptive)
        limit = int(getattr(self.target.config, "max_position_embeddings", 0) or DEFAULT_MAX_LEN)
        self.max_len = int(max_len or min(limit, DEFAULT_MAX_LEN))
        self.check_slots(1)
        self.slot = Slot(self.runner.new_cache(self.max_len))  # batch-1 requests run here
        self.eos_ids = set(eos_token_ids(getattr(target.model, "generation_config", None), self.tokenizer))
        self.prefix_caching = prefix_caching
        self.cost = CostModel()
        self.cost_cache = False  # True: costs from / kept in the cache root per machine (cost_cache.py; --cost-cache)
        self.adaptive_requests = 0
        self.acceptance_memory = AcceptanceMemory()  # every request's acceptance, where the next one starts
        self.totals = AcceptanceStats()  # over every request served (the server's /metrics reads it)
        self.recorder: TrafficRecorder | None = None  # served requests written as training rows (`record_to`)
        self.revisions = DraftRevisions(revision_name(self.info))  # swaps between cycles, rollback, per-revision stats

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
        if tree.kind not in TREE_KINDS:
            raise SpeculatorsError(f"tree kind must be one of {', '.join(TREE_KINDS)}, got {tree.kind!r}")
        if tree.verify not in ("sequence", "token"):
            raise SpeculatorsError(f"tree verify must be sequence or token, got {tree.verify!r}")
        self.tree = tree
        self.adaptive = tree.adaptive if adaptive is None else adaptive

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def captures(self) -> bool:
        """Whether forwards capture hidden states at all: for the drafter, or for the traffic recorder."""
        return self.speculative or self.recorder is not None

    def stage_revision(self, speculator: str | None = None) -> str:
        """Stage a draft revision (None: roll back to the previous one) for the next cycle boundary (revisions.py)."""
        return stage_revision(self, speculator)

    def record_to(self, spec: RecordingSpec | None) -> TrafficRecorder | None:
        """Write every request finished from now on as a training row into `spec.directory` (None: stop recording).
        The taps recorded are the drafter's (so its forwards capture nothing more), else the target's default
        EAGLE-3 layers [2, N//2, N-3]. The slots' prefix caches are dropped: their features lack the taps."""
        wants = self.drafter.required_features()
        if self.recorder is not None:
            self.recorder.flush()
        if spec is None:
            self.recorder = None
            self.runner.set_features(wants)
        else:
            layers = list(wants.tap_layer_ids or default_tap_layers(self.runner.num_layers))
            self.runner.set_features(FeatureRequest(tap_layer_ids=tuple(layers), last_hidden=wants.last_hidden))
            cfg = self.target.config
            self.recorder = TrafficRecorder(spec, target=target_fingerprint(self.target), layer_ids=layers,
                                            num_layers=self.runner.num_layers, hidden_size=int(cfg.hidden_size),
                                            vocab_size=self.runner.vocab_size)
        self.slot.prefix_ids, self.slot.prefix_features = [], {}
        return self.recorder

    def kinds_for(self, params: SamplingParams, adaptive: bool) -> tuple[str, ...]:
        """Tree kinds a request may draft, the configured one first: an adaptive request of a drafter that drafts
        from its own law may also draft chains (at T = 0 the argmax chain: one node a level, where a top-k tree's
        extra nodes cost more verification than they win) and at T > 0 sampled trees (`SAMPLED_KINDS`)."""
        if not (adaptive and getattr(self.drafter, "samples_drafts", False)):
            return (self.tree.kind,)
        extra = ("chain",) if params.greedy else SAMPLED_KINDS
        return (self.tree.kind,) + tuple(k for k in extra if k != self.tree.kind)

    @property
    def cache(self) -> StaticKVCache:
        return self.slot.cache

    def check_slots(self, count: int) -> None:
        """Raise SpeculatorsError (one line) before allocating when `count` KV caches of this engine's length
        (those already allocated included) would not fit in the device's available memory."""
        per_slot = self.runner.cache_bytes(self.max_len)
        held = per_slot if getattr(self, "slot", None) is not None else 0
        check_fits(count * per_slot - held, self.device,
                   f"{count} KV cache(s) of {self.max_len} tokens ({per_slot / 2**20:.0f} MiB each)",
                   "lower the concurrency (requests sharing a forward) or the context length (max_len)")

    def new_slot(self) -> Slot:
        """Another KV cache of this engine's size (a batch runs each request in its own slot)."""
        return Slot(self.runner.new_cache(self.max_len))

    # ---- input ----------------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict] | list[int] | torch.Tensor) -> list[int]:
        """Token ids of a raw prompt, a chat (`messages`, through the chat template) or ids as given."""
        return encode_prompt(self.tokenizer, prompt)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise SpeculatorsError (one line) for a request this engine cannot serve."""
        check_prompt(prompt_ids, params, self.runner.vocab_size, self.max_len)

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
                reply = self.runner.forward_batch([item.segment], capture=self.captures and item.capture)[0]
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
            text = final_text(self._decode(out), stops)
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

    def _cycles(self, prompt_ids: list[int], params: SamplingParams, out: list[int], stats: GenerationStats,
                stops: list[str], slot: Slot, logprobs: list[TokenLogprob] | None = None
                ) -> Generator[VerifyForward | tuple[list[int], str | None], ForwardOutput | None, None]:
        """The generation loop; appends to `out` (and each token's log-probabilities to `logprobs`, when given) and
        yields (new tokens, finish reason or None) per cycle, and a `VerifyForward` before that (answered with its
        output). One cycle: draft a tree from the root (the last committed token), verify it with one target
        forward, commit the accepted path + the next token, hand those positions to the drafter."""
        t0 = time.perf_counter()
        req = open_request(self, prompt_ids, params, stats, slot)
        shared = False
        while True:
            remaining = params.max_new_tokens - len(out)
            apply_staged_revision(self)
            if req.drafter is not self.drafter:
                rebind_request(self, req)
            time_last_cycle(self, req, shared)
            t_draft = time.perf_counter()
            plan = choose_plan(self, req, remaining)
            tree, t_propose, model_nodes = draft_tree(self, req, plan, remaining, params, slot.cache)
            t_verify = time.perf_counter()
            # the forward also runs the output head for the root's first-child chain, the rows verification reads
            # first (shared with the other requests of a batched forward: one product for all of them)
            chain_rows = first_child_chain(tree.parents)
            head_rows = torch.tensor(chain_rows, dtype=torch.long)
            capture = (self.speculative and (req.ctrl.wants_features() or not self.reads_hidden)) \
                or req.record is not None
            if tree.size == 1 or is_chain(tree.parents):
                call = VerifyForward(Segment(slot.cache, tree.tokens, logit_rows=head_rows), capture=capture)
            else:
                call = VerifyForward(Segment(slot.cache, tree.tokens, tree.depths, ancestor_mask(tree.parents),
                                             logit_rows=head_rows), capture=capture)
            fwd = yield call
            shared = call.shared
            t_accept = time.perf_counter()
            accepted, next_token, rows = self.accept(tree, fwd, params, req.generator, chain_rows,
                                                     keep_logits=req.record is not None)
            path = [0, *accepted]
            slot.cache.commit(path)
            t_done = time.perf_counter()
            observe_cycle(self, req, stats.acceptance, tree, plan, accepted, model_nodes, call.shared,
                          (t_draft, t_propose, t_verify, t_accept, t_done))
            req.work.captured_forwards += capture
            if not out:
                stats.first_token_seconds = t_done - t0
            committed = [int(t) for t in tree.tokens[accepted].tolist()] + [int(next_token)]
            start = len(out)
            new, finish = take_committed(committed, out, req.enders, stops, params.max_new_tokens, self._decode)
            # acceptance counts what reached the output: drafts accepted past an EOS / stop are not committed
            counted = (min(len(accepted), len(new)), min(tree.max_depth, len(new)) if finish else tree.max_depth,
                       tree.size - 1, len(new))
            stats.acceptance.record(*counted)
            self.revisions.record(req.revision, *counted)
            if logprobs is not None:  # committed token j was drawn from the target's law at node path[j]
                logprobs.extend(rows.token_logprobs(path[:len(new)], new, int(params.logprobs or 0)))
            if req.record is not None:  # committed token j was drawn at node path[j], whose taps the forward made
                taps = fwd.features.get("taps")
                req.record.add_cycle(len(prompt_ids) - 1 + start, tree, path, len(new),
                                     None if taps is None else taps[torch.tensor(path, device=taps.device)],
                                     [rows.logits(n) for n in path[:len(new)]])
            if finish:
                close_request(self, req, stats)
                if req.record is not None and self.recorder is not None:
                    self.recorder.write(req.record, out, req.revision)
                yield new, finish
                return
            feats = None
            if capture:
                idx = torch.tensor(path, device=self.device)
                feats = {k: v[idx] for k, v in fwd.features.items()}
                if req.wants_ids:
                    feats["input_ids"] = tree.tokens[path]
            commit_cycle(self, req, capture, feats, committed, out, start)
            yield new, None
            req.root = int(next_token)

    def tree_for(self, depth: int, kind: str | None = None) -> TreeConfig:
        """The tree settings of one cycle: the chosen kind (default: the configured one) at the chosen depth
        (`drafters.depth_tree`)."""
        return depth_tree(dataclasses.replace(self.tree, kind=kind) if kind else self.tree, depth)

    def accept(self, tree: DraftTree, fwd: ForwardOutput, params: SamplingParams,
                generator: torch.Generator | None, premade: list[int] | None = None, keep_logits: bool = False
                ) -> tuple[list[int], int, TargetRows]:
        """Verify `tree` from its forward: the target rows are made only for the nodes the walk visits (`premade`:
        the nodes whose logits the forward already made, in the order of `fwd.logits`), and kept with their raw
        logits when the request asked for log-probabilities (or `keep_logits`: the recorder's teacher)."""
        made = (premade, fwd.logits) if premade and fwd.logits.shape[0] == len(premade) else None
        rows = TargetRows(fwd.hidden, tree.parents, self.runner.logits,
                          lambda logits: self._target_probs(logits, params, tree), premade=made,
                          keep_logits=keep_logits or params.logprobs is not None)
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
                                vocab_size=self.runner.vocab_size, mode=verify_mode(params, tree.mode),
                                generator=generator)

