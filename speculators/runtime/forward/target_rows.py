"""The target's filtered next-token law at the nodes of a draft tree, made on demand for `verify_tree_lazy`.

Verification walks one root->leaf path, so it reads only the rows of the nodes it visits (tau of them on
average). `TargetRows` runs the target's output head and the sampling filter for those alone: asked for a node it
has not made yet, it makes that node and the node's first-child chain in ONE product. Drafters order siblings
best-first (top-k by draft score, Medusa rank 0 first, a chain is all first children), so that chain is the
drafter's own guess of the path the walk takes, and one product usually covers the whole walk. On the house target
the head (8192 x 256) is the widest product of a step: at 14 tree nodes it costs as much as two decoder layers.

Every row is the same function of the same hidden state as when all rows are made at once; which rows get made
depends only on the tree and on rows already made, never on a random draw. The first block (the root's first-child
chain, `first_child_chain`) can be made by the target forward itself (`Segment.logit_rows`) and handed in as
`premade` logits: several requests sharing a forward then share that product too (`batching.py`).

Not here: the target forward (target_runner.py), the filter (`sampling.logits_to_probs`), verification
(verify/lossless.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the target's raw law, and the `top` most likely tokens there
    (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class TargetRows:
    """node -> the filtered target law [V] after the path to that node, made in first-child-chain blocks."""

    def __init__(self, hidden: torch.Tensor, parents: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                 law: Callable[[torch.Tensor], torch.Tensor],
                 premade: tuple[list[int], torch.Tensor] | None = None, keep_logits: bool = False) -> None:
        """hidden [N, H]: every node's final-norm target output; head: hidden rows [R, H] -> logits [R, V];
        law: logits [R, V] -> filtered probabilities [R, V]; premade: (nodes, their logits [R, V]) already made
        (the filter is applied to them when the walk first reads one). With `keep_logits`, the raw logits of every
        row made are kept too (`logits(node)`: the log-probabilities a request asked for come from them)."""
        self.hidden, self.head, self.law = hidden, head, law
        self.raw: dict[int, torch.Tensor] | None = {} if keep_logits else None  # node -> logits [V]
        self.first_child = _first_children(parents)
        self.rows: dict[int, torch.Tensor] = {}  # node -> [V]
        self.products = 0  # output-head products run (one per block)
        self.premade = premade if premade is not None and len(premade[0]) else None

    def __call__(self, node: int) -> torch.Tensor:  # [V]
        if node not in self.rows and self.premade is not None and node in self.premade[0]:
            nodes, logits = self.premade
            self.rows.update(zip(nodes, self.law(logits), strict=True))
            if self.raw is not None:
                self.raw.update(zip(nodes, logits, strict=True))
            self.premade = None
        if node not in self.rows:
            block, i = [], node
            while i >= 0 and i not in self.rows:  # children have larger indices: this ends
                block.append(i)
                i = self.first_child[i]
            index = torch.tensor(block, device=self.hidden.device)  # [R]
            logits = self.head(self.hidden[index])  # [R, V]
            probs = self.law(logits)  # [R, V]
            self.rows.update(zip(block, probs, strict=True))
            if self.raw is not None:
                self.raw.update(zip(block, logits, strict=True))
            self.products += 1
        return self.rows[node]

    def logits(self, node: int) -> torch.Tensor:  # [V]
        """The raw target logits at `node` (made on demand; needs `keep_logits`)."""
        if self.raw is None:
            raise ValueError("TargetRows was made without keep_logits")
        self(node)
        return self.raw[node]

    def token_logprobs(self, nodes: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
        """tokens[j] was drawn from the law at nodes[j]: its log-probability there and the `top` best alternatives
        (log-softmax of the raw logits, float32)."""
        if not tokens:
            return []
        logp = torch.log_softmax(torch.stack([self.logits(n) for n in nodes]).float(), dim=-1)  # [J, V]
        chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()  # [J]
        best = torch.topk(logp, top, dim=-1) if top else None
        out = []
        for j, tok in enumerate(tokens):
            alts = list(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True)) if best is not None else []
            out.append(TokenLogprob(int(tok), float(chosen[j]), alts))
        return out

    @property
    def made(self) -> int:
        """Rows made so far."""
        return len(self.rows)


def _first_children(parents: torch.Tensor) -> list[int]:
    """first_child[i] = the lowest-index child of node i (-1 for a leaf)."""
    first = [-1] * int(parents.shape[0])
    for child, parent in enumerate(parents.tolist()[1:], 1):
        if first[parent] < 0:
            first[parent] = child
    return first


def first_child_chain(parents: torch.Tensor) -> list[int]:
    """The root and its first-child chain: the block `TargetRows` makes first (the drafter's guess of the path)."""
    first = _first_children(parents)
    chain, i = [], 0
    while i >= 0:
        chain.append(i)
        i = first[i]
    return chain
