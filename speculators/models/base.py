"""The Speculator interface: the one contract every family (EAGLE-3, Medusa, MTP, DFlash) implements.

The trainer, the evaluator and the runtime only talk to this interface; they never branch on a family's name.

Alignment convention shared by every family (and by the loss, the metrics and the evaluator):
    step k (k = 0..K-1) of the speculator, evaluated at sequence position t, predicts token t+2+k,
    i.e. its target is the TEACHER distribution at position t+1+k (the target's next-token law there).
    It counts toward the loss iff token t+2+k exists and is an assistant token (loss_mask[t+2+k] == 1).
EAGLE-3 step k = the k-th training-time-test step; Medusa step k = head k; MTP step k = the k-th recursive step;
DFlash step k = mask slot k+1 of the block anchored at token t+1.

Runtime protocol (batch 1, called by `speculators.runtime.engine`):
    state = spec.new_state(max_len, device)           # the drafter's own per-request state (its KV cache ...)
    spec.absorb(state, features, next_tokens)          # committed positions p..p+n-1 with the target's
                                                       # features there and the token that follows each one
    tree = spec.propose(state, root_token, tree_cfg, sampling, generator)   # a DraftTree rooted at root_token
`propose` never commits anything: the next `absorb` continues from the committed length.
`features` holds what `required_features()` asked for: "taps" [n, n_taps*H] (the residual stream entering the
tap layers) and/or "last_hidden" [n, H] (the target's post-norm final hidden state).

This module does no file I/O (families implement `state_dict`-level persistence; see models/io.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from speculators.core.config import SpeculatorConfig, TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.core.trees import DraftTree


@dataclass(frozen=True)
class FeatureRequest:
    """What a speculator needs from the target at every position."""

    tap_layer_ids: tuple[int, ...] | None  # residual stream ENTERING these decoder layers (EAGLE-3)
    last_hidden: bool  # the post-norm final hidden state (Medusa, MTP)


@dataclass
class TargetWeights:
    """Frozen tensors a speculator copies from its target at construction."""

    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]


class Speculator(nn.Module, ABC):
    """Base class of every speculator family. Subclasses set `family` and implement the abstract methods."""

    family: ClassVar[str]
    # frozen copies of target tensors: parameter name -> TargetWeights field (io.py saves them only when changed)
    TARGET_TENSORS: ClassVar[dict[str, str]] = {}
    # frozen target copies that a vLLM-format export writes even when they equal the target's (a consumer needs them)
    EXPORT_TARGET_TENSORS: ClassVar[frozenset[str]] = frozenset()
    # how vLLM serves the family's export: its speculative `method`, whether k is fixed to num_steps (no
    # per-batch-size schedule then), and what the vLLM conformance tests (tests/vllm/) showed
    VLLM_METHOD: ClassVar[str | None] = None
    VLLM_FIXED_K: ClassVar[bool] = False
    VLLM_SERVED: ClassVar[str] = "no vLLM serves this family; only the bundled runtime does"
    # how `speculators export` writes the family: "vllm" (a vLLM-format directory, export/vllm.py) or "mtp" (stitched
    # into a target with a native MTP slot, else a native directory, export/mtp_stitch.py)
    EXPORTER: ClassVar[str] = "vllm"
    # capture builds a reduced draft vocabulary (d2t / t2d, `speculator.draft_vocab_size`) for the family
    USES_DRAFT_VOCAB: ClassVar[bool] = False

    @classmethod
    def capture_request(cls, layer_ids: list[int] | None, num_layers: int) -> FeatureRequest:
        """What capture stores for this family before any speculator exists (`layer_ids`: the recipe's
        `capture.layer_ids`); the default is the target's last hidden state. An instance says the same through
        `required_features()`."""
        return FeatureRequest(tap_layer_ids=None, last_hidden=True)

    def derived_tensors(self) -> frozenset[str]:
        """Buffers a file may leave out because the config alone determines them (they keep their constructed
        value when absent, e.g. EAGLE-3's identity d2t / t2d when the draft vocab is the target's)."""
        return frozenset()

    # ---- construction / identity ------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_target(cls, target_config: Any, spec: SpeculatorConfig, weights: TargetWeights,
                    layer_ids: list[int] | None = None, d2t: torch.Tensor | None = None) -> Speculator:
        """Build an untrained speculator for a target (HF config + frozen weights; d2t for reduced vocabs)."""

    @abstractmethod
    def config_dict(self) -> dict:
        """The checkpoint config (vLLM speculators / Medusa layout fields + our own `speculators_native` block)."""

    @classmethod
    @abstractmethod
    def from_config_dict(cls, config: dict) -> Speculator:
        """An uninitialised module with the architecture described by `config_dict()` (weights loaded after)."""

    @property
    @abstractmethod
    def num_steps(self) -> int:
        """K: how many tokens ahead of the root the speculator predicts in training."""

    @abstractmethod
    def required_features(self) -> FeatureRequest: ...

    @property
    @abstractmethod
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] long: target token id of each draft-vocab id (arange(V) for full-vocab speculators)."""

    def step_weights(self, decay: float) -> list[float]:
        return [decay**k for k in range(self.num_steps)]

    # ---- training ---------------------------------------------------------------------------------------------
    @abstractmethod
    def forward_train(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Per-step draft logits over the draft vocab: K tensors [B, T, Vd] (step k at position t targets the
        teacher at t+1+k). `batch` has "input_ids" [B, T], "attention_mask" [B, T] and the requested features
        ("taps" [B, T, n*H] and/or "last_hidden" [B, T, H], float). With "head_rows" (`step_rows`: K long tensors
        [N_k] of flat positions b*T+t) step k's logits are those rows only, [N_k, Vd] (`select_rows`): training
        computes the head, the most expensive part of a step, only where its loss counts."""

    def train_rows(self, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """The "head_rows" a training step computes and scores (the loss masks [B, T]): every position where a step
        counts (`step_rows`); a family may sample a subset (DFlash's anchors). Evaluation always scores them all."""
        return step_rows(loss_mask, attention_mask, self.num_steps)

    # ---- runtime ------------------------------------------------------------------------------------------------
    # proposes sampled chains / trees (TreeConfig kind "chain" / "sampled") that carry the draft law they were drawn
    # from, so the runtime may choose them at T > 0 (block / traversal verification)
    samples_drafts: ClassVar[bool] = True

    @abstractmethod
    def new_state(self, max_len: int, device: torch.device | str) -> Any: ...

    @abstractmethod
    def absorb(self, state: Any, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    @abstractmethod
    def propose(self, state: Any, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree: ...


def speculator_depth(depth: int, num_steps: int) -> int:
    """The chain depth a speculator of K = `num_steps` steps is evaluated, replayed and predicted at when `depth`
    is asked for (evaluate.depth, a chain's k): min(depth, K), as it predicts no token past its K-th step."""
    return min(int(depth), int(num_steps))


def vllm_fixed_k(spec: Speculator) -> int | None:
    """The k vLLM drafts a family's export with when its proposer fixes it (`VLLM_FIXED_K`: the speculator's
    num_steps tokens per step, DFlash's block, Medusa's heads); None when any k may be served."""
    return int(spec.num_steps) if getattr(spec, "VLLM_FIXED_K", False) else None


# ---------------------------------------------------------------------------------------------------------------
# the one loss every family trains with


def shift_for_step(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+1+k] aligned at position t (zero/False padded at the end).  [B, T, ...] -> [B, T, ...]"""
    shift = 1 + k
    out = torch.zeros_like(x)
    if shift < x.shape[1]:
        out[:, : x.shape[1] - shift] = x[:, shift:]
    return out


def step_valid_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor, k: int) -> torch.Tensor:
    """Positions t whose step-k prediction (token t+2+k) counts: that token exists, is real and is an assistant
    token.  [B, T] -> [B, T] bool"""
    shift = 2 + k
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < loss_mask.shape[1]:
        valid[:, : loss_mask.shape[1] - shift] = (loss_mask[:, shift:] > 0) & (attention_mask[:, shift:] > 0)
    return valid


def step_rows(loss_mask: torch.Tensor, attention_mask: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """The positions where each step's prediction counts (`step_valid_mask`), as flat indices b*T+t in
    increasing order: K long tensors [N_k], the "head_rows" of `Speculator.forward_train`."""
    return [step_valid_mask(loss_mask, attention_mask, k).flatten().nonzero().squeeze(-1) for k in range(num_steps)]


def gather_positions(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """A per-position tensor at flat positions b*T+t: [B, T, ...] -> [N, ...] (`flat` [N] long)."""
    return x.flatten(0, 1).index_select(0, flat)


def select_rows(x: torch.Tensor, rows: list[torch.Tensor] | None, k: int) -> torch.Tensor:
    """Step k's rows of a per-position tensor: [B, T, ...] -> [N_k, ...] at `rows[k]`, or `x` unchanged
    without rows."""
    return x if rows is None else gather_positions(x, rows[k])


def live_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The flat positions where any step after the first counts: the sorted union of `rows[1:]` ([N] long)."""
    later = rows[1:]
    if not later:
        return rows[0].new_zeros(0)
    return torch.unique(torch.cat(later))  # sorted
