"""MTP speculator: a DeepSeek-style multi-token-prediction module trained post hoc on a frozen target.

Architecture (reference medusa-mtp-tree-verify.md §2, vllm-speculators.md §2.7), DeepSeek tensor names without the
`model.layers.{N}.` prefix:
- `eh_proj` Linear(2H -> H, no bias) over cat(enorm(embed(x_{t+1+k})), hnorm(h)) (embedding FIRST, as the released
  DeepSeek weights are consumed);
- `layers.{i}`: plain decoder block(s) in the Llama or Qwen3 layout;
- `shared_head.norm` (RMSNorm, initialised from the target's final norm, trainable) and `shared_head.head` (the
  target's lm_head, frozen); `embed_tokens` (the target's, frozen). Frozen copies are not saved when unchanged.
- step 0 at position t: h = the target's post-norm last hidden at t; step k feeds back the module's own pre-norm
  output of step k-1 (recursive application of the one module), position id t+k, TTT attention
  (`recurrent.RecurrentSpeculator`), so training sees exactly what chain/tree drafting sees.

Config: our own native layout (`mtp_layout: "deepseek"`, transformer_layer_config, verifier, speculators_native);
mtp_format.py names a target's MTP slot, export/mtp_stitch.py writes it. Not here: loss, file I/O, tree policies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from speculators.core.errors import SpeculatorsError
from speculators.models import register_model
from speculators.models.base import FeatureRequest, TargetWeights
from speculators.models.io import tensor_digest
from speculators.models.layers import (
    DecoderLayer,
    DecoderSpec,
    RMSNorm,
    Rotary,
    check_full_vocab,
    dtype_name,
    init_linear_weights,
    target_dims,
    verifier_info,
)
from speculators.models.mtp.mtp_config import MTPConfig
from speculators.models.recurrent import RecurrentSpeculator

if TYPE_CHECKING:
    from speculators.core.config import SpeculatorConfig


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, vocab, bias=False)


@register_model
class MTPSpeculator(RecurrentSpeculator):
    family: ClassVar[str] = "mtp"
    VLLM_METHOD: ClassVar[str | None] = "mtp"
    EXPORTER: ClassVar[str] = "mtp"
    VLLM_SERVED: ClassVar[str] = ("vLLM serves MTP only stitched into a target with a native MTP slot (DeepSeek-V3 "
                                  "style, Qwen3-Next, Qwen3.5; not run in tests here); for every other target (Llama, "
                                  "the house target) no vLLM serves it: only the bundled runtime")
    TARGET_TENSORS: ClassVar[dict[str, str]] = {"embed_tokens.weight": "embed_tokens",
                                                "shared_head.head.weight": "lm_head"}

    def __init__(self, decoder: DecoderSpec, *, num_layers: int, num_steps: int, vocab_size: int, verifier: dict,
                 options: dict) -> None:
        super().__init__()
        if num_layers < 1 or num_steps < 1:
            raise SpeculatorsError(f"mtp needs num_layers >= 1 and num_steps >= 1, got {num_layers}, {num_steps}")
        h, eps = decoder.hidden_size, decoder.rms_norm_eps
        self.decoder = decoder
        self._num_steps, self._vocab_size = int(num_steps), int(vocab_size)
        self.verifier, self.options = dict(verifier), dict(options)
        self.target_tensors: dict[str, dict] = {}
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(decoder) for _ in range(num_layers)])
        self.shared_head = SharedHead(h, vocab_size, eps)
        self.shared_head.head.weight.requires_grad_(False)
        self.rotary = Rotary(decoder)

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_config: Any, spec: SpeculatorConfig, weights: TargetWeights,
                    layer_ids: list[int] | None = None, d2t: torch.Tensor | None = None) -> MTPSpeculator:
        tc, vocab, hidden = target_dims(target_config, weights)
        check_full_vocab("mtp", spec.draft_vocab_size, d2t, vocab)
        if tuple(weights.final_norm.shape) != (hidden,):
            raise SpeculatorsError(f"target final norm has shape {list(weights.final_norm.shape)}, expected [{hidden}]")
        decoder = DecoderSpec.from_target(tc, spec.draft_arch, spec.intermediate_size)
        model = cls(decoder, num_layers=spec.num_layers, num_steps=spec.num_steps, vocab_size=vocab,
                    verifier=verifier_info(target_config), options=MTPConfig.from_recipe(spec).to_dict())
        init_linear_weights(model, decoder.initializer_range)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(weights.embed_tokens)
            model.shared_head.head.weight.copy_(weights.lm_head)
            model.shared_head.norm.weight.copy_(weights.final_norm)
        model.target_tensors = {
            "embed_tokens.weight": {"source": "embed_tokens", **tensor_digest(weights.embed_tokens)},
            "shared_head.head.weight": {"source": "lm_head", **tensor_digest(weights.lm_head)}}
        return model

    def config_dict(self) -> dict:
        return {
            "architectures": ["SpeculatorsMTPModel"],
            "mtp_layout": "deepseek",
            "num_nextn_predict_layers": 1,
            "hidden_size": self.decoder.hidden_size,
            "vocab_size": self._vocab_size,
            "transformer_layer_config": self.decoder.layer_config(self._vocab_size, len(self.layers)),
            "verifier": dict(self.verifier),
            "dtype": dtype_name(self._param.dtype),
            "speculators_native": {"family": self.family, **self.options, "num_steps": self.num_steps,
                                   "num_layers": len(self.layers), "draft_arch": self.decoder.arch,
                                   "target_tensors": dict(self.target_tensors)},
        }

    @classmethod
    def from_config_dict(cls, config: dict) -> MTPSpeculator:
        layer_cfg = config.get("transformer_layer_config")
        native = config.get("speculators_native") or {}
        if not isinstance(layer_cfg, dict) or config.get("mtp_layout") != "deepseek":
            raise SpeculatorsError("mtp config lacks transformer_layer_config or mtp_layout 'deepseek'")
        decoder = DecoderSpec.from_layer_config(layer_cfg)
        options = MTPConfig.from_native(native, num_steps=int(native.get("num_steps") or 1),
                                       num_layers=int(layer_cfg["num_hidden_layers"]), draft_arch=decoder.arch,
                                       draft_vocab_size=None).to_dict()
        model = cls(decoder, num_layers=options["num_layers"], num_steps=options["num_steps"],
                    vocab_size=int(layer_cfg["vocab_size"]), verifier=config.get("verifier") or {}, options=options)
        model.target_tensors = dict(native.get("target_tensors") or {})
        return model

    # ---- identity -----------------------------------------------------------------------------------------------
    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=True)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self._vocab_size, device=self.eh_proj.weight.device)

    # ---- the family's hooks into RecurrentSpeculator ------------------------------------------------------------
    def feature_hidden(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        h = features.get("last_hidden")
        if h is None:
            raise SpeculatorsError("mtp needs the target's final hidden state ('last_hidden') in the features")
        return h

    def step_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.cat((self.enorm(self.embed_tokens(tokens)), self.hnorm(hidden)), dim=-1)  # [..., 2H]
        return self.eh_proj(x), None

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(out))  # [..., V]

