"""Teacher-forced acceptance math on synthetic logits, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.core import metrics
from speculators.core.sampling import SamplingParams
from speculators.evaluate.alpha import (
    AlphaAccumulator,
    ngram_alpha,
    per_sequence_memo,
    positions,
    speculator_alpha,
    speculator_block_alpha,
    summarize,
    to_target_vocab,
    valid_matrix,
)
from speculators.evaluate.replay import proposer_chain_weights
from speculators.runtime.drafters.model_free import NgramDrafter
from speculators.runtime.drafters.ngram import ngram_propose

GREEDY = SamplingParams(temperature=0.0)
T1 = SamplingParams(temperature=1.0)


def onehot_logits(ids: list[int], vocab: int, scale: float = 5.0) -> torch.Tensor:
    """[len(ids), V] logits whose argmax is ids[i]."""
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(ids)] = scale
    return out


def test_positions_and_valid_depths() -> None:
    # T = 6, prompt 2: roots x[2..4] -> positions t = 1, 2, 3; depth k needs x[t+1+k] inside the sequence
    pos = positions(6, 2)
    assert pos.tolist() == [1, 2, 3]
    assert valid_matrix(pos, 6, 2).tolist() == [[True, True], [True, True], [True, False]]
    assert positions(3, 3).numel() == 0  # no continuation token to draft after


def test_greedy_alpha_and_chain_by_hand() -> None:
    teacher = onehot_logits([0, 1, 2, 3, 0, 1], 4)  # argmax of the teacher at positions 0..5
    step0 = onehot_logits([1, 2, 1, 0, 0, 0], 4)  # t=1 -> 2 (teacher@2 = 2 hit), t=2 -> 1 (teacher@3 = 3 miss),
    #                                                   t=3 -> 0 (teacher@4 = 0 hit)
    step1 = onehot_logits([0, 3, 0, 2, 0, 0], 4)  # t=1 -> 3 (teacher@3 = 3 hit), t=2 -> 0 (teacher@4 = 0 hit)
    alpha, valid = speculator_alpha([step0, step1], teacher, torch.arange(4), prompt_len=2, params=GREEDY, depth=2)
    assert alpha.tolist() == [[1, 1], [0, 1], [1, 0]]
    assert valid.tolist() == [[True, True], [True, True], [True, False]]
    s = summarize(alpha, valid, rows=1)
    # a_1 = 2/3 (3 positions); depth 2 exists at t=0,1 only: of those, t=0 reached depth 1 and accepted depth 2,
    # so a_2 = 1/1 and E_2 = 2/3
    assert s["chain_reach"] == [round(2 / 3, 4), round(2 / 3, 4)]
    assert s["per_position_acceptance"] == [round(2 / 3, 4), 1.0]
    assert s["simulated_tau"] == round(1 + 2 / 3 + 2 / 3, 4)
    assert s["tau_by_depth"] == [round(1 + 2 / 3, 4), round(1 + 2 / 3 + 2 / 3, 4)]
    assert s["positions"] == 3


def test_reduced_draft_vocab_is_mapped_through_d2t() -> None:
    # draft vocab {1, 3, 5} of a 6-token target vocab: draft id 1 is target id 3
    d2t_targets = torch.tensor([1, 3, 5])
    teacher = onehot_logits([0, 0, 3, 0], 6)  # teacher@2 = 3
    draft = onehot_logits([0, 1, 0, 0], 3)  # at t=1 the draft's argmax is draft id 1 (= target 3)
    alpha, valid = speculator_alpha([draft], teacher, d2t_targets, prompt_len=2, params=GREEDY, depth=1)
    assert alpha[0, 0] == 1.0 and valid[0, 0]
    # without the mapping draft id 1 would be compared as target id 1: a miss
    wrong, _ = speculator_alpha([onehot_logits([0, 1, 0, 0], 6)], teacher, torch.arange(6), 2, GREEDY, 1)
    assert wrong[0, 0] == 0.0
    full = to_target_vocab(torch.tensor([[0.5, 2.0, -1.0]]), d2t_targets, 6)
    assert full[0, 3] == 2.0 and full[0, 5] == -1.0 and math.isinf(full[0, 0]) and full[0, 0] < 0


def test_sampled_alpha_is_sum_of_min_by_hand() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    teacher = torch.stack([torch.zeros(3), p.log(), torch.zeros(3)])  # teacher@1 = p
    draft = torch.stack([q.log(), torch.zeros(3), torch.zeros(3)])  # step 0 at t=0 drafts q
    alpha, valid = speculator_alpha([draft], teacher, torch.arange(3), prompt_len=1, params=T1, depth=1)
    assert valid.tolist() == [[True]]
    assert alpha[0, 0].item() == pytest.approx(0.2 + 0.2 + 0.2, abs=1e-6)
    # the same filter applies to both laws: top_k=1 makes them one-hot at different tokens -> 0
    a_topk, _ = speculator_alpha([draft], teacher, torch.arange(3), 1, SamplingParams(temperature=1.0, top_k=1), 1)
    assert a_topk[0, 0].item() == 0.0
    # temperature 2: p' ~ sqrt(p), q' ~ sqrt(q)
    sp, sq = p.sqrt() / p.sqrt().sum(), q.sqrt() / q.sqrt().sum()
    a_t2, _ = speculator_alpha([draft], teacher, torch.arange(3), 1, SamplingParams(temperature=2.0), 1)
    assert a_t2[0, 0].item() == pytest.approx(torch.minimum(sp, sq).sum().item(), abs=1e-6)


def test_block_alpha_of_a_sampled_chain_by_hand() -> None:
    """Two depths, one position: block reach at depth 2 = E[min(1, w_1 p_2(X_2)/q_2(X_2))] >= alpha_1 alpha_2; the
    chain's depth-1 reach equals token-wise alpha_1; greedy evaluation has no block rule."""
    p1, q1 = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.6])
    p2, q2 = torch.tensor([0.1, 0.1, 0.8]), torch.tensor([0.3, 0.6, 0.1])
    teacher = torch.stack([torch.zeros(3), p1.log(), p2.log(), torch.zeros(3)])  # teacher@1 = p1, @2 = p2
    step0 = torch.stack([q1.log(), torch.zeros(3), torch.zeros(3), torch.zeros(3)])
    step1 = torch.stack([q2.log(), torch.zeros(3), torch.zeros(3), torch.zeros(3)])
    block, valid = speculator_block_alpha([step0, step1], teacher, torch.arange(3), 1, T1, 2)
    token, _ = speculator_alpha([step0, step1], teacher, torch.arange(3), 1, T1, 2)
    w1 = torch.clamp(p1 / q1, max=1.0)  # [3] weight after each first draft
    reach2 = sum(float(q1[x]) * float(torch.minimum(q2, w1[x] * p2).sum()) for x in range(3))
    reach = metrics.chain_reach(block[:1], valid[:1])
    assert reach[0] == pytest.approx(float(token[0, 0]), rel=2e-3)
    assert reach[1] == pytest.approx(reach2, rel=3e-3)
    assert reach[1] > float(token[0, 0] * token[0, 1])  # the sampled chain recovers after a ratio < 1
    with pytest.raises(ValueError, match="temperature > 0"):
        speculator_block_alpha([step0, step1], teacher, torch.arange(3), 1, GREEDY, 2)


