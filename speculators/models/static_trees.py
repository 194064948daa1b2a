"""Static (Medusa-style) draft trees: fixed paths of ranks, and how to choose them.

- `build_static_tree(stepper, root, choices, depth, budget, d2t, mode)`: path (r1, ..., rd) = the rank-rd token of
  the draft law after the path (r1, ..., r(d-1)); choices deeper than `depth` are dropped, at most `budget` kept
  (shortest first, prefix-closed); one batched draft forward per level.
- `medusa_choices_from_accuracy` (greedy expected-acceptance maximisation from per-head top-k accuracy under a
  node budget), `default_topk_accuracy` (a typical profile) and `default_choices` (the former on the latter).

Not here: the other tree kinds and the dispatch on `TreeConfig.kind` (drafting.py), the steppers (steppers.py),
verification.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from speculators.core.errors import SpeculatorsError
from speculators.core.trees import DraftTree
from speculators.models.steppers import Stepper

__all__ = ["build_static_tree", "medusa_choices_from_accuracy", "default_topk_accuracy", "default_choices"]


def _normalise_choices(choices: Sequence[Sequence[int]], depth: int, budget: int) -> list[tuple[int, ...]]:
    paths = sorted({tuple(int(r) for r in c) for c in choices if len(c) > 0}, key=lambda p: (len(p), p))
    known = set(paths)
    for p in paths:
        if any(r < 0 for r in p):
            raise SpeculatorsError(f"tree choice {list(p)} has a negative rank; ranks count from 0")
        if len(p) > 1 and p[:-1] not in known:
            raise SpeculatorsError(f"tree choice {list(p)} has no parent path {list(p[:-1])}; list every prefix")
    return [p for p in paths if len(p) <= depth][:budget]


def build_static_tree(stepper: Stepper, root_token: int, choices: Sequence[Sequence[int]], depth: int, budget: int,
                      d2t: torch.Tensor, mode: str) -> DraftTree:
    """Static tree: path (r1, ..., rd) = the rank-rd token of the draft law after the path (r1, ..., r(d-1)).
    Paths deeper than `depth` are dropped and at most `budget` are kept (shortest first, prefix-closed)."""
    paths = _normalise_choices(choices, depth, budget)
    node_of: dict[tuple[int, ...], int] = {(): -1}  # path -> stepper node id (index in `paths`)
    tok_of: dict[tuple[int, ...], int] = {}
    vd = d2t.shape[0]
    by_depth: dict[int, list[tuple[int, ...]]] = {}
    for p in paths:
        by_depth.setdefault(len(p), []).append(p)
    for d in sorted(by_depth):
        level = [p for p in by_depth[d] if p[:-1] in node_of and p[-1] < vd]
        parents = sorted({p[:-1] for p in level}, key=lambda p: (len(p), p))
        if not parents:
            break
        if d == 1:
            laws = {(): stepper.root_logits()}
        else:
            if stepper.room < len(parents):
                break
            rows = stepper.step([node_of[p] for p in parents], torch.tensor([tok_of[p] for p in parents]),
                                [node_of[p[:-1]] for p in parents], d - 1)  # [F, Vd]
            laws = {p: rows[i] for i, p in enumerate(parents)}
        ranked = {p: torch.topk(laws[p].float(), min(vd, 1 + max(c[-1] for c in level if c[:-1] == p))).indices
                  for p in parents}
        for p in level:
            node_of[p] = paths.index(p)
            tok_of[p] = int(d2t[ranked[p[:-1]][p[-1]]])
    kept = [p for p in paths if p in tok_of]
    index = {p: i + 1 for i, p in enumerate(kept)}
    index[()] = 0
    tokens = [int(root_token)] + [tok_of[p] for p in kept]
    parents_idx = [-1] + [index[p[:-1]] for p in kept]
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long),
                     parents=torch.tensor(parents_idx, dtype=torch.long), mode=mode)


def medusa_choices_from_accuracy(topk_accuracy: Sequence[Sequence[float]], budget: int) -> list[list[int]]:
    """Static tree maximising the expected number of accepted drafts under a node budget.

    topk_accuracy[h][i] = measured P(the correct token is among the top-(i+1) of head/step h) (cumulative). The
    probability that rank i of head h is the correct token is acc[h][i] - acc[h][i-1]; a path's acceptance
    probability is the product over its ranks (heads treated as independent); the expected accepted length is
    the sum over nodes, so adding nodes best-first (a child never beats its parent) is optimal. -> paths sorted by
    (length, ranks)."""
    acc = [[min(1.0, max(0.0, float(a))) for a in row] for row in topk_accuracy]
    if not acc or budget < 1:
        return []
    rank_p = []
    for row in acc:
        cum = 0.0
        ps = []
        for a in row:
            a = max(a, cum)
            ps.append(a - cum)
            cum = a
        rank_p.append(ps)
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-p, 1, (i,)) for i, p in enumerate(rank_p[0]) if p > 0]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, _, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(rank_p):
            for i, p in enumerate(rank_p[len(path)]):
                if p > 0:
                    heapq.heappush(heap, (neg * p, len(path) + 1, path + (i,)))
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def default_topk_accuracy(num_steps: int, topk: int = 8) -> list[list[float]]:
    """A typical per-step top-k accuracy profile (shaped like published Medusa head accuracies: top-1
    .56/.32/.20/.15/.12, top-5 .78/.56/.42/.34/.30, decaying further for deeper steps)."""
    top1 = [0.56, 0.32, 0.20, 0.15, 0.12]
    top5 = [0.78, 0.56, 0.42, 0.34, 0.30]
    out = []
    for h in range(num_steps):
        a1 = top1[h] if h < 5 else top1[-1] * 0.8 ** (h - 4)
        a5 = top5[h] if h < 5 else top5[-1] * 0.8 ** (h - 4)
        out.append([min(0.99, a1 + (a5 - a1) * math.log(i + 1) / math.log(5)) for i in range(topk)])
    return out


def default_choices(depth: int, budget: int) -> list[list[int]]:
    """Static tree for `depth` steps and `budget` nodes when no measured accuracy is available."""
    return medusa_choices_from_accuracy(default_topk_accuracy(max(1, depth)), budget)
