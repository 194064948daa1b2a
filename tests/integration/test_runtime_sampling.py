"""Sampling losslessness end to end on the house target: with speculation, the joint law of the first two
generated tokens equals the exact target probabilities (computed by direct forward passes with the same
temperature / top-k / top-p operator), by Pearson chi-square with family-wise alpha 1e-6 (Bonferroni).

Covered: n-gram drafts (deterministic trees), a random EAGLE-3 sampled chain ("iid" with the draft's
probabilities, i.e. min(1, p/q) and residual sampling), a random Medusa top-k tree and a random EAGLE-3 top-k tree
with a prompt-lookup graft; each under temperature, top-k and top-p; the Medusa case once more with 8 requests
sharing each target forward (batching.py). Negative controls run through the SAME test and must be rejected: an
engine that accepts every drafted token the target can produce (lossy "typical"-style acceptance) and one that
verifies against the unfiltered target rows.
"""

from __future__ import annotations

import pytest
import torch

from speculators.config import TreeConfig
from speculators.serving import Engine, SamplingParams
from speculators.serving.sampling import logits_to_probs, sample
from tests.unit.serving.runtime_helpers import hf_model, loaded_target, make_speculator_dir, single_thread  # noqa: F401

pytestmark = pytest.mark.integration

SAMPLES = 1000
FAMILY_ALPHA = 1e-6
CASES = [  # (drafter, tree, sampling)
    ("ngram", TreeConfig(kind="dynamic", depth=3, topk=2, budget=4, adaptive=False, sampling="tree"),
     dict(temperature=1.0, top_k=0, top_p=1.0)),
    ("ngram", TreeConfig(kind="chain", depth=3, adaptive=False), dict(temperature=0.7, top_k=8, top_p=1.0)),
    ("eagle3", TreeConfig(kind="chain", depth=2, adaptive=False), dict(temperature=1.2, top_k=0, top_p=0.8)),
    ("medusa", TreeConfig(kind="dynamic", depth=2, topk=3, budget=5, adaptive=False, sampling="tree"),
     dict(temperature=0.9, top_k=20, top_p=0.9)),
    ("eagle3+ngram", TreeConfig(kind="dynamic", depth=2, topk=2, budget=3, adaptive=False, sampling="tree"),
     dict(temperature=1.0, top_k=0, top_p=0.95)),
]
NUM_TESTS = len(CASES) + 3  # Bonferroni over every chi-square this module runs (controls, batched case included)
BATCHED_CASE = 3  # also run with 8 requests sharing each target forward (batching.py)


def _prompt(house_target) -> list[int]:
    engine = Engine(loaded_target(str(house_target)))
    text = "    def read(self, n):\n        return self.read(n)\n\n    def write(self, data):\n        return self."
    return engine.encode(text)


def _exact_pairs(house_target, prompt: list[int], params: SamplingParams, min_mass: float, eos: set[int]) -> dict:
    """Exact P(t1, t2) for every pair with P >= min_mass (direct forwards; an EOS first token ends the output:
    key (eos,)); the rest is one 'other' bin."""
    model = hf_model(str(house_target))
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1].double(), params)  # [V]
    pairs: dict = {}
    for t1 in torch.nonzero(p1 >= min_mass).flatten().tolist():
        if t1 in eos:
            pairs[(t1,)] = float(p1[t1])
            continue
        with torch.no_grad():
            p2 = logits_to_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1].double(), params)
        for t2 in torch.nonzero(p1[t1] * p2 >= min_mass).flatten().tolist():
            pairs[(t1, t2)] = float(p1[t1] * p2[t2])
    support_1 = set(torch.nonzero(p1 > 0).flatten().tolist())
    return {"pairs": pairs, "support_1": support_1}


