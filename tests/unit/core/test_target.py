"""Target loading, taps (residual stream entering layer k) and fingerprints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from speculators.core.config import TargetConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.target import (
    TapRecorder,
    default_tap_layers,
    fingerprint_target,
    forward_with_taps,
    load_target,
    validate_layer_ids,
)


def test_taps_equal_hf_hidden_states(tiny_target_any: Path) -> None:
    target = load_target(TargetConfig(name_or_path=str(tiny_target_any)), device="cpu")
    ids = torch.randint(0, target.vocab_size, (2, 11))
    layers = default_tap_layers(target.num_layers)
    assert layers == [2, 4, 5]
    out = forward_with_taps(target.model, ids, None, layers)
    with torch.no_grad():
        ref = target.model(input_ids=ids, output_hidden_states=True)
    h = target.hidden_size
    for j, k in enumerate(layers):
        torch.testing.assert_close(out.taps[..., j * h:(j + 1) * h], ref.hidden_states[k])
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[-1])  # HF's last entry is post-norm
    torch.testing.assert_close(out.logits, ref.logits)


def test_layer_ids_validated(tiny_llama: Path) -> None:
    target = load_target(TargetConfig(name_or_path=str(tiny_llama)), device="cpu")
    with pytest.raises(SpeculatorsError, match=r"out of range.*8 decoder layers"):
        TapRecorder(target.model, [2, 8])
    with pytest.raises(SpeculatorsError, match="duplicates"):
        validate_layer_ids([2, 2], 8)
    with pytest.raises(SpeculatorsError, match=r"must be increasing \(\[2, 4, 5\]\): vLLM sorts"):
        validate_layer_ids([5, 2, 4], 8)


def test_a_causal_lm_whose_get_decoder_is_itself_still_exposes_its_layers() -> None:
    """Llama 4 text models: `get_decoder()` returns the causal LM; capture and the runtime find `.model.layers`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from speculators.core.target import decoder_layers, final_norm
    from speculators.runtime.forward.module_runner import make_runner

    cfg = AutoConfig.for_model("llama4_text", vocab_size=300, hidden_size=64, intermediate_size=128,
                               intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_local_experts=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert len(decoder_layers(model)) == 4 and final_norm(model) is model.model.norm
    make_runner(model)  # its load-time probe: tree-masked forward = the model's own


def test_fingerprint_stable_and_sensitive(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    a = fingerprint_target(TargetConfig(name_or_path=str(tiny_llama)))
    b = fingerprint_target(TargetConfig(name_or_path=str(tiny_llama)))
    assert a == b and a.revision.startswith("local:")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    c = fingerprint_target(TargetConfig(name_or_path=str(copy)))
    assert c.content_hash == a.content_hash  # same bytes, same identity
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    key = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[key] = weights[key] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    d = fingerprint_target(TargetConfig(name_or_path=str(copy)))
    assert d.content_hash != a.content_hash and d.revision != a.revision
    assert d.tokenizer_hash == a.tokenizer_hash
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    e = fingerprint_target(TargetConfig(name_or_path=str(copy)))
    assert e.tokenizer_hash != a.tokenizer_hash


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(SpeculatorsError, match="target not found"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "missing")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpeculatorsError, match="no config.json"):
        load_target(TargetConfig(name_or_path=str(empty)))
    (empty / "config.json").write_text("{oops")
    with pytest.raises(SpeculatorsError, match="not valid JSON"):
        load_target(TargetConfig(name_or_path=str(empty)))
