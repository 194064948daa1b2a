"""The predicted serving acceptance (`evaluate/replay.py`) against the runtime it predicts.

- An oracle drafter that knows the output ahead (right drafts, a decoy sibling, and deliberate mistakes at some
  depths) runs in the real `Engine`; replaying the engine's own output through the same drafter must give the
  runtime's counters exactly — at T = 0, at T = 1 (deterministic trees: the accepted path is the output's
  matched prefix), with an output ended by a stop token (drafts past the end are not counted), and for chains.
- `replay_chain` walks cycles: checked against a hand-rolled walk of 0/1 acceptance.
- `chain_weights` at T > 0 is an unbiased estimate of a sampled chain's reach: sum over draft paths of
  prod_j min(p_j, q_j), checked by averaging over many target samples on a toy law (a broken estimator that
  uses min(p, q) at the sampled token instead of the ratio must miss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from speculators.core.config import TreeConfig
from speculators.core.metrics import AcceptanceStats
from speculators.core.sampling import SamplingParams
from speculators.core.trees import DraftTree
from speculators.evaluate.replay import (
    CycleCounts,
    chain_weights,
    proposer_chain_weights,
    replay_chain,
    replay_drafter,
    tau_interval,
)
from speculators.models.base import FeatureRequest
from speculators.runtime.drafters.model_free import NgramDrafter
from speculators.runtime.drafters.ngram import ngram_propose
from speculators.runtime.engine import Engine
from tests.unit.runtime.runtime_helpers import loaded_target

torch.set_num_threads(1)


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)


class OracleDrafter:
    """Drafts the known output (`future`): the right token first, a decoy sibling second, and a wrong token at
    every depth d of a cycle where (len(context) + d) % every == 0. Deterministic."""

    needs_token_ids = True
    name = "oracle"

    def __init__(self, future: list[int], every: int = 4, vocab: int = 100) -> None:
        self.future, self.every, self.vocab = future, every, vocab

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=False)

    def new_state(self, max_len: int, device: object) -> _State:
        return _State()

    def absorb(self, state: _State, features: dict, next_tokens: torch.Tensor) -> None:
        if not state.tokens:
            state.tokens.extend(int(t) for t in features["input_ids"][:1].tolist())
        state.tokens.extend(int(t) for t in next_tokens.reshape(-1).tolist())

    def propose(self, state: _State, root: int, tree: TreeConfig, sampling: SamplingParams, generator: object
                ) -> DraftTree:
        n = len(state.tokens)
        mode = "greedy" if sampling.greedy else "deterministic"
        tokens, parents, parent = [int(root)], [-1], 0
        for d in range(1, tree.depth + 1):
            i = n - 1 + d  # index in the full sequence of the token depth d drafts
            right = self.future[i] if i < len(self.future) else 0
            tok = (right + 1) % self.vocab if (n + d) % self.every == 0 else right
            tokens.append(tok)
            parents.append(parent)
            if tree.kind != "chain":  # a decoy sibling under the same parent
                tokens.append((tok + 7) % self.vocab)
                parents.append(parent)
            parent = len(tokens) - (1 if tree.kind == "chain" else 2)
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), mode=mode)


def _engine_vs_replay(tiny_llama, prompt: list[int], tree: TreeConfig, params: SamplingParams, every: int = 4
                      ) -> tuple[AcceptanceStats, CycleCounts, list[int]]:
    target = loaded_target(str(tiny_llama))
    known = prompt + Engine(target, None, adaptive=False).generate(prompt, params).token_ids  # what the oracle knows
    engine = Engine(target, OracleDrafter(known, every), tree=tree, adaptive=False)
    live = engine.generate(prompt, params)
    if params.greedy:
        assert prompt + live.token_ids == known  # lossless: the drafter never changes a greedy output
    # the replay walks the live output (a sample of the target at T > 0) with the same drafter
    counts = replay_drafter(OracleDrafter(known, every), {}, prompt + live.token_ids, len(prompt),
                            params.max_new_tokens, engine.tree_for, params, tree.depth)
    return live.stats.acceptance, counts, live.token_ids


def _same(live: AcceptanceStats, counts: CycleCounts) -> None:
    assert counts.calls == live.target_calls
    assert counts.committed == live.committed_tokens
    k = counts.depth
    assert counts.attempts == [float(a) for a in live.attempts[:k]]
    assert counts.accepts == [float(a) for a in live.accepts[:k]]


@pytest.mark.parametrize("kind", ["dynamic", "chain"])
def test_replay_equals_the_runtime_at_t0(tiny_llama, kind) -> None:
    tree = TreeConfig(kind=kind, depth=4, topk=2, budget=8 if kind != "chain" else 4)
    live, counts, _ = _engine_vs_replay(tiny_llama, [5, 17, 33, 2, 9, 41], tree, SamplingParams(max_new_tokens=30))
    _same(live, counts)
    assert 1.5 < live.tau < 4.5 and live.accepts[2] > 0  # deep paths were exercised, and so were rejections


def test_replay_counts_only_drafts_that_reach_the_output(tiny_llama) -> None:
    """An output that ends at a stop token inside an accepted path: the engine counts the drafts up to it only,
    and so does the replay (the last cycle commits l tokens, not l + 1)."""
    target = loaded_target(str(tiny_llama))
    prompt = [5, 17, 33, 2, 9, 41]
    full = Engine(target, None, adaptive=False).generate(prompt, SamplingParams(max_new_tokens=30)).token_ids
    stop = full[13]
    params = SamplingParams(max_new_tokens=30, stop_token_ids=[stop])
    live, counts, out = _engine_vs_replay(tiny_llama, prompt, TreeConfig(kind="chain", depth=4, topk=1, budget=4),
                                          params, every=100)  # the oracle never errs: the stop is a draft
    assert out[-1] == stop and len(out) < 30
    _same(live, counts)
    assert live.committed_tokens == len(out)


def test_replay_equals_the_runtime_sampling_a_deterministic_tree(tiny_llama) -> None:
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)
    live, counts, _ = _engine_vs_replay(tiny_llama, [5, 17, 33, 2, 9, 41],
                                        TreeConfig(kind="dynamic", depth=3, topk=2, budget=6), params)
    _same(live, counts)


def test_replay_chain_walks_cycles() -> None:
    # prompt 3 tokens, continuation 8 tokens (T = 11), length-capped at 8: cycle roots x[2], ...
    w = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0],
                      [1, 1, 1]], dtype=torch.float64)[:8]  # rows t = 1 .. 8 (t <= T-3)
    c = replay_chain(w, prompt_len=3, total_len=11, max_new_tokens=8, depth=3)
    # walk: t=1 accepts 2 -> t=4 (row 3) accepts 3 -> t=8 (row 7): remaining = 8 - 9 + ... cap 0 -> 1 token
    assert c.calls == 3 and c.committed == 3 + 4 + 1
    assert c.attempts == [2.0, 2.0, 2.0] and c.accepts == [2.0, 2.0, 1.0]


def test_sampled_chain_weights_are_unbiased() -> None:
    """Toy target / draft laws that do not depend on the prefix: P(L >= k) = (sum_v min(p, q))^k."""
    gen = torch.Generator().manual_seed(0)
    v, depth, n = 4, 2, 4000
    p_logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    q_logits = torch.log(torch.tensor([0.2, 0.5, 0.2, 0.1]))
    overlap = float(torch.minimum(p_logits.exp(), q_logits.exp()).sum())  # 0.7
    total = n + 3
    ids = [0, 1] + torch.multinomial(p_logits.exp(), total - 2, replacement=True, generator=gen).tolist()
    teacher = p_logits.expand(total, v).clone()
    steps = [q_logits.expand(total, v).clone() for _ in range(depth)]
    w = chain_weights(steps, teacher, ids, 2, torch.arange(v), SamplingParams(temperature=1.0), depth)
    reach1, reach2 = w[:, 0].mean().item(), (w[:, 0] * w[:, 1]).mean().item()
    assert reach1 == pytest.approx(overlap, abs=0.03) and reach2 == pytest.approx(overlap**2, abs=0.03)
    # a broken estimator (min(p, q) at the drawn token, no ratio) is far off
    broken = torch.minimum(p_logits.exp(), q_logits.exp())[torch.tensor(ids[2:])].mean().item()
    assert abs(broken - overlap) > 0.3


def test_tau_interval_holds_the_measured_tau() -> None:
    s = AcceptanceStats()
    for accepted in (0, 1, 2, 3, 3, 1, 0, 2):
        s.record(accepted, drafted_depth=3, verified_nodes=3)
    lo, hi = tau_interval(s, 3)
    assert lo < s.tau < hi and hi - lo < 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ngram_weights_at_cycle_starts_equal_the_served_prompt_lookup(tiny_llama, temperature) -> None:
    """`proposer_chain_weights` of the served lookup (`NgramDrafter.lookup`) walked by `replay_chain` gives the live
    engine's counters with the n-gram drafter on a fixed chain (the evaluator's "n-gram tau at cycle starts"), at
    T = 0 and on a T = 1 sample; a proposer with other n-gram lengths (the old baseline, min_ngram 1) does not."""
    target = loaded_target(str(tiny_llama))
    drafter = NgramDrafter()
    prompt = [5, 17, 33, 2, 9, 41, 5, 17, 33, 2]
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5)
    depth = 4
    engine = Engine(target, drafter, tree=TreeConfig(kind="chain", depth=depth, topk=1, budget=depth), adaptive=False)
    live = engine.generate(prompt, params)
    ids = prompt + live.token_ids
    w = proposer_chain_weights(ids, len(prompt), depth, drafter.lookup)  # [N, depth]
    counts = replay_chain(w, len(prompt), len(ids), params.max_new_tokens, depth)
    stats = live.stats.acceptance
    # the same cycles and the same accepted drafts per depth (the engine counts an attempt only where the lookup
    # found a proposal, the replay at every cycle start: a_k's denominators differ, tau does not)
    assert (counts.calls, counts.committed) == (stats.target_calls, stats.committed_tokens)
    assert counts.accepts == [float(a) for a in stats.accepts[:depth]]
    assert stats.attempts[0] > 0  # the lookup proposed
    if temperature > 0:
        return
    assert sum(stats.accepts) > 0  # and was accepted somewhere (not a vacuous match)
    loose = replay_chain(proposer_chain_weights(ids, len(prompt), depth, lambda c, k: ngram_propose(c, k)),
                         len(prompt), len(ids), params.max_new_tokens, depth)
    assert (loose.attempts, loose.accepts) != (counts.attempts, counts.accepts)
