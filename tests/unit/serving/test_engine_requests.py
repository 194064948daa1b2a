"""Bad requests get one clear SpeculatorsError each; sampled decoding is reproducible per seed and uses the
draft's probabilities for sampled chains."""

from __future__ import annotations

import pytest

from speculators.config import TreeConfig
from speculators.errors import SpeculatorsError
from speculators.serving import Engine, SamplingParams
from speculators.serving.engine import GenerateOutput
from tests.unit.serving.runtime_helpers import loaded_target, make_speculator_dir, single_thread  # noqa: F401

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=32)


@pytest.mark.parametrize("params, match", [
    (SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (SamplingParams(max_new_tokens=-3), "max_new_tokens must be >= 1"),
    (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(top_k=-1), "top_k"),
])
def test_bad_sampling_params(engine: Engine, params: SamplingParams, match: str) -> None:
    with pytest.raises(SpeculatorsError, match=match):
        engine.generate(PROMPT, params)


def test_prompt_longer_than_cache(engine: Engine) -> None:
    with pytest.raises(SpeculatorsError, match="the prompt has 40 tokens but the KV cache holds 32"):
        engine.generate([5] * 40, SamplingParams(max_new_tokens=1))
    with pytest.raises(SpeculatorsError, match="lower max_new_tokens to at most 22"):
        engine.generate(PROMPT, SamplingParams(max_new_tokens=23))
    assert len(engine.generate(PROMPT, SamplingParams(max_new_tokens=22)).token_ids) <= 22  # fits exactly


def test_bad_prompts(engine: Engine) -> None:
    with pytest.raises(SpeculatorsError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(SpeculatorsError, match=r"token ids must be in \[0, "):
        engine.generate([1, 10**9], SamplingParams())
    with pytest.raises(SpeculatorsError, match="prompt must be"):
        engine.generate({"x": 1}, SamplingParams())  # type: ignore[arg-type]
    # the engine keeps working after rejected requests
    assert isinstance(engine.generate(PROMPT, SamplingParams(max_new_tokens=4)), GenerateOutput)


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    a, b = engine.generate(PROMPT, params), engine.generate(PROMPT, params)
    assert a.token_ids == b.token_ids
    others = {tuple(engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.8, seed=s)).token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_sampled_chain_is_verified_with_draft_probabilities(tiny_llama, tmp_path, monkeypatch) -> None:
    from speculators.serving import engine as engine_module

    seen: list[tuple[str, bool]] = []
    real = engine_module.verify_tree_lazy

    def spy(tokens, parents, target_row, draft_probs=None, *, vocab_size, mode, generator):
        seen.append((mode, draft_probs is not None))
        return real(tokens, parents, target_row, draft_probs, vocab_size=vocab_size, mode=mode, generator=generator)

    monkeypatch.setattr(engine_module, "verify_tree_lazy", spy)
    spec = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "eagle3")
    eng = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(spec),
                                 tree=TreeConfig(kind="chain", depth=3, adaptive=False))
    eng.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert ("iid", True) in seen
    seen.clear()
    eng.set_tree(TreeConfig(kind="dynamic", depth=3, topk=2, budget=5, adaptive=False))  # sampling: "chain"
    eng.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert ("iid", True) in seen  # sampled requests draft a sampled chain (plain cycles excepted: root alone)
    assert seen.count(("deterministic", False)) <= 1
    seen.clear()
    eng.set_tree(TreeConfig(kind="dynamic", depth=3, topk=2, budget=5, adaptive=False, sampling="tree"))
    eng.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    assert ("deterministic", False) in seen and all(m != "iid" for m, _ in seen)
    seen.clear()
    eng.generate(PROMPT, SamplingParams(max_new_tokens=6))
    assert {m for m, _ in seen} == {"greedy"}
