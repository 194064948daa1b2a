"""Tree-building policies shared by every speculator family, written over a family-provided draft stepper.

What it does:
- `propose_tree(stepper, root, tree_cfg, sampling, generator, draft_to_target, vocab_size) -> DraftTree`
  dispatches on `TreeConfig.kind`:
  * "dynamic": EAGLE-2 tree. Level 1 = top-k of the root's draft law; each further level runs the draft once over
    the (at most top-k) frontier, takes top-k children per node, scores them by cumulative log-prob and keeps the
    global top-k as the next frontier; finally all candidates are reranked by cumulative log-prob (ties: earlier
    candidate first) and the best `budget` form the tree (ancestor-closed by construction). Frontier nodes that can
    no longer place a child inside the budget are not expanded.
  * "static": Medusa-style choices (paths of ranks); a node's children are the given ranks of its own draft law
    (static_trees.py, with the choices derived from per-head accuracy).
  * "best_first": DDTree (arXiv 2604.12989) for path-independent steppers (`PathIndependentStepper`: the law at
    depth d is the same for every node there, e.g. Medusa heads or a DFlash block). Take the top-min(budget, Vd)
    log-probs of each depth's law; a node is a path of ranks (r1, ..., rd), scored by the sum of its log-probs (a
    product of marginals). A best-first heap starts from (depth 1, rank 0); each pop adds the node and pushes its next
    sibling (rank + 1, same parent) and its first child (depth + 1, rank 0); it stops at `budget` nodes. Scores only
    decrease along both moves, so the tree is exactly the top-`budget` ancestor-closed prefixes (ties: shallower,
    then lower rank, then earlier parent). Nodes are in the order chosen, so the first m nodes are the best-first
    tree of budget m. No draft forward: the laws are read once per depth. Other steppers are refused.
  * "chain": one child per node; greedy (argmax) at T=0, sampled from the draft law at T>0.
  * "sampled": a chain (the spine) whose node at each level also gets siblings: at T>0 the level's `width` children
    are drawn one after another without replacement from the spine node's draft law and the first draw is continued
    (`sampled_tree_widths`: up to top-k per level, shallow levels first, within the budget); at T=0 the level's top
    ranks. Drafting costs what a chain costs (one draft row per level); the siblings are extra draws of the same law.
- Verify modes (decided by `core.trees.tree_verify_mode`): T=0 -> "greedy"; T>0: sampled drafts carry
  `draft_probs` (row i = the law node i's children were drawn from: `logits_to_probs` on the draft logits mapped to
  the target vocab, -inf outside the draft vocab, with the request's SamplingParams; rows of leaves are zero) and are
  verified as sequences — chains by "block", sampled trees by "traversal" — or token-wise ("iid" /
  "without_replacement") when `TreeConfig.verify` is "token"; top-k trees (dynamic, static, best_first: no
  draft_probs) -> "deterministic".
- Tree tokens are TARGET ids (draft ids mapped through `draft_to_target`); top-k siblings are distinct.

Every builder drafts through a stepper (steppers.py: `Stepper`, `PathIndependentStepper`, `MarginalStepper`).
Not here: the static-tree builder and its choices (static_trees.py), the models themselves, KV caches, verification.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from speculators.core.config import TREE_KINDS  # what `propose_tree` builds (TreeConfig.kind)
from speculators.core.errors import SpeculatorsError
from speculators.core.sampling import SamplingParams, logits_to_probs, sample, sample_without_replacement
from speculators.core.trees import SAMPLED_MODES, DraftTree, tree_verify_mode, verify_mode
from speculators.models.static_trees import build_static_tree, default_choices
from speculators.models.steppers import PathIndependentStepper, Stepper

if TYPE_CHECKING:
    from speculators.core.config import TreeConfig

__all__ = ["TREE_KINDS", "propose_tree", "build_chain", "build_dynamic_tree", "build_sampled_tree",
           "build_best_first_tree", "sampled_tree_widths", "root_only", "tree_verify_mode", "to_target_logits"]


def root_only(root_token: int, sampling: SamplingParams, kind: str = "dynamic") -> DraftTree:
    return DraftTree.root_only(int(root_token), mode=tree_verify_mode(kind, sampling))


def to_target_logits(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocab logits [..., Vd] -> target-vocab logits [..., V] (-inf outside the draft vocab)."""
    if logits.shape[-1] == vocab_size:
        return logits
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    out[..., draft_to_target.to(logits.device)] = logits
    return out


