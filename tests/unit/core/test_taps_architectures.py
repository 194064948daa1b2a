"""EAGLE-3 tap semantics per architecture (tests/architectures.py: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Phi-3,
gpt-oss, Granite, ERNIE-4.5, Apertus, OLMo-2, Gemma-3, DeepSeek-V3, MiniMax-M2, Qwen3-Next, Gemma-4). Our capture
(`forward_with_taps`: the residual stream ENTERING decoder layer k) must equal three references, for every layer k of
a tiny random target of each architecture, in fp32:

- the input of decoder layer k, copied at the moment the layer receives it. This test's own forward pre-hook clones
  it: a layer that wrote into its input in place would break a capture that keeps a reference;
- what vLLM 0.32 feeds its EAGLE-3 drafter for layer id k, computed here from the embedding table and from forward
  hooks on layer k-1. `EagleModelMixin._maybe_add_hidden_state` gives, before layer 0, the output of
  `embed_input_ids`, which includes the architecture's embedding scaling, and after layer k-1 its
  `hidden_states + residual`, i.e. the full output of layer k-1. (DeepSeek's own loop adds the same sum before
  layer k. The Transformers backend records layer k-1's output with an `OutputRecorder`.);
- Hugging Face's `output_hidden_states[k]`.

Gemma-3 and Gemma-4 scale the embedding by sqrt(hidden) inside their embedding modules, and Granite scales it by
`embedding_multiplier` in its model forward. For all three the residual entering layer 0 is the scaled embedding,
not the table's row."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.core.target import decoder_layers, forward_with_taps, input_embeddings
from tests.architectures import ARCHITECTURES, NUM_LAYERS, tiny_model
from tests.conftest import HOUSE_TARGET


@pytest.fixture(scope="module")
def house_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(HOUSE_TARGET)


def _embedding_factor(config) -> float:
    """The scale vLLM's `embed_input_ids` (+ the model forward before layer 0) applies to the embedding row."""
    if config.model_type.startswith("gemma"):
        return math.sqrt(config.hidden_size)  # vLLM gemma3.py / gemma4.py: normalizer = hidden_size ** 0.5
    if config.model_type == "granite":
        return float(config.embedding_multiplier)  # vLLM granite.py: `hidden_states *= embedding_multiplier`
    return 1.0


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_taps_are_the_residual_entering_each_layer(model_type: str, house_tokenizer) -> None:
    model = tiny_model(model_type, house_tokenizer)
    layers = decoder_layers(model)
    assert len(layers) == NUM_LAYERS
    ids = torch.randint(0, len(house_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    entering: dict[int, torch.Tensor] = {}
    leaving: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: entering.__setitem__(
                i, (args[0] if args else kwargs["hidden_states"]).detach().clone()), with_kwargs=True))
        handles.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: leaving.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).detach().clone())))
    try:
        with torch.no_grad():
            ref = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    ours = forward_with_taps(model, ids, None, list(range(NUM_LAYERS)))
    h = model.config.hidden_size
    table = input_embeddings(model).weight.detach()
    embedded = table[ids] * _embedding_factor(model.config)  # [B, T, H]: what vLLM's tap 0 is
    for k in range(NUM_LAYERS):
        tap = ours.taps[..., k * h:(k + 1) * h]
        torch.testing.assert_close(tap, entering[k], rtol=0, atol=0, msg=f"{model_type} layer {k}: pre-hook copy")
        vllm_tap = embedded if k == 0 else leaving[k - 1]
        torch.testing.assert_close(tap, vllm_tap, rtol=1e-6, atol=1e-6,
                                   msg=f"{model_type} layer {k}: vLLM's aux hidden state")
        torch.testing.assert_close(tap, ref.hidden_states[k], rtol=0, atol=0,
                                   msg=f"{model_type} layer {k}: HF hidden_states[{k}]")
    if _embedding_factor(model.config) != 1.0:  # the scaled embedding really differs from the table's rows
        assert not torch.allclose(ours.taps[..., :h], table[ids])
    torch.testing.assert_close(ours.logits, ref.logits)
