"""Bad requests get one clear SpeculatorsError each; sampled decoding is reproducible per seed and uses the
draft's probabilities for sampled chains; log-probabilities of generated tokens are the target's own, whatever tree
they were accepted through, alone and batched."""

from __future__ import annotations

import pytest

from speculators.core.config import TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.runtime.batching import generate_batch
from speculators.serving import Engine, SamplingParams
from tests.unit.runtime.runtime_helpers import loaded_target, make_speculator_dir, single_thread  # noqa: F401

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
    (SamplingParams(seed=2**64), r"seed must be an int in \[-9223372036854775808, 18446744073709551615\]"),
    (SamplingParams(seed=-(2**63) - 1), "seed must be an int in"),
    (SamplingParams(logprobs=21), r"logprobs must be an int in \[0, 20\]"),
    (SamplingParams(logprobs=True), "logprobs must be an int"),
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
    before = engine.generate(PROMPT, SamplingParams(max_new_tokens=4)).token_ids
    assert len(before) == 4
    with pytest.raises(SpeculatorsError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(SpeculatorsError, match=r"token ids must be in \[0, "):
        engine.generate([1, 10**9], SamplingParams())
    with pytest.raises(SpeculatorsError, match="prompt must be"):
        engine.generate({"x": 1}, SamplingParams())  # type: ignore[arg-type]
    # the engine keeps working after rejected requests: the same greedy tokens as before them
    assert engine.generate(PROMPT, SamplingParams(max_new_tokens=4)).token_ids == before


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    a, b = engine.generate(PROMPT, params), engine.generate(PROMPT, params)
    assert a.token_ids == b.token_ids
    others = {tuple(engine.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.8, seed=s)).token_ids)
              for s in range(4)}
    assert len(others) > 1