def propose_tree(stepper: Stepper, root_token: int, cfg: TreeConfig, sampling: SamplingParams,
                 generator: torch.Generator | None, draft_to_target: torch.Tensor, vocab_size: int) -> DraftTree:
    """A draft tree rooted at `root_token` shaped by `cfg` (depth <= cfg.depth, at most cfg.budget draft nodes)."""
    depth = min(int(cfg.depth), int(stepper.max_depth))
    budget = int(cfg.budget)
    if depth < 1 or budget < 1:
        return root_only(root_token, sampling, cfg.kind)
    d2t = draft_to_target.to(stepper.root_logits().device)
    mode = tree_verify_mode(cfg.kind, sampling, cfg.verify)
    if cfg.kind == "chain":
        return build_chain(stepper, root_token, min(depth, budget), sampling, generator, d2t, vocab_size, mode)
    if cfg.kind == "sampled":
        widths = sampled_tree_widths(depth, int(cfg.topk), budget)
        return build_sampled_tree(stepper, root_token, widths, sampling, generator, d2t, vocab_size, mode)
    if cfg.kind == "dynamic":
        return build_dynamic_tree(stepper, root_token, depth, int(cfg.topk), budget, d2t, mode)
    if cfg.kind == "static":
        choices = cfg.choices or getattr(stepper, "choices", None) or default_choices(depth, budget)
        return build_static_tree(stepper, root_token, choices, depth, budget, d2t, mode)
    if cfg.kind == "best_first":
        return build_best_first_tree(stepper, root_token, depth, budget, d2t, mode)
    raise SpeculatorsError(f"unknown tree kind {cfg.kind!r}; use one of {', '.join(TREE_KINDS)}")


# ----------------------------------------------------------------------------------------------------------------
# chains


def _draft_generator(generator: torch.Generator | None, sampling: SamplingParams, device: torch.device
                     ) -> torch.Generator:
    if generator is not None:
        return generator
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % (1 << 62)))
    return generator


def build_chain(stepper: Stepper, root_token: int, length: int, sampling: SamplingParams,
                generator: torch.Generator | None, d2t: torch.Tensor, vocab_size: int, mode: str = "block"
                ) -> DraftTree:
    """Chain of up to `length` drafts: argmax at T=0 ("greedy"), else sampled from the draft law (verified in
    `mode`: "block" or "iid")."""
    logits = stepper.root_logits()  # [Vd]
    tokens = [int(root_token)]
    rows: list[torch.Tensor] = []
    if not sampling.greedy:
        generator = _draft_generator(generator, sampling, logits.device)
    for d in range(1, length + 1):
        if sampling.greedy:
            tok = int(d2t[int(torch.argmax(logits))])
        else:
            if not bool(torch.isfinite(logits).all()):  # the draft overflowed (low-precision drafting): stop here
                break
            q = logits_to_probs(to_target_logits(logits.float(), d2t, vocab_size), sampling)  # [V]
            tok = sample(q, generator)
            rows.append(q)
        tokens.append(tok)
        if d == length or stepper.room < 1:
            break
        logits = stepper.step([d], torch.tensor([tok], dtype=torch.long), [d - 1 if d > 1 else -1], d)[0]
    n = len(tokens)
    if sampling.greedy:
        return DraftTree.chain(tokens[0], tokens[1:], mode=verify_mode(sampling, mode))
    probs = torch.zeros(n, vocab_size, dtype=torch.float32, device=logits.device)  # [N, V]; leaf row unused
    if rows:
        probs[: n - 1] = torch.stack(rows)
    return DraftTree.chain(tokens[0], tokens[1:], mode=mode, draft_probs=probs)


