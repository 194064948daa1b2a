"""The recurrent draft model: the common body of EAGLE-3 and MTP, in training and in drafting.

- `RecurrentSpeculator`: a decoder stack (layers.py) fed (token, hidden), its own pre-norm output — or, with
  `feedback`, its normed output — fed back as the next step's hidden: `forward_train` with K unrolled training-time
  test steps, and the runtime protocol `new_state` / `absorb` / `propose` (tree policies in drafting.py), which see
  exactly the attention pattern training-time test trained on.
- `RecurrentState`: one request's drafter KV cache and its output at the last committed position.
- `RecurrentStepper`: drafts one tree level per batched forward into speculative KV slots beyond the committed
  length.

What it does not do: the layers themselves (layers.py), family-specific inputs/heads (eagle3/eagle3_model.py,
mtp/mtp_model.py), file I/O (io.py), losses (speculators.train).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from speculators.core.errors import SpeculatorsError
from speculators.models.base import Speculator, gather_positions, live_rows, select_rows, shift_for_step
from speculators.models.drafting import propose_tree, root_only
from speculators.models.fused import FusedStack
from speculators.models.kv_cache import KVCache
from speculators.models.layers import DecoderSpec, Rotary, TTTAttention, run_layers, train_mask, train_positions

if TYPE_CHECKING:
    from speculators.core.config import TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.core.trees import DraftTree


@dataclass
class RecurrentState:
    """Per-request drafter state: its KV cache over the committed positions and its output at the last one."""

    cache: KVCache
    stack: FusedStack  # the drafting copy of the decoder stack (fused.py)
    length: int = 0  # committed positions absorbed (slots 0..length-1 hold their keys/values)
    last_hidden: torch.Tensor | None = None  # [H] pre-norm draft output at position length-1
    last_logits: torch.Tensor | None = None  # [Vd] draft logits there (the law of the root's children)
    last_token: int | None = None  # the token that follows position length-1 (= the next tree root)

    @property
    def max_len(self) -> int:
        return self.cache.max_len


class RecurrentSpeculator(Speculator):
    """A draft decoder stack run recurrently: step input = (embedding of the token at t+1+k, hidden), where hidden
    is the target's feature at t for step 0 and the draft's own pre-norm output of step k-1 afterwards; position
    id t+k; attention = TTT pattern. Subclasses define `layers`, `rotary`, `embed_tokens`, `_num_steps`,
    `_vocab_size` and the three hooks."""

    layers: nn.ModuleList
    rotary: Rotary
    decoder: DecoderSpec
    _num_steps: int
    _vocab_size: int

    @abstractmethod
    def feature_hidden(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Step-0 hidden from the target's features: [..., H]."""

    @abstractmethod
    def step_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [...] (target ids), hidden [..., H] -> (x [..., H], hidden for a fused first layer or None)"""

    @abstractmethod
    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [..., H] -> draft logits [..., Vd]."""

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden the next step reads from this step's pre-norm output [..., H]: the output itself (EAGLE-3,
        MTP); EAGLE 3.1's `norm_output` feeds back the final-normed output instead."""
        return out

    @property
    def _param(self) -> torch.Tensor:
        return next(self.parameters())

    # ---- training ---------------------------------------------------------------------------------------------
    def forward_train(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """K unrolled steps (see `Speculator.forward_train`). With "head_rows", steps 1..K-1 also run only at the
        positions where one of them counts (`live_rows`): step k at t reads only step k-1's output at t and the
        keys of steps 1..k at t, so the other positions' later steps change nothing that is trained."""
        ids = batch["input_ids"]  # [B, T]
        am = batch.get("attention_mask")
        if am is None:
            am = torch.ones_like(ids)
        rows = batch.get("head_rows")
        live = None if rows is None or self.num_steps < 2 else live_rows(rows)  # [N] flat positions b*T+t
        dtype = self._param.dtype
        hidden = self.feature_hidden({k: batch[k].to(dtype) for k in ("taps", "last_hidden") if k in batch})
        pos = train_positions(am)  # [B, T]
        ttt = TTTAttention(len(self.layers), train_mask(am))
        logits = []
        for k in range(self.num_steps):
            packed = live is not None and k > 0  # this step runs on [1, N, ...]: the live positions only
            tokens = shift_for_step(ids, k)  # [B, T] token t+1+k at position t
            cos, sin = self.rotary(pos + k, dtype)  # [B, T, hd]
            if packed:
                tokens, cos, sin = (gather_positions(x, live).unsqueeze(0) for x in (tokens, cos, sin))
            x, fused = self.step_input(tokens, hidden)
            out = run_layers(self.layers, x, fused, cos, sin, ttt.for_step(k, live if packed else None))  # [B|1, T|N, H]
            if packed:
                head_in = out[0].index_select(0, torch.searchsorted(live, rows[k]))  # [N_k, H]
            else:
                head_in = select_rows(out, rows, k)
            logits.append(self.head(head_in))  # [B, T, Vd], or [N_k, Vd] with head rows
            hidden = self.feedback(out)
            if live is not None and k == 0:
                hidden = gather_positions(hidden, live).unsqueeze(0)  # [1, N, H]: steps 1.. read it packed
        return logits

    # ---- runtime ------------------------------------------------------------------------------------------------
    def new_state(self, max_len: int, device: torch.device | str) -> RecurrentState:
        d = self.decoder
        return RecurrentState(cache=KVCache(len(self.layers), d.num_key_value_heads, max_len, d.head_dim, device,
                                            self._param.dtype), stack=FusedStack.of(self.layers))

    def run_cached(self, state: RecurrentState, tokens: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """One batched draft forward of S rows: tokens [S], hidden [S, H], positions [S]; keys/values written at
        slots start..start+S-1; mask [S, L] bool over slots [0, L). -> pre-norm output [S, H]"""
        dtype = self._param.dtype
        cos, sin = self.rotary.lookup(positions[None], dtype, upto=state.max_len)  # [1, S, hd]
        x, fused = self.step_input(tokens[None], hidden[None].to(dtype))
        out = state.stack.run_cached(x, fused, cos, sin, state.cache, start, mask)  # [1, S, H]
        return out[0]

    @torch.no_grad()
    def absorb(self, state: RecurrentState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        next_tokens = next_tokens.reshape(-1).to(state.cache.k.device)  # [n]
        n = int(next_tokens.shape[0])
        if n == 0:
            return
        p = state.length
        if p + n > state.max_len:
            raise SpeculatorsError(f"draft state is full: {p} + {n} positions > max_len {state.max_len}; "
                                   "create the state with a larger max_len")
        feats = {k: v.reshape(-1, v.shape[-1]) for k, v in features.items() if k in ("taps", "last_hidden")}
        for k, v in feats.items():
            if v.shape[0] != n:
                raise ValueError(f"absorb: features[{k!r}] has {v.shape[0]} rows for {n} next tokens")
        hidden = self.feature_hidden({k: v.to(self._param.dtype) for k, v in feats.items()})  # [n, H]
        dev = next_tokens.device
        positions = torch.arange(p, p + n, device=dev)  # [n]
        mask = torch.arange(p + n, device=dev)[None, :] <= positions[:, None]  # [n, p+n] causal
        out = self.run_cached(state, next_tokens, hidden, positions, p, mask)  # [n, H]
        state.length = p + n
        state.last_hidden = self.feedback(out[-1])
        state.last_logits = self.head(out[-1:])[0]
        state.last_token = int(next_tokens[-1])

    def stepper(self, state: RecurrentState) -> RecurrentStepper:
        return RecurrentStepper(self, state)

    @torch.no_grad()
    def propose(self, state: RecurrentState, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        if state.last_logits is None:
            return root_only(root_token, sampling)
        if state.last_token is not None and int(root_token) != state.last_token:
            raise ValueError(f"propose: root token {root_token} is not the last absorbed next token "
                             f"{state.last_token}; absorb the committed tokens first")
        return propose_tree(self.stepper(state), int(root_token), tree, sampling, generator,
                            self.draft_to_target, self.vocab_size)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def vocab_size(self) -> int:
        """The target vocabulary size (tree tokens are target ids)."""
        return self._vocab_size


class RecurrentStepper:
    """Drafts tree levels for `drafting.py` on top of a committed `RecurrentState`, writing speculative keys only
    into slots >= state.length (never into the committed ones).

    Node ids are the tree builder's; -1 is the root (whose output is the state's last one). A node at depth d is
    run at position length-1+d with input (its token, its parent's output) and sees the committed slots plus the
    slots of its ancestors and itself — exactly the step-d attention of the training-time test."""

    max_depth = 1 << 30

    def __init__(self, model: RecurrentSpeculator, state: RecurrentState) -> None:
        self.model, self.state = model, state
        self.base = state.length
        self.used = 0
        self.hidden: dict[int, torch.Tensor] = {-1: state.last_hidden}  # node -> [H]
        self.slots: dict[int, list[int]] = {-1: []}  # node -> scratch slots of itself and its ancestors

    @property
    def room(self) -> int:
        return self.state.max_len - self.base - self.used

    def root_logits(self) -> torch.Tensor:  # [Vd]
        return self.state.last_logits

    def step(self, nodes: list[int], tokens: torch.Tensor, parents: list[int], depth: int) -> torch.Tensor:
        """Run nodes (all at `depth` >= 1) -> their logits [F, Vd] (the law of their children)."""
        f = len(nodes)
        if f > self.room:
            raise SpeculatorsError(f"draft state has room for {self.room} speculative nodes, {f} requested")
        dev = self.state.cache.k.device
        start = self.base + self.used
        length = start + f
        mask = torch.zeros(f, length, dtype=torch.bool, device=dev)  # [F, L]
        mask[:, : self.base] = True
        for row, (node, parent) in enumerate(zip(nodes, parents, strict=True)):
            own = self.slots[parent] + [start + row]
            self.slots[node] = own
            mask[row, own] = True
        hidden = torch.stack([self.hidden[p] for p in parents])  # [F, H]
        positions = torch.full((f,), self.base - 1 + depth, dtype=torch.long, device=dev)
        out = self.model.run_cached(self.state, tokens.to(dev), hidden, positions, start, mask)  # [F, H]
        self.used += f
        fed = self.model.feedback(out)  # [F, H]
        for row, node in enumerate(nodes):
            self.hidden[node] = fed[row]
        return self.model.head(out)
