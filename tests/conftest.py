"""Shared test fixtures: tiny random targets built from config (never a download) and the house target.

- `make_tiny_target(path, family)` saves a tiny random causal LM of one model type of `TINY_EXTRAS` (Llama,
  Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Phi-3, gpt-oss, OLMo 2, Llama 4; 8 layers so EAGLE-3 taps 2, N//2, N-3 are
  distinct) with the house tokenizer to a directory and returns its path.
- `house_target` is the embedded default target in data/targets/stdlib-lm (integration tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.vllm.fixtures"]  # the vLLM suite's session fixtures, registered once
HOUSE_TARGET = REPO / "data" / "targets" / "stdlib-lm"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each, for them and
    os.environ["OMP_NUM_THREADS"] = "1"    # for the processes they start (set before anything imports torch)
    os.environ["MKL_NUM_THREADS"] = "1"


def _house_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(HOUSE_TARGET)


# per model type: what a tiny config needs beyond `common` (small sliding windows, so that held-out prompts run
# past them; soft-capping; MoE sizes) -- the architectures the bundled runtime is tested on
TINY_EXTRAS = {
    "llama": {},
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=4, attention_bias=True),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "gemma3_text": dict(sliding_window=8, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2
                        + ["sliding_attention", "full_attention"]),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),  # its defaults lie outside tiny vocabularies
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 4),
    "olmo2": {},
    "llama4_text": dict(intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=8, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2),  # chunked attention (3 of 4 layers), MoE, no-RoPE layers
}
# architectures the bundled runtime refuses (a hybrid of gated delta-net linear attention and full attention)
REFUSED_EXTRAS = {
    "qwen3_next": dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                       mlp_only_layers=[]),
}


def tiny_config(family: str, vocab_size: int, **overrides):
    """A tiny random config of one model type of `TINY_EXTRAS` or `REFUSED_EXTRAS` (hidden 64, 8 layers)."""
    from transformers import AutoConfig

    extras = {**TINY_EXTRAS, **REFUSED_EXTRAS}.get(family)
    if extras is None:
        raise ValueError(f"unknown tiny family {family!r}")
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    common.update(extras)
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


def make_tiny_target(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random target (+ the house tokenizer and its chat template) to `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _house_tokenizer()
    config = tiny_config(family, vocab_size=len(tok), **overrides)
    eos = [tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    config.eos_token_id = eos
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def house_target() -> Path:
    assert (HOUSE_TARGET / "config.json").is_file(), "the house target is missing from data/targets/stdlib-lm"
    return HOUSE_TARGET


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    """A tiny random hybrid linear-attention target (3 gated delta-net layers per full-attention layer): one the
    bundled runtime refuses."""
    return make_tiny_target(tmp_path_factory.mktemp("tiny-qwen3-next"), "qwen3_next")


@pytest.fixture(params=["llama", "qwen3", "qwen3_moe"])
def tiny_target_any(request, tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