def test_sampled_drafts_are_verified_with_draft_probabilities(tiny_llama, tmp_path, monkeypatch) -> None:
    from speculators.runtime import engine as engine_module

    seen: list[tuple[str, bool]] = []
    real = engine_module.verify_tree_lazy

    def spy(tokens, parents, target_row, draft_probs=None, *, vocab_size, mode, generator):
        seen.append((mode, draft_probs is not None))
        return real(tokens, parents, target_row, draft_probs, vocab_size=vocab_size, mode=mode, generator=generator)

    monkeypatch.setattr(engine_module, "verify_tree_lazy", spy)
    spec = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "eagle3")
    eng = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(spec),
                                 tree=TreeConfig(kind="chain", depth=3, adaptive=False))
    warm = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    for tree, mode in ((TreeConfig(kind="chain", depth=3, adaptive=False), "block"),
                       (TreeConfig(kind="chain", depth=3, adaptive=False, verify="token"), "iid"),
                       (TreeConfig(kind="sampled", depth=3, topk=2, budget=5, adaptive=False), "traversal"),
                       (TreeConfig(kind="sampled", depth=3, topk=2, budget=5, adaptive=False, verify="token"),
                        "without_replacement")):
        seen.clear()
        eng.set_tree(tree)
        eng.generate(PROMPT, warm)
        assert (mode, True) in seen and {m for m, _ in seen} <= {mode, "deterministic"}, (tree, seen)
    seen.clear()
    eng.set_tree(TreeConfig(kind="dynamic", depth=3, topk=2, budget=5, adaptive=False))
    eng.generate(PROMPT, warm)
    assert ("deterministic", False) in seen and all(m == "deterministic" for m, _ in seen)
    seen.clear()
    eng.generate(PROMPT, SamplingParams(max_new_tokens=6))
    assert {m for m, _ in seen} == {"greedy"}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_targets_own(tiny_llama, temperature: float) -> None:
    import torch

    from tests.unit.runtime.runtime_helpers import hf_model

    tree = TreeConfig(kind="dynamic", depth=3, topk=2, budget=6, adaptive=False)
    eng = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram", max_len=64, tree=tree)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=7, logprobs=3)
    alone = eng.generate(PROMPT, params)
    batched = generate_batch(eng, [PROMPT, PROMPT[:6]], [params, params], max_batch=2)[0]
    assert eng.totals.drafted_tokens > 0
    assert temperature > 0 or eng.totals.accepted_tokens > 0  # greedy: tokens came through accepted draft nodes
    for out in (alone, batched):
        with torch.no_grad():
            logits = hf_model(str(tiny_llama))(torch.tensor([PROMPT + out.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1]  # [G, V]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for j, lp in enumerate(out.logprobs):
            assert lp.logprob == pytest.approx(float(ref[j, lp.token_id]), abs=1e-4)
            assert [i for i, _ in lp.top] == torch.topk(ref[j], 3).indices.tolist()
    assert eng.generate(PROMPT, SamplingParams(max_new_tokens=4)).logprobs is None


def test_adaptive_sampled_requests_choose_among_kinds(tiny_llama, tmp_path, monkeypatch) -> None:
    """At T > 0 an adaptive request of a model drafter may draft the configured tree, sampled chains (block) and
    sampled trees (traversal); at T = 0 the configured tree or the argmax chain; fixed or n-gram requests keep the
    configured kind."""
    spec = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "eagle3")
    eng = Engine.from_pretrained(loaded_target(str(tiny_llama)), str(spec),
                                 tree=TreeConfig(kind="dynamic", depth=3, topk=2, budget=6, adaptive=True))
    warm = SamplingParams(max_new_tokens=60, temperature=1.0)
    assert eng.kinds_for(warm, adaptive=True) == ("dynamic", "chain", "sampled")
    assert eng.kinds_for(SamplingParams(max_new_tokens=60), adaptive=True) == ("dynamic", "chain")
    assert eng.kinds_for(warm, adaptive=False) == ("dynamic",)
    ngram = Engine.from_pretrained(loaded_target(str(tiny_llama)), "ngram")
    assert ngram.kinds_for(warm, adaptive=True) == (ngram.tree.kind,)
    from speculators.runtime import adaptive as adaptive_module
    from speculators.runtime import engine as engine_module

    turn = {"n": 0}

    def scripted(self, remaining, lookup=0, model_ready=True):  # drafts every kind in turn at depth 2
        kind = self.kinds[turn["n"] % len(self.kinds)]
        turn["n"] += 1
        self.kind = kind
        self.kind_histogram[kind] = self.kind_histogram.get(kind, 0) + 1
        self._last = adaptive_module.Plan(kind, min(2, remaining - 1))
        return self._last

    modes: list[tuple[int, str]] = []
    real = engine_module.verify_tree_lazy

    def spy(tokens, parents, target_row, draft_probs=None, *, vocab_size, mode, generator):
        if mode != "greedy":  # the cost calibration verifies greedy chains
            modes.append((int(tokens.shape[0]), mode))
        return real(tokens, parents, target_row, draft_probs, vocab_size=vocab_size, mode=mode, generator=generator)

    monkeypatch.setattr(adaptive_module.AdaptiveDepth, "choose_plan", scripted)
    monkeypatch.setattr(engine_module, "verify_tree_lazy", spy)
    out = eng.generate(PROMPT, warm)
    adaptive = out.stats.adaptive
    assert adaptive["mode"] == "adaptive"
    assert set(adaptive["kind_histogram"]) == {"dynamic", "chain", "sampled"}
    assert [m for _, m in modes[:3]] == ["deterministic", "block", "traversal"]
    assert [n for n, _ in modes[1:3]] == [3, 5]  # chain of 2; spine of 2 with a sibling per level (never grafted)
    assert set(adaptive["cost"]["draft_ms_by_depth"]) == {"dynamic", "chain", "sampled"}  # all calibrated
    # every kind's acceptance at T = 1 is kept for the next requests (per temperature and kind)
    assert set(eng.acceptance_memory.counts) == {(1.0, "dynamic"), (1.0, "chain"), (1.0, "sampled"), (1.0, "lookup")}
