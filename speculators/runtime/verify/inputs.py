"""Input checks of `verify.verify_tree` / `verify_tree_lazy`: probability rows and draft laws.

What it does: raise ValueError (one line, prefixed "verify_tree:") when target / draft rows have the wrong shape,
are not probabilities, or make a drafted token impossible, and when siblings that must be distinct are not. Not
here: the tree's shape (`verify.Tree.from_parents`) and the verification itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# |row sum - 1| allowed in input rows, by dtype; half-precision rows carry ~3 significant digits.
_ROW_SUM_TOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
_DEFAULT_ROW_SUM_TOL = 1e-3


def check_draft(tokens: Sequence[int], children: Sequence[Sequence[int]], parents: torch.Tensor,
                draft_probs: torch.Tensor | None, mode: str, vocab: int, *, distinct_siblings: bool) -> None:
    """Check draft_probs [N, V] for `mode` on a tree (node tokens, children per node, parents [N]): rows of nodes
    with children are laws that give every drafted child positive probability; siblings carry distinct tokens
    when `distinct_siblings`."""
    if draft_probs is None:
        raise ValueError(
            f"verify_tree: mode {mode!r} needs draft_probs [N, V] (the law each node's children were drawn from)"
        )
    internal = [i for i, kids in enumerate(children) if kids]
    check_rows("draft_probs", draft_probs, len(tokens), vocab, internal)
    if len(tokens) > 1:
        rows = parents[1:].to(device=draft_probs.device, dtype=torch.long)  # [N-1]
        cols = torch.tensor(tokens[1:], dtype=torch.long, device=draft_probs.device)  # [N-1]
        q_drafted = draft_probs[rows, cols]  # [N-1]
        if not float(q_drafted.min()) > 0:
            i = int(torch.nonzero(~(q_drafted > 0))[0]) + 1
            raise ValueError(
                f"verify_tree: node {i} carries token {tokens[i]} but draft_probs[{int(parents[i])}] gives it "
                f"probability 0, so it cannot have been drawn from that law"
            )
    if distinct_siblings:
        for node, kids in enumerate(children):
            toks = [tokens[c] for c in kids]
            if len(set(toks)) != len(toks):
                raise ValueError(
                    f"verify_tree: node {node} has duplicate child tokens {toks}; {mode} drafts are distinct"
                )


def check_rows(name: str, probs: object, n: int, vocab: int | None, rows: list[int] | None) -> int:
    """Check probs is [n, vocab] of non-negative rows summing to ~1 (only `rows` if given); return V."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(f"verify_tree: {name} must be a floating-point tensor [N, V], got {describe(probs)}")
    if probs.shape[0] != n or probs.shape[1] == 0 or (vocab is not None and probs.shape[1] != vocab):
        want = f"[{n}, {vocab if vocab is not None else 'V>0'}]"
        raise ValueError(f"verify_tree: {name} has shape {list(probs.shape)}, expected {want}")
    if rows is not None and not rows:
        return probs.shape[1]
    sel = probs if rows is None else probs[torch.tensor(rows, device=probs.device)]  # [R, V]
    tol = _ROW_SUM_TOL.get(probs.dtype, _DEFAULT_ROW_SUM_TOL)
    sums = sel.sum(dim=-1)  # [R]
    low, high = torch.aminmax(sums)
    if 1 - tol <= float(low) and float(high) <= 1 + tol and float(sel.min()) >= 0:  # NaN fails every test
        return probs.shape[1]
    index = list(range(n)) if rows is None else rows
    sum_ok = (sums - 1).abs() <= tol  # [R] False for NaN / Inf
    non_negative = sel.amin(dim=-1) >= 0  # [R]
    bad = int(torch.nonzero(~sum_ok | ~non_negative)[0])
    if not bool(sum_ok[bad]):
        raise ValueError(
            f"verify_tree: {name}[{index[bad]}] sums to {float(sums[bad]):.6g}; rows must be probabilities summing to 1"
        )
    raise ValueError(f"verify_tree: {name}[{index[bad]}] has negative entries; rows must be probabilities")


def describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__
