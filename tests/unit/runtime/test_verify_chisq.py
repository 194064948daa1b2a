"""Large-sample checks of the real, torch.Generator-backed verifier against exact probabilities.

Synthetic target/draft tables (Dirichlet rows per context, peaked and flat, some top-k/top-p filtered by
the runtime's own sampling operator), V = 8..16, trees from the exact tests and the runtime's best-first builder.
For every configuration the speculative loop is run n times with verify_tree; Pearson chi-square tests compare
  (1) the first committed token with p(.),
  (2) the joint of the first two committed tokens with p(y1) p(y2 | y1),
  (3) the accepted-length histogram of the first step with its exact law (enumeration, verify_harness).
Bins are merged until every expected count is >= 5; an impossible outcome observed fails outright.
Family-wise false-alarm rate <= 1e-6 (Bonferroni over all tests here). Every broken variant from the
exact tests must be rejected at the same n (power check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import scipy.stats
import torch
from verify_controls import (
    FrozenWeightOps,
    NoResidualOps,
    UnfilteredResidualOps,
    per_path_verify,
)
from verify_harness import (
    DraftSpec,
    LoopLaw,
    draft_tree,
)

from speculators.core.sampling import SamplingParams, logits_to_probs, sample
from speculators.runtime.verify.lossless import TorchRandomness, TorchRowOps, Tree, verify_tree, walk_tree

N_RUNS = 10_000
STATS_PER_CONFIG = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add latency (and contend on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# tables


@dataclass
class DirichletTables:
    """p and q rows per context, drawn from Dirichlet(alpha); p optionally filtered by logits_to_probs.

    The float32 tensors are what verify_tree sees; the float64 tuples (the same numbers, renormalised)
    are the exact law the samples are compared with.
    """

    vocab: int
    seed: int
    alpha_p: float
    alpha_q: float
    sampling: SamplingParams | None = None
    q_mix: float = 0.0  # q = (1 - q_mix) * Dirichlet + q_mix * unfiltered p: a draft that partly agrees
    _rows: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[float, ...]]] = field(default_factory=dict)

    def p(self, ctx: tuple[int, ...]) -> tuple[float, ...]:
        return self._row("p", ctx)[1]

    def q(self, ctx: tuple[int, ...]) -> tuple[float, ...]:
        return self._row("q", ctx)[1]

    def p_tensor(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self._row("p", ctx)[0]

    def q_tensor(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self._row("q", ctx)[0]

    def raw_tensor(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self._row("raw", ctx)[0]

    def _row(self, kind: str, ctx: tuple[int, ...]) -> tuple[torch.Tensor, tuple[float, ...]]:
        key = (kind, ctx)
        if key not in self._rows:
            self._rows[key] = self._make(kind, ctx)
        return self._rows[key]

    def _make(self, kind: str, ctx: tuple[int, ...]) -> tuple[torch.Tensor, tuple[float, ...]]:
        rng = np.random.default_rng([self.seed, 1 if kind == "q" else 0, len(ctx), *ctx])
        alpha = self.alpha_q if kind == "q" else self.alpha_p
        raw = np.maximum(rng.dirichlet(np.full(self.vocab, alpha)), 1e-12)  # [V]
        if kind == "q" and self.q_mix > 0:
            raw = (1 - self.q_mix) * raw + self.q_mix * self._row("raw", ctx)[0].double().numpy()
        row = torch.tensor(raw / raw.sum(), dtype=torch.float32)  # [V]
        if kind == "p" and self.sampling is not None:
            row = logits_to_probs(torch.log(self._row("raw", ctx)[0]), self.sampling)  # [V]
        exact = row.double() / row.double().sum()  # [V]
        return row, tuple(exact.tolist())


# ------------------------------------------------------------------------------------------------
# the sampled loop


class NumpyDraws:
    """Drafting randomness (independent of the verifier's generator)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def draw(self, row: tuple[float, ...]) -> int:
        cdf = np.cumsum(row)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(row) - 1))


@dataclass
class Batch:
    """One drafted tree as verify_tree inputs."""

    tree: Tree
    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]
    target: torch.Tensor  # [N, V]
    draft: torch.Tensor  # [N, V]
    target_rows: list[torch.Tensor]  # N x [V], stable objects (for id-keyed negative controls)
    raw_by_id: dict[int, torch.Tensor]


