"""TargetRunner: the compact forward equals Hugging Face's (logits, taps, last hidden), over prompts, trees with
ancestor masks, after KV commits, with sliding windows; unsupported layouts fail with one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from speculators.core.errors import SpeculatorsError
from speculators.core.trees import ancestor_mask, depths_of
from speculators.models.base import FeatureRequest
from speculators.runtime.forward.module_runner import make_runner
from speculators.runtime.forward.target_runner import Segment, TargetRunner
from tests.conftest import tiny_config
from tests.unit.runtime.runtime_helpers import check_runner_against_hf, single_thread  # noqa: F401

ATOL = 1e-4
VOCAB = 300


def _model(family: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tiny_config(family, VOCAB, **overrides)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _mistral(window: int) -> torch.nn.Module:
    from transformers import MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                        max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _check_against_hf(model: torch.nn.Module, taps: tuple[int, ...] = (1, 2)) -> None:
    check_runner_against_hf(TargetRunner(model, FeatureRequest(tap_layer_ids=taps, last_hidden=True)), model, taps)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_matches_hf_forward(family: str) -> None:
    _check_against_hf(_model(family), taps=(2, 4, 5))


def test_matches_hf_forward_qwen2_with_bias() -> None:
    from transformers import Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    _check_against_hf(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())


def test_sliding_window_matches_hf() -> None:
    _check_against_hf(_mistral(window=6))


def test_no_features_when_not_requested() -> None:
    runner = TargetRunner(_model("llama"), None)
    out = runner.forward(runner.new_cache(8), torch.tensor([1, 2, 3]), logit_rows=torch.tensor([2]))
    assert out.features == {} and out.logits.shape == (1, VOCAB)


def test_unsupported_target_fails_with_one_line() -> None:
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(SpeculatorsError, match="cannot run target model type 'gpt2'") as err:
        TargetRunner(model, None)
    assert "\n" not in str(err.value)


def test_taps_out_of_range_are_refused() -> None:
    with pytest.raises(SpeculatorsError, match=r"layers \[8\]"):
        TargetRunner(_model("llama"), FeatureRequest(tap_layer_ids=(2, 8), last_hidden=False))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_path_is_used_and_leaves_the_hf_model_unchanged(family: str) -> None:
    model = _model(family)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    runner = TargetRunner(model, None)
    assert runner.fused is not None and runner.plain_rope
    with torch.no_grad():
        after = model(ids).logits  # q/k/v and gate/up now share storage with the fused matrices
    assert torch.equal(before, after)
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == runner.fused[0].qkv_weight.data_ptr()
    again = TargetRunner(model, None)  # a second engine on the same target shares the fused matrices
    assert all(a.qkv_weight is b.qkv_weight and a.gate_up_weight is b.gate_up_weight
               for a, b in zip(runner.fused, again.fused, strict=True))
    fused = runner.forward(runner.new_cache(16), ids[0]).logits
    runner.fused = None  # the module-by-module path
    torch.testing.assert_close(runner.forward(runner.new_cache(16), ids[0]).logits, fused, atol=1e-5, rtol=0)


def test_adapters_and_moe_keep_the_module_path() -> None:
    from peft import LoraConfig, get_peft_model

    assert TargetRunner(_model("qwen3_moe"), None).fused is None
    lora = get_peft_model(_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert TargetRunner(lora, None).fused is None


@pytest.mark.parametrize("family, path", [("llama", "fused"), ("qwen3", "fused"), ("gemma3_text", "modules"),
                                          ("llama", "modules")])
def test_forward_batch_equals_one_forward_per_sequence(family: str, path: str) -> None:
    """Three sequences in one pass — a prompt from slot 0, a tree after a prefix, one token — give each the
    logits, features and cache entries of its own forward."""
    model = _model(family)
    runner = make_runner(model, FeatureRequest(tap_layer_ids=(1, 2), last_hidden=True), path=path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (30,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tree_tokens = torch.randint(0, VOCAB, (6,), generator=g)

    def fresh() -> list:
        caches = [runner.new_cache(64) for _ in range(3)]
        runner.forward(caches[1], ids[:9])
        caches[1].commit(list(range(9)))
        runner.forward(caches[2], ids[10:22])
        caches[2].commit(list(range(12)))
        return caches

    alone_caches, batch_caches = fresh(), fresh()
    segments = [lambda c: Segment(c[0], ids[:7]),
                lambda c: Segment(c[1], tree_tokens, depths_of(parents), ancestor_mask(parents)),
                lambda c: Segment(c[2], ids[22:23], logit_rows=torch.tensor([0]))]
    alone = [runner.forward_batch([make(alone_caches)])[0] for make in segments]
    together = runner.forward_batch([make(batch_caches) for make in segments])
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-5, rtol=0)
        assert b.features.keys() == a.features.keys() == {"taps", "last_hidden"}
        for key in a.features:
            torch.testing.assert_close(b.features[key], a.features[key], atol=1e-5, rtol=0)
    for ca, cb in zip(alone_caches, batch_caches, strict=True):
        torch.testing.assert_close(cb.kv, ca.kv, atol=1e-5, rtol=0)
    assert [o.logits.shape[0] for o in together] == [7, 6, 1]
    # and the batch agrees with Hugging Face for the prompt sequence
    with torch.no_grad():
        ref = model(ids[None, :7]).logits[0]
    torch.testing.assert_close(together[0].logits, ref, atol=ATOL, rtol=0)
