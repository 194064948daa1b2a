"""The one implementation of the acceptance formulas (docs/architecture.md §5)."""

from __future__ import annotations

import pytest
import torch

from speculators.core import metrics


def test_tau_and_simulated_tau() -> None:
    assert metrics.tau(10, 4) == 2.5
    assert metrics.tau(0, 0) == 0.0
    assert metrics.simulated_tau([]) == 1.0
    assert metrics.simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert metrics.simulated_tau([1.0, 1.0, 1.0]) == 4.0


def test_alphas() -> None:
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.6, 0.3, 0.1]])
    assert metrics.greedy_alpha(p.log(), q.log()).tolist() == [1.0, 0.0]
    assert metrics.sampled_alpha(p, q).tolist() == pytest.approx([0.5 + 0.2 + 0.1, 0.1 + 0.1 + 0.1])


def test_chain_reach_and_per_position() -> None:
    # 4 positions, 3 depths; greedy 0/1 acceptances
    alpha = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.float32)
    reach = metrics.chain_reach(alpha)
    assert reach == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    a = metrics.per_position_from_reach(reach)
    assert a == pytest.approx([0.75, 2 / 3, 0.5])
    assert metrics.simulated_tau(a) == pytest.approx(1 + sum(reach))
    valid = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    reach_v = metrics.chain_reach(alpha, valid)
    # a_2 over the two positions that have depth 2 (rows 0, 1): 1 of 2 reached depth 1 and accepted depth 2
    assert reach_v == pytest.approx([2 / 3, 2 / 3 * 1 / 2, 0.0])
    # near the end of sequences positions drop out of deeper depths; a_k stays a conditional (<= 1)
    late = torch.tensor([[1, 1], [1, 1], [0, 0]], dtype=torch.float32)
    late_valid = torch.tensor([[1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    a_late = metrics.per_position_from_reach(metrics.chain_reach(late, late_valid))
    assert a_late == pytest.approx([2 / 3, 0.0]) and max(a_late) <= 1


def test_live_stats_counters() -> None:
    s = metrics.AcceptanceStats(max_depth=4)
    s.record(accepted=2, drafted_depth=3, verified_nodes=5)  # depths 1,2 accepted, 3 rejected
    s.record(accepted=3, drafted_depth=3, verified_nodes=3)  # all accepted: bonus
    s.record(accepted=0, drafted_depth=3, verified_nodes=4)
    assert s.target_calls == 3 and s.committed_tokens == 3 + 4 + 1
    assert s.tau == pytest.approx(8 / 3)
    assert s.attempts[:3] == [3, 2, 2] and s.accepts[:3] == [2, 2, 1]
    assert s.per_position_acceptance == pytest.approx([2 / 3, 1.0, 0.5])
    assert s.bonus_rate == pytest.approx(1 / 3)
    assert s.wasted_verified_tokens == 12 - 5
    d = s.to_dict()
    assert d["accepted_length_histogram"] == [1, 0, 1, 1]
    other = metrics.AcceptanceStats(max_depth=4)
    other.record(1, 1, 1)
    s.merge(other)
    assert s.target_calls == 4
    with pytest.raises(ValueError):
        s.record(accepted=4, drafted_depth=3, verified_nodes=3)


def _exact_block_reach(p_rows: list[list[float]], q_rows: list[list[float]]) -> list[float]:
    """E[w_k] by enumerating every drafted chain (X_k ~ q_k independent), w_k = min(1, w_{k-1} p_k / q_k)."""
    paths = [(1.0, 1.0)]  # (probability of the drafted prefix, weight)
    reach = []
    for p, q in zip(p_rows, q_rows, strict=True):
        paths = [(pr * q[x], min(1.0, w * p[x] / q[x])) for pr, w in paths for x in range(len(q)) if q[x] > 0]
        reach.append(sum(pr * w for pr, w in paths))
    return reach


def test_block_reach_brackets_the_exact_expectation_and_beats_token_wise() -> None:
    """On random small laws (several rows at once, zeros included) the bounds bracket the exact E[w_k], their gap
    is small, and the estimate is never below the token-wise reach prod_j sum min(p_j, q_j)."""
    gen = torch.Generator().manual_seed(0)
    n, depth, vocab = 6, 4, 5
    p = [torch.softmax(torch.randn(n, vocab, generator=gen) * 2, -1) for _ in range(depth)]
    q = [torch.softmax(torch.randn(n, vocab, generator=gen) * 2, -1) for _ in range(depth)]
    p[1][:, 0] = 0.0  # the target excludes a token the draft proposes
    p[1] /= p[1].sum(-1, keepdim=True)
    q[2][:, 1] = 0.0  # the draft never proposes one the target likes
    q[2] /= q[2].sum(-1, keepdim=True)
    lower, upper = metrics.block_reach_bounds(p, q)
    estimate = metrics.block_reach(p, q)
    token_wise = torch.cumprod(torch.stack([metrics.sampled_alpha(a, b) for a, b in zip(p, q, strict=True)], 1), 1)
    for row in range(n):
        exact = torch.tensor(_exact_block_reach([r[row].tolist() for r in p], [r[row].tolist() for r in q]),
                             dtype=torch.float64)
        assert bool((lower[row] <= exact + 1e-12).all() and (exact <= upper[row] + 1e-12).all()), (row, exact)
        assert float((upper[row] - lower[row]).max()) < 0.01
        assert float((estimate[row] - exact).abs().max()) < 0.004
        assert bool((exact >= token_wise[row].double() - 1e-6).all())  # float32 token-wise rows
    assert float((estimate - token_wise.double()).min()) > -0.004
    assert float((estimate[:, 1:] - token_wise[:, 1:].double()).mean()) > 0.01  # these laws recover


def test_block_reach_equals_token_wise_without_recovery_and_feeds_chain_reach() -> None:
    """A one-hot draft (ratios p(x) <= 1) cannot recover: block reach = token-wise reach; block_alpha's chain reach
    is the block reach."""
    p = [torch.tensor([[0.6, 0.3, 0.1]]), torch.tensor([[0.2, 0.5, 0.3]])]
    q = [torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0]])]
    lower, upper = metrics.block_reach_bounds(p, q)
    assert lower[0].tolist() == pytest.approx([0.6, 0.3], rel=0.01) and upper[0].tolist() == pytest.approx([0.6, 0.3],
                                                                                                           rel=0.01)
    alpha = metrics.block_alpha(p, q)
    assert metrics.chain_reach(alpha) == pytest.approx(metrics.block_reach(p, q)[0].tolist())
    assert metrics.block_reach_bounds([], [])[0].shape == (0, 0)


def test_committed_distribution_matches_simulated_tau() -> None:
    a = [0.9, 0.6, 0.3]
    for depth in range(0, 5):
        probs = metrics.committed_distribution(a, depth)
        assert len(probs) == depth + 1 and sum(probs) == pytest.approx(1.0)
        assert sum(j * p for j, p in enumerate(probs, 1)) == pytest.approx(metrics.simulated_tau(a[:depth]))
    assert metrics.committed_distribution(a, 2) == pytest.approx([0.1, 0.9 * 0.4, 0.9 * 0.6])
    assert metrics.committed_distribution([], 0) == [1.0]