def test_ngram_alpha_by_hand_greedy_and_sampled() -> None:
    ids = [4, 1, 2, 3, 1, 2]  # prompt [4, 1, 2], continuation [3, 1, 2]; positions t = 2, 3
    proposals = {4: [3, 1], 5: [2, 2]}  # keyed by context length t + 2

    def propose(ctx: list[int], k: int) -> list[int]:
        assert ctx == ids[: len(ctx)]
        return proposals[len(ctx)][:k]

    teacher = onehot_logits([0, 0, 0, 1, 2, 0], 5)  # teacher@3 = 1, teacher@4 = 2
    alpha, valid = ngram_alpha(ids, teacher, prompt_len=3, params=GREEDY, depth=2, propose=propose)
    # t=2 proposes [3, 1]: 3 vs teacher@3 = 1 miss, 1 vs teacher@4 = 2 miss
    # t=3 proposes [2, 2]: 2 vs teacher@4 = 2 hit; depth 2 would predict x[6], outside the sequence
    assert valid.tolist() == [[True, True], [True, False]]
    assert alpha.tolist() == [[0.0, 0.0], [1.0, 0.0]]

    # T = 1: a deterministic draft x is accepted with probability p(x)
    p3 = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    p4 = torch.tensor([0.2, 0.2, 0.4, 0.1, 0.1])
    teacher1 = torch.zeros(6, 5)
    teacher1[3], teacher1[4] = p3.log(), p4.log()
    proposals.update({4: [1, 2], 5: [2, 0]})
    alpha1, _ = ngram_alpha(ids, teacher1, prompt_len=3, params=T1, depth=2, propose=propose)
    assert alpha1[0, 0].item() == pytest.approx(0.6, abs=1e-6)  # p3(1)
    assert alpha1[0, 1].item() == pytest.approx(0.4, abs=1e-6)  # p4(2)
    assert alpha1[1, 0].item() == pytest.approx(0.4, abs=1e-6)  # p4(2)
    s = summarize(alpha1, valid, rows=1)
    assert s["chain_reach"][0] == pytest.approx((0.6 + 0.4) / 2, abs=1e-4)
    # a_2 over the one position with a depth 2 (t=2): 0.6 * 0.4 / 0.6; E_2 = a_1 * a_2
    assert s["per_position_acceptance"][1] == pytest.approx(0.4, abs=1e-4)
    assert s["chain_reach"][1] == pytest.approx(0.5 * 0.4, abs=1e-4)


