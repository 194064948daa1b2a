"""The embedded house target: loads with plain transformers, speaks its chat template, writes Python (every line of
its greedy continuations of held-out code is Python-shaped, a check that the same model with random weights fails)."""

from __future__ import annotations

import io
import json
import tokenize
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


def _python_shaped(line: str) -> bool:
    """A line of Python as a file holds it: indented by a multiple of 4 spaces, and its text lexes as Python with no
    error token (an open bracket or triple-quoted string that continues on the next line is allowed)."""
    indent = len(line) - len(line.lstrip(" "))
    if indent % 4 or line[indent:indent + 1] == "\t":
        return False
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except tokenize.TokenError:
        return True
    except SyntaxError:
        return False
    return not any(t.type == tokenize.ERRORTOKEN and t.string.strip() for t in tokens)


def _code_rows_written_as_python(model, tok, house_target: Path) -> list[str]:
    """The ids of the first 6 held-out code-completion rows whose greedy 48-token continuation holds at least 3
    complete non-blank lines, every one of them Python-shaped (the last, possibly cut, line is not judged)."""
    from speculators.core.workloads import load_workloads

    rows = load_workloads(str(house_target.parents[1] / "workloads" / "code-completion.jsonl"))[:6]
    good = []
    for row in rows:
        ids = tok(row.prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=48, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        lines = [line for line in text.split("\n")[:-1] if line.strip()]
        if len(lines) >= 3 and all(map(_python_shaped, lines)):
            good.append(row.id)
    return good


def test_greedy_continuation_of_held_out_code_looks_like_python(house_target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(house_target, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(house_target)
    assert len(_code_rows_written_as_python(model, tok, house_target)) >= 5  # measured: 6 of 6, 4-8 lines each


def test_the_python_check_rejects_a_random_model_of_the_same_shape(house_target: Path) -> None:
    """The control: the same architecture and tokenizer with random weights writes token soup, which the check above
    rejects (measured: 0 of 6), so passing it says something about the trained weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(house_target, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    tok = AutoTokenizer.from_pretrained(house_target)
    assert len(_code_rows_written_as_python(model, tok, house_target)) <= 1
