"""LR schedule, batch plan (deterministic, rank-sharded, resumable) and collation."""

from __future__ import annotations

import math

import pytest
import torch

from speculators.core.config import TrainConfig
from speculators.core.errors import SpeculatorsError
from speculators.train.batches import BatchPlan, collate
from speculators.train.loop import lr_schedule, warmup_steps


def _lrs(schedule: str, total: int, warmup: int, min_ratio: float, start: int = 0, lr: float = 1.0) -> list[float]:
    """The lr of every optimizer step from `start` to `total` (inclusive), as training applies them."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = lr_schedule(opt, TrainConfig(lr=lr, schedule=schedule, min_lr_ratio=min_ratio), total, warmup, start)
    out = []
    for _ in range(start, total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_min_ratio() -> None:
    total, warm = 100, warmup_steps(100, 0.1)
    assert warm == 10
    f = _lrs("cosine", total, warm, 0.1)
    assert f[0] == pytest.approx(0.1) and f[10] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:10], f[1:11], strict=True))  # rising during warmup
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))  # non-increasing afterwards
    assert f[10 + 45] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-6)
    assert f[total] == pytest.approx(0.1)


def test_linear_and_constant_schedules() -> None:
    f = _lrs("linear", 10, 0, 0.2, lr=2.0)
    assert f[0] == pytest.approx(2.0) and f[5] == pytest.approx(2.0 * (1 - 0.8 * 0.5)) and f[10] == pytest.approx(0.4)
    assert set(_lrs("constant", 10, 2, 0.1)[2:]) == {1.0}


def test_resumed_schedule_continues_where_it_stopped() -> None:
    """A run resumed at step 37 (its optimizer state carrying step 36's lr) applies what an uninterrupted run does."""
    whole = _lrs("cosine", 60, 6, 0.1, lr=3e-4)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=3e-4)
    opt.param_groups[0]["lr"] = whole[36]  # what a checkpoint's optimizer state restores
    sched = lr_schedule(opt, TrainConfig(lr=3e-4, schedule="cosine", min_lr_ratio=0.1), 60, 6, 37)
    resumed = []
    for _ in range(37, 61):
        resumed.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert resumed == pytest.approx(whole[37:], rel=1e-12)


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