def test_ngram_gather_equals_sampled_alpha_of_a_onehot_draft() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    ids = [3, 5, 3, 5, 3, 5, 3]
    alpha, valid = ngram_alpha(ids, logits, prompt_len=2, params=T1, depth=2, propose=ngram_propose)
    for n, t in enumerate(range(1, 5)):
        drafted = ngram_propose(ids[: t + 2], 2)
        for k in (1, 2):
            if not valid[n, k - 1]:
                continue
            p = torch.softmax(logits[t + k], -1)
            q = torch.nn.functional.one_hot(torch.tensor(drafted[k - 1]), 11).float()
            assert alpha[n, k - 1].item() == pytest.approx(metrics.sampled_alpha(p, q).item(), abs=1e-6)


def test_ngram_baseline_on_a_copy_sequence_accepts_everything() -> None:
    ids = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10]  # the continuation repeats the prompt
    teacher = onehot_logits(ids[1:] + [7], 12)  # the target's greedy next token is the next id of the cycle
    alpha, valid = ngram_alpha(ids, teacher, prompt_len=5, params=GREEDY, depth=3, propose=ngram_propose)
    assert bool((alpha[valid] == 1).all())
    s = summarize(alpha, valid, rows=1)
    assert s["simulated_tau"] == pytest.approx(4.0)


def test_accumulator_cohorts_and_mean() -> None:
    acc = AlphaAccumulator(depth=2)
    ones, zeros = torch.ones(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64)
    valid = torch.ones(4, 2, dtype=torch.bool)
    acc.add("a", ones, valid)
    acc.add("b", zeros, valid)
    s = acc.summary()
    assert s["cohorts"]["a"]["simulated_tau"] == 3.0 and s["cohorts"]["b"]["simulated_tau"] == 1.0
    assert s["mean_tau"] == 2.0
    assert s["overall"]["chain_reach"] == [0.5, 0.5] and s["overall"]["rows"] == 2


def test_truncate_compares_at_equal_depth() -> None:
    from speculators.evaluate.alpha import truncate

    acc = AlphaAccumulator(depth=3)
    acc.add("a", torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64),
            torch.ones(2, 3, dtype=torch.bool))
    full = acc.summary()
    cut = truncate(full, 2)
    assert cut["cohorts"]["a"]["per_position_acceptance"] == [1.0, 0.5]
    assert cut["cohorts"]["a"]["simulated_tau"] == 2.5 and full["cohorts"]["a"]["simulated_tau"] == 3.0
    assert cut["mean_tau"] == 2.5 and cut["overall"]["chain_reach"] == [1.0, 0.5]


def test_per_sequence_memo_looks_each_prefix_up_once_and_returns_the_same_proposals() -> None:
    """The n-gram is scored at every position and at cycle starts from one memo: the same proposals, half the
    lookups."""
    ids = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6]
    calls: list[int] = []
    lookup = NgramDrafter().lookup

    def counted(prefix: list[int], depth: int) -> list[int]:
        calls.append(len(prefix))
        return lookup(prefix, depth)

    memo = per_sequence_memo(counted)
    logits = torch.randn(len(ids), 12)
    params = SamplingParams(temperature=0.0)
    a_memo, v_memo = ngram_alpha(ids, logits, 3, params, 3, memo)
    w_memo = proposer_chain_weights(ids, 3, 3, memo)
    assert len(calls) == len(set(calls))  # each prefix once, though both scores visit it
    a, v = ngram_alpha(ids, logits, 3, params, 3, lookup)
    assert torch.equal(a, a_memo) and torch.equal(v, v_memo)
    assert torch.equal(w_memo, proposer_chain_weights(ids, 3, 3, lookup))
    assert w_memo.sum() > 0  # the repeats are found