def _chi_square(engine: Engine, house_target, prompt: list[int], sampling: dict, seed: int,
                max_batch: int = 0) -> float:
    """p-value of the first two tokens of SAMPLES seeded requests (one at a time, or `max_batch` sharing each
    target forward) against the exact target law."""
    from scipy.stats import chi2

    params = SamplingParams(max_new_tokens=3, **sampling)
    exact = _exact_pairs(house_target, prompt, params, min_mass=5.0 / SAMPLES, eos=engine.eos_ids)
    counts: dict = {}
    requests = [SamplingParams(max_new_tokens=3, seed=seed + i, **sampling) for i in range(SAMPLES)]
    outs = (engine.generate_batch([prompt] * SAMPLES, requests, max_batch=max_batch) if max_batch
            else (engine.generate(prompt, r) for r in requests))
    for out in outs:
        key = tuple(out.token_ids[:2])
        assert key[0] in exact["support_1"], f"token {key[0]} has probability 0 under the filtered target"
        counts[key] = counts.get(key, 0) + 1
    expected = dict(exact["pairs"])
    other_p = max(0.0, 1.0 - sum(expected.values()))
    for key in sorted(expected, key=expected.get):  # grow the 'other' bin until its expectation is >= 5
        if other_p * SAMPLES >= 5:
            break
        other_p += expected.pop(key)
    observed_other = SAMPLES - sum(counts.get(k, 0) for k in expected)
    stat = sum((counts.get(k, 0) - SAMPLES * p) ** 2 / (SAMPLES * p) for k, p in expected.items())
    stat += (observed_other - SAMPLES * other_p) ** 2 / (SAMPLES * other_p) if other_p > 0 else 0.0
    bins = len(expected) + (other_p > 0)
    return float(chi2.sf(stat, bins - 1))


@pytest.fixture(scope="module")
def spec_dirs(house_target, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sampling-specs")
    return {f: str(make_speculator_dir(house_target, f, root / f, seed=11)) for f in ("eagle3", "medusa")}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_first_two_tokens_follow_the_target(house_target, spec_dirs, case: int) -> None:
    drafter, tree, sampling = CASES[case]
    family = drafter.removesuffix("+ngram")
    engine = Engine.from_pretrained(loaded_target(str(house_target)), spec_dirs.get(family, family), tree=tree,
                                    ngram_graft=3 if drafter.endswith("+ngram") else 0)
    prompt = _prompt(house_target)
    p_value = _chi_square(engine, house_target, prompt, sampling, seed=1000 * case)
    assert engine.totals.drafted_tokens > 0, "the drafter never proposed anything: the test would prove nothing"
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"{drafter} {tree.kind} {sampling}: p = {p_value:.3g}"


def test_batched_first_two_tokens_follow_the_target(house_target, spec_dirs) -> None:
    drafter, tree, sampling = CASES[BATCHED_CASE]
    engine = Engine.from_pretrained(loaded_target(str(house_target)), spec_dirs[drafter], tree=tree)
    p_value = _chi_square(engine, house_target, _prompt(house_target), sampling, seed=31337, max_batch=8)
    assert engine.totals.drafted_tokens > 0
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"batched {drafter} {tree.kind} {sampling}: p = {p_value:.3g}"


class _AcceptAnyDraft(Engine):
    """BROKEN on purpose: accepts every drafted child the filtered target can produce (lossy)."""

    def _verify(self, tree, target_row, params, generator):
        children = {}
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            children.setdefault(p, []).append(i)
        node, accepted = 0, []
        while children.get(node):
            child = children[node][0]
            if float(target_row(node)[int(tree.tokens[child])]) <= 0:
                break
            accepted.append(child)
            node = child
        return accepted, sample(target_row(node), generator)


class _UnfilteredVerify(Engine):
    """BROKEN on purpose: verifies drafts against the target rows WITHOUT the request's top-k / top-p."""

    def _target_probs(self, logits, params, tree):
        if tree.size == 1:
            return super()._target_probs(logits, params, tree)
        return logits_to_probs(logits, SamplingParams(temperature=params.temperature))


@pytest.mark.parametrize("broken, case", [(_AcceptAnyDraft, 0), (_UnfilteredVerify, 1)])
def test_broken_engines_are_rejected(house_target, broken, case: int) -> None:
    drafter, tree, sampling = CASES[case]
    target = loaded_target(str(house_target))
    engine = Engine.from_pretrained(target, drafter, tree=tree)
    bad = broken(target, engine.drafter, info=engine.info, tree=tree)
    prompt = _prompt(house_target)
    try:
        p_value = _chi_square(bad, house_target, prompt, sampling, seed=77)
    except AssertionError:
        return  # it produced a token the filtered target never produces: rejected
    assert p_value < FAMILY_ALPHA / NUM_TESTS, f"{broken.__name__} was not detected (p = {p_value:.3g})"
