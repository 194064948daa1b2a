"""ModuleTargetRunner (the runtime's general path through the model's own modules): for every tested architecture
the forward over prompts, decoy trees after KV commits, chains and single tokens equals the Hugging Face forward
(logits, taps, last hidden; sliding windows shorter than the context); the per-layer window masks and the load-time
probe are load-bearing (broken variants fail); architectures it cannot run are refused in one line."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from speculators.core.errors import SpeculatorsError, UnsupportedTargetError
from speculators.models.base import FeatureRequest
from speculators.runtime.forward import module_runner
from speculators.runtime.forward.module_runner import ModuleTargetRunner, TargetRunner, make_runner
from tests import architectures
from tests.conftest import TINY_EXTRAS, tiny_config
from tests.unit.runtime.runtime_helpers import check_runner_against_hf, single_thread  # noqa: F401

VOCAB = 300
TAPS = (0, 2, 4, 5)
WINDOWED = ("mistral", "qwen2", "gemma3_text", "gpt_oss", "llama4_text")


def _model(model_type: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, VOCAB, **overrides), dtype=torch.float32).eval()


def _runner(model: torch.nn.Module) -> ModuleTargetRunner:
    return ModuleTargetRunner(model, FeatureRequest(tap_layer_ids=TAPS, last_hidden=True))


@pytest.mark.parametrize("model_type", list(TINY_EXTRAS))
def test_matches_hf_forward(model_type: str) -> None:
    model = _model(model_type)
    check_runner_against_hf(_runner(model), model, TAPS)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_auto_keeps_the_fused_path_for_the_llama_family(model_type: str) -> None:
    model = _model(model_type)
    assert type(make_runner(model)) is TargetRunner
    assert type(make_runner(model, path="modules")) is ModuleTargetRunner
    with pytest.raises(SpeculatorsError, match="runner path must be"):
        make_runner(model, path="fast")


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3", "gpt_oss", "olmo2", "llama4_text"])
def test_auto_takes_the_module_path_elsewhere(model_type: str) -> None:
    assert type(make_runner(_model(model_type))) is ModuleTargetRunner


def test_windows_and_chunks_are_read_per_layer() -> None:
    s, c = ("sliding", 8), ("chunked", 8)
    gemma = _model("gemma3_text")
    assert module_runner.layer_restrictions(list(gemma.model.layers), gemma.config) == [s, s, None, s, s, None, s,
                                                                                        None]
    mistral = _model("mistral")
    assert module_runner.layer_restrictions(list(mistral.model.layers), mistral.config) == [s] * 8
    llama4 = _model("llama4_text")
    assert module_runner.layer_restrictions(list(llama4.model.layers), llama4.config) == [c, c, c, None] * 2


@pytest.mark.parametrize("model_type", WINDOWED)
def test_without_the_window_masks_the_forward_differs(model_type: str, monkeypatch) -> None:
    """BROKEN on purpose: every layer attends to the whole context. The parity check must catch it, i.e. the 20-token
    check really runs past the 8-token windows / chunks."""
    model = _model(model_type)
    runner = _runner(model)  # built (and probed) before the break
    monkeypatch.setattr(module_runner, "_masked", lambda attn, mask: contextlib.nullcontext())
    with pytest.raises(AssertionError):
        check_runner_against_hf(runner, model, TAPS)


def test_the_probe_refuses_a_forward_that_differs(monkeypatch) -> None:
    """BROKEN on purpose: the output head without Gemma's final soft-capping. Construction must refuse it."""
    monkeypatch.setattr(ModuleTargetRunner, "logits", lambda self, rows: self.lm_head(rows))
    with pytest.raises(UnsupportedTargetError, match="'gemma3_text': its forward through a tree mask .* differs"):
        ModuleTargetRunner(_model("gemma3_text", final_logit_softcapping=2.0), None)


def test_the_probe_refuses_a_cache_that_is_not_read(monkeypatch) -> None:
    """BROKEN on purpose: the cache hands back only the new keys/values (the committed prefix is lost)."""
    monkeypatch.setattr(module_runner.CacheWriter, "update",
                        lambda self, k, v, layer_idx, *a, **kw: (self.written.__setitem__(layer_idx, ((1, 1), (1, 1)))
                                                                 or (k, v)))
    with pytest.raises(UnsupportedTargetError, match="'phi3': its forward (does not run|.* differs)"):
        ModuleTargetRunner(_model("phi3"), None)


ARCH_REFUSED = {"deepseek_v3": "its keys/values have several shapes", "qwen3_next": r"decoder layers \[0, 1, 2, 4"}
REFUSED = {  # model type -> (config, what the one line must say)
    "lfm2": (dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"]),
             r"decoder layers \[0, 2\] have no self-attention"),
    "mamba": (dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8),
              r"decoder layers \[0, 1\] have no self-attention"),
    "deepseek_v3": (dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                         topk_group=1),
                    "its keys/values have several shapes"),
    "gpt2": (dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2), "no decoder layers found"),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_architectures_it_cannot_run_are_refused_in_one_line(model_type: str) -> None:
    config, why = REFUSED[model_type]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32).eval()
    with pytest.raises(UnsupportedTargetError, match=f"cannot run target model type '{model_type}': {why}") as err:
        make_runner(model)
    assert "\n" not in str(err.value) and "vLLM" in str(err.value)


@pytest.mark.parametrize("model_type", architectures.ARCHITECTURES)
def test_vllm_suite_architectures_run_or_are_refused(model_type: str) -> None:
    """The tiny targets of the tap / vLLM suites (tests/architectures.py: Granite's multipliers, ERNIE, Apertus,
    MiniMax-M2, Gemma 4's per-layer inputs, ...): the runtime matches HF, or refuses in one line what it cannot run."""
    from transformers import AutoTokenizer

    from tests.conftest import HOUSE_TARGET

    model = architectures.tiny_model(model_type, AutoTokenizer.from_pretrained(HOUSE_TARGET))
    features = FeatureRequest(tap_layer_ids=(2, 4, 5), last_hidden=True)
    if model_type in ARCH_REFUSED:
        with pytest.raises(UnsupportedTargetError, match=f"'{model_type}': {ARCH_REFUSED[model_type]}"):
            make_runner(model, features)
        return
    check_runner_against_hf(make_runner(model, features), model, (2, 4, 5))
