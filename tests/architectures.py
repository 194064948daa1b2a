"""Tiny random targets of many Hugging Face decoder architectures. Each is built from a config (never downloaded)
and uses the house tokenizer. The tap-semantics unit test (tests/unit/core/test_taps_architectures.py) and the vLLM
conformance suite (tests/vllm/test_vllm_architectures.py) build their targets here.

Every target has:
- 8 decoder layers, so that EAGLE-3's default taps 2, N//2, N-3 = 2, 4, 5 are distinct;
- hidden size 128, two query heads of size 64 (a head size vLLM's CPU attention has kernels for) and one KV head;
- a maximum length of 1024 (the vLLM suite's --max-model-len);
- the house tokenizer's vocabulary, EOS ids and pad id.

The per-architecture overrides make each family's peculiarities non-trivial: embedding and residual multipliers,
sliding windows, MoE, post-norms, latent attention, linear attention. These are where "the residual stream entering
layer k" could differ between an architecture's Hugging Face forward and vLLM's, and where vLLM's CPU kernels have
constraints. tests/conftest.py's `TINY_EXTRAS` (hidden 64, head size 16, 512 positions: the bundled runtime's tests)
is too small for vLLM's CPU kernels. llama4_text is absent: `speculators.core.target.decoder_layers` finds no layers in
it, because transformers 5.25's `Llama4ForCausalLM.get_decoder()` returns the causal LM itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NUM_LAYERS = 8
HIDDEN = 128


def _common(vocab: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                rms_norm_eps=1e-5, tie_word_embeddings=False)


def _alternating(n: int, every: int) -> list[str]:
    """layer_types: sliding windows with a full-attention layer every `every` layers."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


# model_type -> overrides of the common tiny config
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "phi3": {"sliding_window": None, "original_max_position_embeddings": 1024},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, "sliding_window": 16,
                "layer_types": _alternating(NUM_LAYERS, 2)},  # HF's default yarn rope (vLLM's gpt_oss.py reads it)
    # Granite scales the embedding (embedding_multiplier) before layer 0 and every block's output by
    # residual_multiplier: the residual entering layer 0 is NOT the embedding table's row
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.125,
                "logits_scaling": 2.0},
    "ernie4_5": {},
    "apertus": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # OLMo-2 normalises the attention / MLP OUTPUTS (post-norm) before adding them to the residual
    "olmo2": {},
    # Gemma-3 scales the embedding by sqrt(hidden) inside its embedding module (the residual entering layer 0 is the
    # scaled embedding), has sandwich norms and sliding-window layers
    "gemma3_text": {"query_pre_attn_scalar": 64, "sliding_window": 16, "layer_types": _alternating(NUM_LAYERS, 4),
                    "hidden_activation": "gelu_pytorch_tanh"},
    "deepseek_v3": {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 64, "head_dim": 64,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                    "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "rope_interleave": True, "num_nextn_predict_layers": 0, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid"},
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "rotary_dim": 64,
                   "scoring_func": "sigmoid", "use_routing_bias": True},
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                   "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                   "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                   for i in range(NUM_LAYERS)]},
    "gemma4_text": {"sliding_window": 16, "layer_types": _alternating(NUM_LAYERS, 4), "hidden_size_per_layer_input": 16,
                    "vocab_size_per_layer_input": None, "global_head_dim": 64},
}

ARCHITECTURES = tuple(OVERRIDES)


def tiny_config(model_type: str, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    if model_type not in OVERRIDES:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(OVERRIDES)}")
    kwargs = {**_common(len(tokenizer)), **OVERRIDES[model_type]}
    if kwargs.get("vocab_size_per_layer_input", 0) is None:
        kwargs["vocab_size_per_layer_input"] = kwargs["vocab_size"]
    eos = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    kwargs.update(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, tokenizer: Any, seed: int = 0) -> Any:
    """A tiny random causal LM of `model_type` (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tokenizer), dtype=torch.float32)
    return model.eval()


def save_tiny_target(path: Path, model_type: str, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a tiny random target of `model_type` with the house tokenizer and its chat template to `path`."""
    import torch
    from transformers import AutoTokenizer

    from tests.conftest import HOUSE_TARGET

    tok = AutoTokenizer.from_pretrained(HOUSE_TARGET)
    model = tiny_model(model_type, tok, seed=seed)
    model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