class Runner:
    """Runs the speculative loop until 2 tokens are committed, many times, with one generator."""

    def __init__(self, tables: DirichletTables, spec: DraftSpec, verify: Callable[[Batch, torch.Generator], Any]):
        self.tables, self.spec, self.verify = tables, spec, verify
        self._batches: dict[tuple, Batch] = {}

    def batch(self, ctx: tuple[int, ...], drafts: NumpyDraws) -> Batch:
        d = draft_tree(self.spec, self.tables, ctx, drafts)
        key = (d.tokens, d.parents, d.contexts)
        if key not in self._batches:
            t = self.tables
            target = torch.stack([t.p_tensor(c) for c in d.contexts])  # [N, V]
            rows = list(target.unbind(0))
            raw = {
                id(r): t.raw_tensor(c) if t.sampling is not None else r for r, c in zip(rows, d.contexts, strict=True)
            }
            self._batches[key] = Batch(
                Tree.from_parents(d.tokens, d.parents),
                torch.tensor(d.tokens),
                torch.tensor(d.parents),
                target,
                torch.stack([t.q_tensor(c) for c in d.contexts]),
                rows,
                raw,
            )
        return self._batches[key]

    def run(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return first token [n], second token [n], accepted count of the first step [n]."""
        gen = torch.Generator().manual_seed(seed)
        drafts = NumpyDraws(seed)
        out = np.zeros((n, 3), dtype=np.int64)
        for i in range(n):
            ctx: tuple[int, ...] = ()
            first_accepted = -1
            while len(ctx) < 2:
                b = self.batch(ctx, drafts)
                accepted, nxt = self.verify(b, gen)
                if first_accepted < 0:
                    first_accepted = len(accepted)
                ctx += tuple(int(b.tokens[a]) for a in accepted) + (nxt,)
            out[i] = (ctx[0], ctx[1], first_accepted)
        return out[:, 0], out[:, 1], out[:, 2]


def api(mode: str) -> Callable[[Batch, torch.Generator], Any]:
    """The public verify_tree."""
    return lambda b, g: verify_tree(b.tokens, b.parents, b.target, b.draft, mode=mode, generator=g)


def core(
    mode: str,
    ops: Callable[[Batch], Any] = lambda b: TorchRowOps(),
    rng: Callable[[torch.Generator], Any] = TorchRandomness,
    verify: Callable[..., Any] = walk_tree,
) -> Callable[[Batch, torch.Generator], Any]:
    """The torch-backed core with one piece swapped (negative controls)."""
    return lambda b, g: verify(
        b.tree, mode=mode, target_row=b.target_rows.__getitem__, draft_row=b.draft.__getitem__, ops=ops(b), rng=rng(g)
    )


class ReusedCoinsTorch:
    """(d) the k-th coin tried at each depth level of a step is the same uniform."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.uniforms: list[float] = []
        self.rank = 0

    def accept(self, prob: float) -> bool:
        while len(self.uniforms) <= self.rank:
            self.uniforms.append(float(torch.rand((), dtype=torch.float64, generator=self.generator)))
        accepted = prob > 0 and self.uniforms[self.rank] < prob
        self.rank = 0 if accepted else self.rank + 1
        return accepted

    def draw(self, row: torch.Tensor) -> int:
        return sample(row, self.generator)


def unfiltered_residual(b: Batch) -> Any:
    return UnfilteredResidualOps(raw_of=lambda row: b.raw_by_id.get(id(row), row), base=TorchRowOps())


# ------------------------------------------------------------------------------------------------
# statistics


def chisq_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, bins merged (smallest first) until every expected count is >= 5."""
    probs = np.asarray(probs, dtype=np.float64)
    observed = np.asarray(observed, dtype=np.float64)
    if observed[probs <= 0].sum() > 0:
        return 0.0  # an outcome of probability 0 was produced
    live = probs > 0
    expected = probs[live] / probs[live].sum() * observed.sum()
    obs = observed[live]
    bins_e: list[float] = []
    bins_o: list[float] = []
    acc_e = acc_o = 0.0
    for i in np.argsort(expected, kind="stable"):
        acc_e += expected[i]
        acc_o += obs[i]
        if acc_e >= 5:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e > 0:
        if not bins_e:
            return 1.0
        bins_e[-1] += acc_e
        bins_o[-1] += acc_o
    if len(bins_e) < 2:
        return 1.0
    return float(scipy.stats.chisquare(bins_o, bins_e).pvalue)


def pvalues(
    tables: DirichletTables, first: np.ndarray, second: np.ndarray, n_acc: np.ndarray, length_law: dict
) -> dict[str, float]:
    v = tables.vocab
    p0 = np.array(tables.p(()))
    joint = np.array([[p0[a] * tables.p((a,))[b] for b in range(v)] for a in range(v)]).ravel()
    depth = max(max(length_law), int(n_acc.max())) + 1
    lengths = np.array([length_law.get(k, 0.0) for k in range(depth)])
    return {
        "first": chisq_pvalue(np.bincount(first, minlength=v), p0),
        "joint": chisq_pvalue(np.bincount(first * v + second, minlength=v * v), joint),
        "accepted": chisq_pvalue(np.bincount(n_acc, minlength=depth), lengths),
    }


# ------------------------------------------------------------------------------------------------
# configurations

DEEP_WIDE = (-1, 0, 0, 1, 1, 3)
SMALL = (-1, 0, 0, 1)
CHAIN = (-1, 0, 1, 2)
WIDE = (-1, 0, 0, 0)
WIDE_DEEP = (-1, 0, 0, 0, 1)
FILTER = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)

PEAKED = dict(alpha_p=0.3, alpha_q=0.3)
FLAT = dict(alpha_p=3.0, alpha_q=3.0)

# (name, mode, tables, spec)
CONFIGS = [
    ("det-topk-peaked", "deterministic", DirichletTables(12, 101, **PEAKED), DraftSpec("topk", DEEP_WIDE)),
    (  # the runtime's best-first (DDTree) builder on per-depth draft laws
        "det-best-first-peaked",
        "deterministic",
        DirichletTables(10, 113, **PEAKED, q_mix=0.5),
        DraftSpec("best_first", DEEP_WIDE),
    ),
    (
        "det-topk-flat-filtered",
        "deterministic",
        DirichletTables(16, 102, **FLAT, sampling=FILTER, q_mix=0.5),
        DraftSpec("topk", DEEP_WIDE),
    ),
    ("iid-tree-peaked", "iid", DirichletTables(10, 103, **PEAKED), DraftSpec("iid", SMALL)),
    ("iid-chain-flat", "iid", DirichletTables(8, 104, **FLAT), DraftSpec("iid", CHAIN)),
    ("wor-wide-peaked", "without_replacement", DirichletTables(12, 105, **PEAKED, q_mix=0.5), DraftSpec("wor", WIDE)),
    (
        "wor-tree-flat-filtered",
        "without_replacement",
        DirichletTables(8, 106, **FLAT, sampling=FILTER),
        DraftSpec("wor", SMALL),
    ),
    ("block-chain-flat", "block", DirichletTables(8, 107, **FLAT, q_mix=0.3), DraftSpec("iid", CHAIN)),
    ("traversal-tree-peaked", "traversal", DirichletTables(6, 112, **PEAKED, q_mix=0.2), DraftSpec("wor", WIDE_DEEP)),
    (
        "traversal-iid-flat-filtered",
        "traversal_iid",
        DirichletTables(8, 109, **FLAT, sampling=FILTER, q_mix=0.3),
        DraftSpec("iid", SMALL),
    ),
]
ALPHA = 1e-6 / (len(CONFIGS) * STATS_PER_CONFIG)  # Bonferroni: family-wise false alarm <= 1e-6


def _length_law(tables: DirichletTables, spec: DraftSpec, mode: str) -> dict[int, float]:
    return LoopLaw(tables, spec, mode).accepted_counts(())


@pytest.mark.slow
@pytest.mark.parametrize("name,mode,tables,spec", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_verify_tree_samples_match_exact_laws(name: str, mode: str, tables: DirichletTables, spec: DraftSpec) -> None:
    first, second, n_acc = Runner(tables, spec, api(mode)).run(N_RUNS, seed=7)
    p = pvalues(tables, first, second, n_acc, _length_law(tables, spec, mode))
    assert min(p.values()) >= ALPHA, p
    assert len(set(n_acc.tolist())) > 1  # both accept and reject branches were exercised


def _config(name: str) -> tuple[str, DirichletTables, DraftSpec]:
    _, mode, tables, spec = next(c for c in CONFIGS if c[0] == name)
    return mode, tables, spec


# (name, config whose exact laws are the reference, broken verifier)
BROKEN = [
    ("a-q-ratio-with-topk", "det-topk-peaked", api("iid")),
    ("b-no-zeroing-det", "det-topk-peaked", core("deterministic", ops=lambda b: NoResidualOps(TorchRowOps()))),
    ("b-no-residual-iid", "iid-tree-peaked", core("iid", ops=lambda b: NoResidualOps(TorchRowOps()))),
    ("c-per-path", "det-topk-peaked", core("deterministic", verify=per_path_verify)),
    ("c-per-path-best-first", "det-best-first-peaked", core("deterministic", verify=per_path_verify)),
    ("d-reused-coin", "iid-chain-flat", core("iid", rng=ReusedCoinsTorch)),
    ("e-unfiltered-residual", "det-topk-flat-filtered", core("deterministic", ops=unfiltered_residual)),
    ("f-sample-and-match", "iid-tree-peaked", api("deterministic")),
    ("b-no-residual-traversal", "traversal-tree-peaked", core("traversal", ops=lambda b: NoResidualOps(TorchRowOps()))),
    ("f-frozen-weight-block", "block-chain-flat", core("block", ops=lambda b: FrozenWeightOps(TorchRowOps()))),
    ("h-iid-rule-on-wor-tree", "traversal-tree-peaked", api("traversal_iid")),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,config,verify", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_variant_is_rejected(name: str, config: str, verify: Callable) -> None:
    mode, tables, spec = _config(config)
    first, second, n_acc = Runner(tables, spec, verify).run(N_RUNS, seed=11)
    p = pvalues(tables, first, second, n_acc, _length_law(tables, spec, mode))
    assert min(p.values()) < ALPHA, p


def test_chisq_pvalue_merges_small_bins_and_flags_impossible_outcomes() -> None:
    probs = np.array([0.5, 0.3, 0.1999, 0.0001, 0.0])
    assert chisq_pvalue(np.array([500, 300, 200, 0, 0]), probs) > 0.5
    assert chisq_pvalue(np.array([500, 300, 199, 0, 1]), probs) == 0.0
    assert chisq_pvalue(np.array([600, 250, 150, 0, 0]), probs) < 1e-6
