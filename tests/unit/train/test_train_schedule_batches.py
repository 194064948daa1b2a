"""LR schedule, batch plan (deterministic, rank-sharded, resumable) and collation."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.train.batches import BatchPlan, collate
from speculators.train.loop import lr_factor, warmup_steps


def test_warmup_then_cosine_to_min_ratio() -> None:
    total, warm = 100, warmup_steps(100, 0.1)
    assert warm == 10
    f = [lr_factor(s, total, warm, "cosine", 0.1) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:10], strict=False))  # rising during warmup
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))  # non-increasing afterwards
    assert f[10 + 45] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-6)
    assert lr_factor(total, total, warm, "cosine", 0.1) == pytest.approx(0.1)


def test_linear_and_constant_schedules() -> None:
    assert lr_factor(0, 10, 0, "linear", 0.0) == pytest.approx(1.0)
    assert lr_factor(5, 10, 0, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(10, 10, 0, "linear", 0.2) == pytest.approx(0.2)
    assert {lr_factor(s, 10, 2, "constant", 0.1) for s in range(2, 10)} == {1.0}
    with pytest.raises(SpeculatorsError):
        lr_factor(3, 10, 0, "exponential", 0.1)


def _plan(rank: int, world: int, n: int = 50, bs: int = 4) -> BatchPlan:
    lengths = [(i * 37) % 90 + 5 for i in range(n)]
    return BatchPlan(list(range(n)), lengths, bs, seed=7, rank=rank, world=world)


def test_plan_is_deterministic_sharded_and_reshuffled_per_epoch() -> None:
    p0, p1 = _plan(0, 2), _plan(1, 2)
    assert p0.batches_per_epoch == p1.batches_per_epoch == 13 // 2
    e0 = p0.epoch_batches(0) + p1.epoch_batches(0)
    flat = [i for b in e0 for i in b]
    assert len(flat) == len(set(flat))  # no sequence twice in an epoch, ranks disjoint
    assert {i for b in p0.epoch_batches(0) for i in b}.isdisjoint({i for b in p1.epoch_batches(0) for i in b})
    assert _plan(0, 2).epoch_batches(0) == p0.epoch_batches(0)  # same seed, same order
    assert p0.epoch_batches(1) != p0.epoch_batches(0)  # reshuffled
    assert p0.batch_at(p0.batches_per_epoch + 2) == p0.epoch_batches(1)[2]  # data position = micro-step
    single = _plan(0, 1)
    assert sorted(i for b in single.epoch_batches(0) for i in b) == list(range(50))


def test_plan_groups_similar_lengths() -> None:
    plan = _plan(0, 1, n=200, bs=8)
    lengths = plan.lengths
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in plan.epoch_batches(0))
    rand = torch.Generator().manual_seed(0)
    perm = torch.randperm(200, generator=rand).tolist()
    rand_spread = sum(max(lengths[i] for i in perm[j:j + 8]) - min(lengths[i] for i in perm[j:j + 8])
                      for j in range(0, 200, 8))
    assert spread < rand_spread / 2


def test_plan_refuses_too_little_data() -> None:
    with pytest.raises(SpeculatorsError, match="batch_size"):
        BatchPlan([0, 1, 2], [5, 5, 5], 4, seed=0, rank=0, world=1)


def test_collate_pads_right_and_masks() -> None:
    seqs = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1]),
             "taps": torch.ones(3, 4), "teacher_topk_ids": torch.ones(3, 2, dtype=torch.long),
             "teacher_topk_logprobs": torch.zeros(3, 2)},
            {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1]), "taps": torch.full((1, 4), 2.0),
             "teacher_topk_ids": torch.ones(1, 2, dtype=torch.long), "teacher_topk_logprobs": torch.zeros(1, 2)}]
    b = collate(seqs, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert b["taps"].shape == (2, 3, 4) and b["taps"][1, 1:].abs().sum() == 0
    assert b["teacher_topk_ids"][1, 1:].eq(-1).all()
    assert torch.isinf(b["teacher_topk_logprobs"][1, 1:]).all()
