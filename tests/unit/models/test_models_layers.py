"""The shared draft decoder (speculators/models/layers.py): layout equals HF Llama/Qwen3, attention paths agree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from models_helpers import (
    VOCAB,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    tiny_target,
)

from speculators.core.errors import SpeculatorsError
from speculators.models.kv_cache import KVCache, cached_attention
from speculators.models.layers import (
    DecoderLayer,
    DecoderSpec,
    RMSNorm,
    Rotary,
    TTTAttention,
    run_layers,
    train_mask,
    ttt_attention,
)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _our_stack(cfg, target, arch):
    spec = DecoderSpec.from_target(cfg, arch)
    layer = DecoderLayer(spec)
    layer.load_state_dict({k.removeprefix("model.layers.0."): v for k, v in target.state_dict().items()
                           if k.startswith("model.layers.0.")}, strict=True)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data.copy_(target.model.norm.weight)
    return spec, torch.nn.ModuleList([layer]), Rotary(spec), norm


@pytest.mark.parametrize("family,rope", [("llama", None), ("qwen3", None), ("llama", LLAMA3_ROPE)])
def test_decoder_layer_matches_hf(family, rope):
    overrides = {"num_hidden_layers": 1}
    if rope:
        overrides["rope_parameters"] = rope
    cfg, target = tiny_target(family, **overrides)
    spec, layers, rotary, norm = _our_stack(cfg, target, family)
    if rope:
        assert spec.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = target(input_ids=ids).logits  # [2, 12, V]
    x = target.model.embed_tokens(ids)
    pos = torch.arange(12)[None].expand(2, -1)
    cos, sin = rotary(pos, x.dtype)
    out = run_layers(layers, x, None, cos, sin, TTTAttention(1, train_mask(torch.ones(2, 12))).for_step(0))
    got = target.lm_head(norm(out))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    # the KV-cached drafting path, fed in two chunks, gives the same logits
    cache = KVCache(1, spec.num_key_value_heads, 32, spec.head_dim, "cpu", torch.float32)
    rows = []
    for lo, hi in ((0, 5), (5, 12)):
        p = torch.arange(lo, hi)
        mask = torch.arange(hi)[None, :] <= p[:, None]
        c, s = rotary(p[None], x.dtype)
        rows.append(run_layers(layers, x[:1, lo:hi], None, c, s, cache.attend_fn(lo, mask)))
    torch.testing.assert_close(target.lm_head(norm(torch.cat(rows, 1))), want[:1], atol=1e-5, rtol=1e-4)


def test_qwen3_layout_has_qk_norm_and_llama_does_not():
    cfg, _ = tiny_target("llama")
    names_q = set(DecoderLayer(DecoderSpec.from_target(cfg, "qwen3")).state_dict())
    names_l = set(DecoderLayer(DecoderSpec.from_target(cfg, "llama")).state_dict())
    assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= names_q
    assert not any("q_norm" in n for n in names_l)
    with pytest.raises(SpeculatorsError):
        DecoderSpec.from_target(cfg, "mistral")


def test_layer_config_roundtrip_and_moe_intermediate_fallback():
    cfg, _ = tiny_target("qwen3_moe")
    spec = DecoderSpec.from_target(cfg, "llama")
    assert spec.intermediate_size == cfg.intermediate_size
    no_dense = SimpleNamespace(**{k: v for k, v in cfg.to_dict().items() if k != "intermediate_size"})
    assert DecoderSpec.from_target(no_dense, "llama").intermediate_size == 3 * cfg.hidden_size
    assert DecoderSpec.from_target(cfg, "llama", intermediate_size=96).intermediate_size == 96
    d = spec.layer_config(VOCAB, 1)
    assert DecoderSpec.from_layer_config(d) == spec
    cfg2, _ = tiny_target("llama", rope_parameters=LLAMA3_ROPE)
    d2 = DecoderSpec.from_target(cfg2, "qwen3").layer_config(VOCAB, 1)
    assert d2["rope_theta"] == 500000.0 and d2["rope_scaling"]["rope_type"] == "llama3"
    assert DecoderSpec.from_layer_config(d2).rope_parameters == LLAMA3_ROPE


def _dense_reference(q, keys, values, allowed):
    """Plain attention over an explicit key list: q [B,nh,T,hd], keys/values [B,nkv,L,hd], allowed [B,T,L]."""
    g = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, 1)
    v = values.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v


def test_ttt_attention_equals_dense_attention_over_the_ttt_key_set():
    g = torch.Generator().manual_seed(0)
    b, nh, nkv, t, hd, steps = 2, 4, 2, 7, 8, 3
    am = torch.ones(b, t, dtype=torch.long)
    am[1, 5:] = 0  # right padding in row 1
    q = torch.randn(b, nh, t, hd, generator=g)
    k0, v0 = torch.randn(b, nkv, t, hd, generator=g), torch.randn(b, nkv, t, hd, generator=g)
    dk = [torch.randn(b, nkv, t, hd, generator=g) for _ in range(steps)]
    dv = [torch.randn(b, nkv, t, hd, generator=g) for _ in range(steps)]
    got = ttt_attention(q, k0, v0, train_mask(am), dk, dv)
    # reference: keys = [step-0 keys, diag keys of step i at every position]; query t sees causal step-0 keys
    # (padding removed, itself always) and only the diagonal entry of every later block
    keys = torch.cat([k0, *dk], 2)
    values = torch.cat([v0, *dv], 2)
    eye = torch.eye(t, dtype=torch.bool)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    block0 = (causal[None] & (am[:, None, :] > 0)) | eye[None]
    allowed = torch.cat([block0] + [eye[None].expand(b, -1, -1)] * steps, -1)
    torch.testing.assert_close(got, _dense_reference(q, keys, values, allowed), atol=1e-5, rtol=1e-5)
    # a different diagonal key changes the result (the diagonal blocks are really used)
    dk2 = [dk[0] + 1.0] + dk[1:]
    assert not torch.allclose(ttt_attention(q, k0, v0, train_mask(am), dk2, dv), got)


def test_cached_attention_gqa_mask():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.4
    mask[:, 0] = True
    torch.testing.assert_close(cached_attention(q, k, v, mask), _dense_reference(q, k, v, mask[None].expand(1, -1, -1)),
                               atol=1e-5, rtol=1e-5)


def test_rotary_keeps_float32_frequencies_under_bf16_cast():
    cfg, _ = tiny_target("llama")
    rot = Rotary(DecoderSpec.from_target(cfg, "llama"))
    before = rot.inv_freq(torch.device("cpu")).clone()
    rot.to(torch.bfloat16)
    assert rot.inv_freq(torch.device("cpu")).dtype == torch.float32
    assert torch.equal(rot.inv_freq(torch.device("cpu")), before)