# ----------------------------------------------------------------------------------------------------------------
# sampled trees


def sampled_tree_widths(depth: int, topk: int, budget: int) -> list[int]:
    """Children of the spine node at each level of a "sampled" tree: 1 (the continued draw) plus up to topk - 1
    siblings, shallow levels first, `budget` nodes in all (at most depth levels)."""
    levels = max(0, min(depth, budget))
    widths = [1] * levels
    spare = budget - levels
    for i in range(levels):
        extra = min(max(topk - 1, 0), spare)
        widths[i] += extra
        spare -= extra
    return widths


def build_sampled_tree(stepper: Stepper, root_token: int, widths: Sequence[int], sampling: SamplingParams,
                       generator: torch.Generator | None, d2t: torch.Tensor, vocab_size: int, mode: str) -> DraftTree:
    """A spine with siblings (see the module docstring): level d holds widths[d-1] children of the level's spine
    node — at T>0 drawn without replacement from its draft law (recorded in draft_probs), at T=0 its top ranks — and
    the first of them is the next spine node. One draft row per level, as a chain."""
    logits = stepper.root_logits()  # [Vd]
    tokens, parents = [int(root_token)], [-1]
    laws: dict[int, torch.Tensor] = {}  # spine node -> the law its children were drawn from [V]
    if not sampling.greedy:
        generator = _draft_generator(generator, sampling, logits.device)
    spine = 0
    for d, width in enumerate(widths, start=1):
        if sampling.greedy:
            drawn = [int(d2t[i]) for i in torch.topk(logits.float(), min(width, logits.shape[-1])).indices.tolist()]
        else:
            if not bool(torch.isfinite(logits).all()):  # the draft overflowed (low-precision drafting): stop here
                break
            q = logits_to_probs(to_target_logits(logits.float(), d2t, vocab_size), sampling)  # [V]
            drawn = sample_without_replacement(q, width, generator)
            laws[spine] = q
        if not drawn:
            break
        first = len(tokens)
        tokens.extend(drawn)
        parents.extend([spine] * len(drawn))
        if d == len(widths) or stepper.room < 1:
            break
        logits = stepper.step([first], torch.tensor([drawn[0]], dtype=torch.long), [spine if spine else -1], d)[0]
        spine = first
    probs = None
    if not sampling.greedy:
        probs = torch.zeros(len(tokens), vocab_size, dtype=torch.float32, device=logits.device)  # [N, V]
        for node, q in laws.items():
            probs[node] = q
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                     mode=mode, draft_probs=probs)


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-2 dynamic trees


def build_dynamic_tree(stepper: Stepper, root_token: int, depth: int, topk: int, budget: int, d2t: torch.Tensor,
                       mode: str) -> DraftTree:
    """EAGLE-2 dynamic top-k tree (see the module docstring). One draft forward per level."""
    root = stepper.root_logits()
    k = max(1, min(topk, budget, root.shape[-1]))
    tok: list[int] = []
    parent: list[int] = []
    score: list[float] = []

    def add(scores: torch.Tensor, ids: torch.Tensor, parents: list[int]) -> list[int]:
        new = []
        for s, i, p in zip(scores.tolist(), d2t[ids].tolist(), parents, strict=True):
            if s > -math.inf:
                new.append(len(tok))
                tok.append(i)
                parent.append(p)
                score.append(s)
        return new

    lp = torch.log_softmax(root.float(), dim=-1)  # [Vd]
    sc, ids = torch.topk(lp, k)
    frontier = add(sc, ids, [-1] * k)
    for d in range(1, depth):
        if len(score) >= budget:  # a node whose score is not above the budget-th best can place no child
            kth = torch.topk(torch.tensor(score), budget).values[-1].item()
            frontier = [n for n in frontier if score[n] > kth]
        if len(frontier) > stepper.room:  # out of speculative slots: expand the best nodes that fit
            frontier = sorted(sorted(frontier, key=lambda n: (-score[n], n))[: max(stepper.room, 0)])
        if not frontier:
            break
        logits = stepper.step(frontier, torch.tensor([tok[n] for n in frontier], dtype=torch.long),
                              [parent[n] for n in frontier], d)  # [F, Vd]
        lp = torch.log_softmax(logits.float(), dim=-1) + torch.tensor([score[n] for n in frontier],
                                                                      device=logits.device)[:, None]
        csc, cid = torch.topk(lp, k, dim=-1)  # [F, k]
        new = add(csc.flatten(), cid.flatten(), [n for n in frontier for _ in range(k)])
        if not new:
            break
        best = torch.topk(torch.tensor([score[n] for n in new]), min(k, len(new))).indices.tolist()
        frontier = sorted(new[i] for i in best)
    return _select(root_token, tok, parent, score, budget, mode)


