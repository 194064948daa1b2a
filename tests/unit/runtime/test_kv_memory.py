"""KV memory sized by the work and refused before it is allocated, on a model of a real target's shape.

SmolLM2-135M-Instruct's shape (30 layers, 3 KV heads of 64, vocab 49,152; random weights built from config, never a
download): 64 slots of its 8,192-token context need ~24 GB, which killed regeneration and evaluation before the
engines were sized by the rows they serve.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from speculators.core.config import TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams
from speculators.core.target import LoadedTarget
from speculators.runtime.batch_generate import TREE_ROOM, EngineGenerator
from speculators.runtime.batching import BatchRunner
from speculators.runtime.engine import Engine
from speculators.runtime.forward.memory import available_bytes, check_fits, work_max_len
from tests.conftest import HOUSE_TARGET

SMOLLM2_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                     rope_theta=100000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (k, v) x KV heads x head dim x fp32


@pytest.fixture(scope="module")
def smollm2_shaped() -> LoadedTarget:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(HOUSE_TARGET)
    return LoadedTarget(model=model, tokenizer=tok, device="cpu", dtype=torch.float32,
                        cfg=TargetConfig(name_or_path="smollm2-shaped", device="cpu", dtype="float32"))


def test_work_max_len_is_the_longest_request_plus_a_tree():
    assert work_max_len([10, 300, 20], 128, tree_nodes=64) == 300 + 128 + 64 + 1
    assert work_max_len([10, 300], [500, 1], tree_nodes=0) == 511
    assert work_max_len([], 5) == 2
    with pytest.raises(ValueError):
        work_max_len([1, 2], [3])


def test_check_fits_refuses_in_one_line():
    check_fits(1024, "cpu", "a cache", "lower it")
    with pytest.raises(SpeculatorsError) as exc:
        check_fits(available_bytes("cpu") * 4, "cpu", "64 KV caches", "lower the concurrency")
    assert "\n" not in str(exc.value) and "64 KV caches need" in str(exc.value) and "lower the concurrency" in \
        str(exc.value)


def test_batched_generation_caches_hold_the_rows_not_the_context(smollm2_shaped):
    """64 concurrent rows of data.max_length 1,024: the runtime's slots hold 1,024 tokens + a draft tree each (3 GB
    in all), not 8,192 (24 GB), and the generation runs."""
    gen = EngineGenerator(smollm2_shaped, "ngram", 64, 1024)
    assert gen.engine.max_len == 1024 + TREE_ROOM
    assert gen.engine.runner.cache_bytes(gen.engine.max_len) == KV_BYTES_PER_TOKEN * (1024 + TREE_ROOM)
    assert gen.engine.cache.kv.numel() * 4 == KV_BYTES_PER_TOKEN * (1024 + TREE_ROOM)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = gen.generate(prompts, [SamplingParams(max_new_tokens=6, temperature=0.0)] * 2)
    ref = Engine.from_pretrained(smollm2_shaped, None, max_len=64)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == ref.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0)).token_ids


def test_more_slots_than_memory_are_refused_before_allocating(smollm2_shaped):
    engine = Engine.from_pretrained(smollm2_shaped, None, max_len=8192)
    assert engine.max_len == 8192
    too_many = available_bytes("cpu") // engine.runner.cache_bytes(8192) + 2
    with pytest.raises(SpeculatorsError) as exc:
        BatchRunner(engine, too_many)
    message = str(exc.value)
    assert "\n" not in message and f"{too_many} KV cache(s) of 8192 tokens" in message and "concurrency" in message
    with pytest.raises(SpeculatorsError, match="KV cache"):
        EngineGenerator(smollm2_shaped, "ngram", too_many, 8192)
    BatchRunner(engine, 2)  # what fits is accepted
