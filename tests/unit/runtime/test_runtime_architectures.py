"""The runtime beyond the Llama family: on tiny random targets of every tested architecture (Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE on the fused path; Gemma 3, Phi-3, gpt-oss, OLMo 2 through the model's own modules; sliding windows
of 8 tokens, which every prompt + output here runs past), in float32:
- greedy decoding is token-for-token Hugging Face `generate` for plain decoding, n-gram trees, a random EAGLE-3
  speculator's trees and the oracle drafter's decoy trees (deep acceptance, KV commits with gaps);
- sampled decoding is lossless: the first two tokens of 500 seeded requests follow the exact target law (Pearson
  chi-square, Bonferroni over the module) for EAGLE-3 sampled trees (traversal verification) and the oracle's
  deep trees on every architecture, n-gram chains (drafts that do not depend on the target's hidden states) on one
  architecture of each runner path, and a broken verifier is rejected by the same test. The lossless cases run 8
  requests behind each target forward (batching.py: each request is the engine's own coroutine, as alone); the
  broken verifier runs one request at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators.core.config import TreeConfig
from speculators.core.sampling import sample
from speculators.runtime.batching import generate_batch
from speculators.runtime.forward.module_runner import ModuleTargetRunner, TargetRunner
from speculators.serving import Engine, SamplingParams
from tests.conftest import TINY_EXTRAS, make_tiny_target
from tests.unit.runtime.oracle_drafter import OracleDrafter, chi_square_p, exact_prefix_law
from tests.unit.runtime.runtime_helpers import hf_greedy, hf_model, loaded_target, make_speculator_dir, single_thread  # noqa: F401

ARCHITECTURES = list(TINY_EXTRAS)
FUSED = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 100, 200, 5, 6], [9, 10, 11, 12, 13, 14, 15, 16, 17, 9, 10, 11]]
MAX_NEW = 20
DYNAMIC = TreeConfig(kind="dynamic", depth=3, topk=2, budget=6, adaptive=False)
SAMPLES = 500
SAMPLING = dict(temperature=1.0, top_k=4)  # a tiny random target is near uniform: 4 x 4 cells carry the law
CHI_CASES = {  # drafter -> tree
    "ngram": TreeConfig(kind="chain", depth=3, adaptive=False),
    "eagle3": TreeConfig(kind="sampled", depth=2, topk=2, budget=4, adaptive=False),
    "oracle": TreeConfig(kind="dynamic", depth=3, topk=2, budget=9, adaptive=False),
}
# n-gram chains: their drafts read only the tokens, so one architecture per runner path (fused, modules) proves them
CHI_MATRIX = [(arch, drafter) for drafter in CHI_CASES for arch in ARCHITECTURES
              if drafter != "ngram" or arch in ("llama", "gemma3_text")]
FAMILY_ALPHA = 1e-6
NUM_TESTS = len(CHI_MATRIX) + 1


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """model type -> (tiny target dir, random EAGLE-3 speculator dir paired with it)."""
    root = tmp_path_factory.mktemp("architectures")
    out = {}
    for arch in ARCHITECTURES:
        target = make_tiny_target(root / arch, arch, seed=1)
        out[arch] = (str(target), str(make_speculator_dir(target, "eagle3", root / f"{arch}-eagle3", seed=2,
                                                          scale=0.5)))
    return out


def _engine(target: str, spec: str, drafter: str, tree: TreeConfig) -> Engine:
    loaded = loaded_target(target)
    if drafter == "oracle":
        return Engine(loaded, OracleDrafter(hf_model(target)), tree=tree)
    return Engine.from_pretrained(loaded, {"eagle3": spec}.get(drafter, drafter), tree=tree, ngram_graft=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_hf_generate(arch_dirs, arch: str) -> None:
    target, spec = arch_dirs[arch]
    references = [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]
    for drafter in ("none", "ngram", "eagle3", "oracle"):
        engine = _engine(target, spec, drafter, DYNAMIC)
        expected_path = TargetRunner if arch in FUSED else ModuleTargetRunner
        assert type(engine.runner) is expected_path
        for prompt, ref in zip(PROMPTS, references, strict=True):
            out = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
            assert out.token_ids == ref, f"{arch} {drafter}: diverged at token " \
                f"{next(i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b)}"
        if drafter == "oracle":  # the decoy trees were accepted deep, through gathered (gapped) KV commits
            assert engine.totals.tau > 2.5, (arch, engine.totals.tau)


def _chi_square(engine: Engine, target: str, seed: int, max_batch: int = 0) -> float:
    """The chi-square p-value of the first two tokens of SAMPLES seeded requests, one at a time or `max_batch`
    behind each target forward."""
    params = SamplingParams(max_new_tokens=3, **SAMPLING)
    law, support = exact_prefix_law(hf_model(target), PROMPTS[0], params, 2, min_mass=5.0 / SAMPLES,
                                    eos=engine.eos_ids)
    requests = [SamplingParams(max_new_tokens=3, seed=seed + i, **SAMPLING) for i in range(SAMPLES)]
    outs = (generate_batch(engine, [PROMPTS[0]] * SAMPLES, requests, max_batch=max_batch) if max_batch
            else [engine.generate(PROMPTS[0], r) for r in requests])
    keys = [tuple(out.token_ids[:2]) for out in outs]
    outside = sorted({key[0] for key in keys if key[0] not in support})
    assert not outside, f"tokens {outside} have probability 0 under the filtered target"
    return chi_square_p(law, keys, SAMPLES)


@pytest.mark.parametrize("arch, drafter", CHI_MATRIX)
def test_sampling_is_lossless(arch_dirs, arch: str, drafter: str) -> None:
    target, spec = arch_dirs[arch]
    engine = _engine(target, spec, drafter, CHI_CASES[drafter])
    p_value = _chi_square(engine, target, seed=7919 * ARCHITECTURES.index(arch), max_batch=8)
    assert engine.totals.drafted_tokens > 0, "nothing was drafted: the test would prove nothing"
    assert p_value > FAMILY_ALPHA / NUM_TESTS, f"{arch} {drafter}: p = {p_value:.3g}"


class _AcceptAnyDraft(Engine):
    """BROKEN on purpose: accepts every drafted child the filtered target can produce (lossy)."""

    def _verify(self, tree, target_row, params, generator):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            children.setdefault(p, []).append(i)
        node, accepted = 0, []
        while children.get(node) and float(target_row(node)[int(tree.tokens[children[node][0]])]) > 0:
            node = children[node][0]
            accepted.append(node)
        return accepted, sample(target_row(node), generator)


def test_a_broken_verifier_is_rejected_on_the_module_path(arch_dirs) -> None:
    target, _ = arch_dirs["gemma3_text"]
    loaded = loaded_target(target)
    bad = _AcceptAnyDraft(loaded, OracleDrafter(hf_model(target)), tree=CHI_CASES["oracle"])
    assert type(bad.runner) is ModuleTargetRunner
    p_value = _chi_square(bad, target, seed=99)
    assert p_value < FAMILY_ALPHA / NUM_TESTS, f"the lossy verifier was not detected (p = {p_value:.3g})"


def test_tiny_targets_differ_by_architecture(arch_dirs) -> None:
    types = {hf_model(target).config.model_type for target, _ in arch_dirs.values()}
    assert types == set(ARCHITECTURES) and all(Path(t).is_dir() for t, _ in arch_dirs.values())