def _select(root_token: int, tok: list[int], parent: list[int], score: list[float], budget: int,
            mode: str) -> DraftTree:
    """Keep the best `budget` candidates by (score desc, index asc), ancestor-closed, in index order."""
    order = torch.sort(-torch.tensor(score, dtype=torch.float64), stable=True).indices.tolist()
    kept: set[int] = set()
    for c in order:
        if len(kept) >= budget:
            break
        if parent[c] == -1 or parent[c] in kept:
            kept.add(c)
    chosen = sorted(kept)
    index = {c: i + 1 for i, c in enumerate(chosen)}
    tokens = [int(root_token)] + [tok[c] for c in chosen]
    parents = [-1] + [0 if parent[c] == -1 else index[parent[c]] for c in chosen]
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                     mode=mode)


# ----------------------------------------------------------------------------------------------------------------
# best-first (DDTree) trees


def build_best_first_tree(stepper: PathIndependentStepper, root_token: int, depth: int, budget: int,
                          d2t: torch.Tensor, mode: str) -> DraftTree:
    """DDTree best-first tree (see the module docstring): the `budget` best prefixes of depth <= `depth` by product
    of the stepper's per-depth laws, in the order chosen. Verified "greedy" (T=0) or "deterministic"; no draft_probs."""
    if not getattr(stepper, "path_independent", False):
        others = ", ".join(k for k in TREE_KINDS if k != "best_first")
        raise SpeculatorsError(f"best_first trees need a drafter whose law at each depth ignores the path (Medusa, "
                               f"DFlash); {type(stepper).__name__} is not: use one of {others}")
    if mode in SAMPLED_MODES:
        raise SpeculatorsError(f"best_first trees are top-k trees (no draft_probs): verify mode {mode!r} cannot apply")
    depth = min(int(depth), int(stepper.max_depth))
    if depth < 1 or budget < 1:
        return DraftTree.root_only(int(root_token), mode)
    laws = torch.stack([stepper.depth_logits(d) for d in range(1, depth + 1)])  # [D, Vd]
    lp, ids = torch.topk(torch.log_softmax(laws.float(), dim=-1), min(budget, laws.shape[-1]), dim=-1)  # [D, k]
    logp, tok, k = lp.tolist(), d2t[ids].tolist(), lp.shape[-1]
    tokens, parents = [int(root_token)], [-1]
    heap: list[tuple[float, int, int, int, float]] = []  # (-score, depth, rank, parent node, parent's score)

    def push(d: int, r: int, parent: int, base: float) -> None:
        score = base + logp[d - 1][r]
        if score > -math.inf:  # a token the draft cannot produce (or a non-finite law) starts no node
            heapq.heappush(heap, (-score, d, r, parent, base))

    push(1, 0, 0, 0.0)
    while heap and len(tokens) <= budget:
        neg, d, r, parent, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok[d - 1][r])
        parents.append(parent)
        if r + 1 < k:
            push(d, r + 1, parent, base)
        if d < depth:
            push(d + 1, 0, node, -neg)
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                     mode=mode)
