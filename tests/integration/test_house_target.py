"""The embedded house target: loads with plain transformers, speaks its chat template, writes Python."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration


def test_loads_with_auto_classes_and_matches_the_report(house_target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(house_target, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(house_target)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_hidden_layers >= 8
    assert len(tok) == cfg.vocab_size
    report = json.loads((house_target / "report.json").read_text())
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    size = sum(p.stat().st_size for p in house_target.iterdir() if p.is_file())
    assert size <= 25 * 1024 * 1024


def test_chat_template_and_assistant_mask(house_target: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(house_target)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "x = 1"}]
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    masked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked == "x = 1<|end|>"
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")


def test_greedy_continuation_of_held_out_code_looks_like_python(house_target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speculators.core.workloads import load_workloads

    model = AutoModelForCausalLM.from_pretrained(house_target, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(house_target)
    rows = load_workloads(str(house_target.parents[1] / "workloads" / "code-completion.jsonl"))[:6]
    parsable = 0
    for row in rows:
        ids = tok(row.prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=48, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.strip(), row.id
        # Python-shaped: the prompt plus continuation, cut at the last complete line, tokenizes as Python
        # with a plausible share of identifier/keyword tokens.
        body = text.rsplit("\n", 1)[0] if "\n" in text else text
        words = [w for w in body.replace("(", " ").replace(")", " ").split() if w.isidentifier()]
        assert len(words) >= 3, (row.id, text)
        try:
            ast.parse(__import__("textwrap").dedent(body))
            parsable += 1
        except SyntaxError:
            pass
    assert parsable >= 1
