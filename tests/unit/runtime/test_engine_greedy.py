"""Engine at temperature 0: token-for-token equal to Hugging Face greedy decoding for every drafter and tree
shape (random speculators included: parity must hold for ANY draft; best-first trees for the drafters whose law at a
depth ignores the path), EOS / stop / length truncation, streaming and prefix reuse."""

from __future__ import annotations

import pytest

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import FAMILIES, hf_greedy, loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 100, 200, 5, 6],
    [42],
    [9, 10, 11, 12, 13, 14, 15, 16, 17, 9, 10, 11],
]
TREES = {
    "chain": TreeConfig(kind="chain", depth=4, topk=1, budget=4, adaptive=False),
    "dynamic": TreeConfig(kind="dynamic", depth=3, topk=3, budget=8, adaptive=False),
    "static": TreeConfig(kind="static", depth=3, topk=3, budget=6, adaptive=False),
    "best_first": TreeConfig(kind="best_first", depth=3, topk=3, budget=8, adaptive=False),
}
MAX_NEW = 24
PATH_DEPENDENT = ("eagle3", "mtp")  # draft each node from its path: no best_first trees (refused)


def cases(drafters: list[str]) -> list[tuple[str, str]]:
    """(drafter, tree) pairs: every tree kind for every drafter that drafts it."""
    return [(d, t) for d in drafters for t in TREES if not (t == "best_first" and d in PATH_DEPENDENT)]


@pytest.fixture(scope="module")
def spec_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("specs")
    return {f: str(make_speculator_dir(tiny_llama, f, root / f, seed=3)) for f in FAMILIES}


@pytest.fixture(scope="module")
def references(tiny_llama) -> list[list[int]]:
    return [hf_greedy(tiny_llama, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("drafter,tree", cases(["none", "ngram", *FAMILIES]))
def test_greedy_parity_with_hf_generate(tiny_llama, spec_dirs, references, drafter: str, tree: str) -> None:
    speculator = spec_dirs.get(drafter, drafter)
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), speculator, tree=TREES[tree])
    for prompt, ref in zip(PROMPTS, references, strict=True):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert out.token_ids == ref, f"{drafter}/{tree} diverged on prompt {prompt}"
        stats = out.stats
        assert stats.acceptance.committed_tokens >= len(out.token_ids)
        assert stats.target_calls == stats.acceptance.committed_tokens - stats.acceptance.accepted_tokens
        if drafter == "none":
            assert stats.target_calls == len(out.token_ids) and stats.acceptance.drafted_tokens == 0


@pytest.mark.parametrize("drafter,tree", cases(list(FAMILIES)))
def test_greedy_parity_with_an_ngram_graft(tiny_llama, spec_dirs, references, drafter: str, tree: str,
                                           monkeypatch) -> None:
    from speculators.runtime import cycle_steps

    grown = []
    real = cycle_steps.graft_chain
    monkeypatch.setattr(cycle_steps, "graft_chain", lambda t, *a: grown.append(real(t, *a).size - t.size) or real(t, *a))
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dirs[drafter], tree=TREES[tree],
                                    ngram_graft=4)
    assert engine.info.name.endswith("+ngram")
    for prompt, ref in zip(PROMPTS, references, strict=True):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert out.token_ids == ref, f"{drafter}+ngram/{tree} diverged on prompt {prompt}"
    assert max(grown) > 0  # the repetitive prompts got grafted nodes


@pytest.mark.parametrize("drafter", [f for f in FAMILIES if f in PATH_DEPENDENT])
def test_best_first_is_refused_for_path_dependent_drafters(tiny_llama, spec_dirs, drafter: str) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), spec_dirs[drafter], tree=TREES["best_first"])
    with pytest.raises(SpeculatorsError, match="best_first"):
        engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))


def test_ngram_accepts_on_repetitive_output(tiny_llama, references) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", tree=TREES["chain"])
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    assert out.token_ids == references[0]
    assert out.stats.acceptance.accepted_tokens > 0 and out.stats.tau > 1.0
    assert out.stats.target_calls < MAX_NEW
    assert out.stats.per_position_acceptance and out.stats.adaptive["mode"] == "fixed depth 4"


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_eos_inside_accepted_path_truncates(tiny_llama, references, drafter: str) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), drafter, tree=TREES["chain"])
    ref = references[0]
    eos = ref[6]
    engine.eos_ids = {eos}
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "stop"


def test_stop_string_and_length(tiny_llama, references) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", tree=TREES["chain"])
    full = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=MAX_NEW))
    assert full.finish_reason == "length" and len(full.token_ids) == MAX_NEW
    tok = engine.tokenizer
    piece = tok.decode(full.token_ids[5:7], skip_special_tokens=True)
    assert piece.strip()
    out = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=MAX_NEW, stop=[piece]))
    cut = full.text.find(piece)
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) <= 7
    assert piece in tok.decode(out.token_ids, skip_special_tokens=True)
    short = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=3))
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"


def test_stream_chunks_add_up(tiny_llama) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", tree=TREES["chain"])
    params = SamplingParams(max_new_tokens=MAX_NEW, stop=["zzzz-never"])
    chunks = list(engine.stream(PROMPTS[0], params))
    final = chunks[-1].output
    assert final is not None and all(c.output is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == final.text
    assert [t for c in chunks for t in c.token_ids] == final.token_ids
    ids_only = list(engine.stream(PROMPTS[0], params, text_deltas=False))  # what `generate` consumes
    assert all(c.text == "" for c in ids_only[:-1]) and ids_only[-1].text == final.text
    assert ids_only[-1].output.token_ids == final.token_ids
    assert [t for c in ids_only for t in c.token_ids] == final.token_ids


def test_prefix_reuse_gives_identical_output(tiny_llama, references) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", tree=TREES["dynamic"])
    first = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    again = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    assert first.stats.reused_prefix_tokens == 0 and again.stats.reused_prefix_tokens == len(PROMPTS[0]) - 1
    assert again.token_ids == first.token_ids == references[0]
    longer = PROMPTS[0] + [77, 78]
    out = engine.generate(longer, SamplingParams(max_new_tokens=8))
    assert out.stats.reused_prefix_tokens == len(PROMPTS[0]) - 1 and out.token_ids == hf_greedy(tiny_llama, longer, 8)


def test_text_and_chat_prompts(tiny_llama) -> None:
    engine = Engine.from_pretrained(loaded_target(str(tiny_llama)), "none")
    text_ids = engine.encode("def f(x):")
    assert engine.generate("def f(x):", max_new_tokens=5).token_ids == hf_greedy(tiny_llama, text_ids, 5)
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = engine.encode(messages)
    assert chat_ids[-2:] == engine.tokenizer("<|assistant|>\n")["input_ids"][-2:]
    assert engine.generate(messages, max_new_tokens=5).token_ids == hf_greedy(tiny_llama, chat_ids, 5)
