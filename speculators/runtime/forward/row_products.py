"""How a target forward of few rows runs fastest on this machine: which formulation of each weight product, and
how many rows to run (docs/architecture.md §7).

A verify forward carries 2-16 rows (a chain or a small tree), a plain step one. On a CPU the BLAS kernel picked for
`x @ W^T` with so few rows depends on the row count, and some counts run far below what the weights' memory traffic
allows. Measured on an AMD EPYC (SmolLM2-135M, forward without the output head, ms, the cols form's result made
row-major again before the next op: left transposed, every later op of the layer, attention first, ran on a
row-innermost layout and a 2-row forward cost 74-85 ms instead of 28-39):

| rows | 1 | 2 | 3 | 4 | 8 |
|---|---:|---:|---:|---:|---:|
| 1 thread, `x @ W^T` | 49 | 83 | 95 | 70 | 81 |
| 1 thread, `(W @ x^T)^T` | 49 | 38 | 53 | 59 | 84 |
| 2 threads, `x @ W^T` | 48 | 83 | 96 | 72 | 72 |
| 2 threads, `(W @ x^T)^T` | 49 | 28 | 35 | 40 | 54 |

One row is a matrix-vector product, which the BLAS runs far below the weights' memory traffic (and on one thread):
two rows in the cols form cost less than one, so a plain step runs as two rows (the second a padding row), and the
output head on one row as two (`head_pad`, timed by the tuning too).

So `RowProducts` keeps, per row count up to `MAX_TUNED_ROWS`: the formulation ("rows" = `x @ W^T`, "cols" =
`(W @ x^T)^T`, the same dot products) and the row count to run it at (`pad_segment` appends rows that attend only
to the prefix and themselves, whose outputs are dropped: one row runs fastest as two). `tune_row_products`
measures whole forwards (every layer's weights streamed, as in a cycle) once per process, target shape, dtype and
thread count, within a time budget (a big model on a CPU tunes only the row counts it reaches in it). Both
formulations round alike to ~1e-6 (fp32); like a tree-shaped forward against a one-token one, greedy outputs can
differ only at exact near-ties (engine.py).

Not here: which head rows a forward computes (`TargetRunner.logits`), GPUs (cuBLAS picks its own kernels: nothing is tuned
there), the drafter's products, batched forwards' padding (their rows are several requests').
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

MAX_TUNED_ROWS = 16
FORMS = ("rows", "cols")  # x @ W^T | (W @ x^T)^T
# another formulation or a padded count is taken only when measured this much faster: the gains worth having are
# 25-45% (the table above), timing noise on a shared machine reaches 10%
MIN_GAIN = 0.15
TUNE_BUDGET_S = 5.0  # the most a tuning spends (SmolLM2-135M, 16 rows x 2 forms: ~4 s on 2 CPU cores)
_TUNED: dict[tuple, RowProducts] = {}  # one table per (target shape, dtype, device, threads) in a process


@dataclass
class RowProducts:
    """Per row count: the products' formulation and the row count the forward runs at; untuned = plain."""

    form: dict[int, str] = field(default_factory=dict)  # rows -> "rows" | "cols"
    pad: dict[int, int] = field(default_factory=dict)  # rows -> rows to run (>= rows)
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (form, rows) -> measured forward
    tuned: bool = False
    asked: int = 0  # the most rows it was asked to cover (it covers fewer when the time budget ran out)
    # the output head on ONE row run as two in the "cols" form (the row twice, one result kept): the BLAS
    # matrix-vector kernel of a 1-row product runs on one thread far below the weights' memory traffic (SmolLM2's
    # 49,152-row head: 11.3 ms as one row, 6.3 as two at 1 thread; 11.6 / 5.7 at 2 threads)
    head_pad: bool = False

    def head(self, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rows [R, H] @ weight [V, H]^T -> [R, V] (no bias) as the output head runs on a CPU: 2-16 rows as the
        tall-skinny W @ rows^T (~1.5x faster than rows @ W^T, same dot products), one row padded to two when
        `head_pad`, else plainly."""
        n = rows.shape[0]
        if n == 1 and self.head_pad:
            return torch.mm(weight, torch.cat([rows, rows]).t())[:, :1].t().contiguous()  # [1, V]
        if 2 <= n <= MAX_TUNED_ROWS:
            return torch.mm(weight, rows.t()).t()
        return F.linear(rows, weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for x [..., In], weight [Out, In] -> [..., Out], in this row count's form."""
        rows = x.numel() // x.shape[-1]
        if self.form.get(rows) != "cols":
            return F.linear(x, weight, bias)
        # contiguous again (a copy of rows x Out values): the transposed product left every later op of the layer on
        # a row-innermost layout, and attention over it ran 3.5x slower (SmolLM2, 2 rows, 1 thread: 276 vs 80 us)
        out = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous().reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    def padded_rows(self, rows: int, room: int) -> int:
        """The row count to run `rows` new tokens at, given `room` free cache slots."""
        target = self.pad.get(rows, rows)
        return target if target <= room else rows


def pad_segment(segment: Any, rows: int) -> Any:
    """`segment` (a target_runner.Segment of T rows) with rows appended up to `rows`: copies of its last token, one
    position past its deepest node, attending to the prefix and themselves only, with no logits. The original rows'
    masks are unchanged (nothing attends to the padding)."""
    ids = segment.input_ids  # [T]
    n, extra = int(ids.shape[0]), rows - int(ids.shape[0])
    dev = ids.device
    depths = torch.arange(n, device=dev) if segment.depths is None else segment.depths.to(dev)  # [T]
    tree = (torch.ones(n, n, dtype=torch.bool, device=dev).tril() if segment.tree_mask is None
            else segment.tree_mask.to(dev))  # [T, T]
    mask = torch.zeros(rows, rows, dtype=torch.bool, device=dev)  # [T', T']
    mask[:n, :n] = tree
    mask[n:, n:] = torch.eye(extra, dtype=torch.bool, device=dev)
    logit_rows = torch.arange(n, device=dev) if segment.logit_rows is None else segment.logit_rows
    return type(segment)(cache=segment.cache, input_ids=torch.cat([ids, ids[-1:].expand(extra)]),
                         depths=torch.cat([depths, torch.full((extra,), int(depths.max()) + 1, device=dev)]),
                         tree_mask=mask, logit_rows=logit_rows)


def trim_output(out: Any, rows: int) -> Any:
    """A ForwardOutput of a padded segment cut back to its first `rows` rows (logits cover real rows only)."""
    out.hidden = out.hidden[:rows]
    out.features = {name: value[:rows] for name, value in out.features.items()}
    return out


def _shape_key(runner: Any) -> tuple:
    cfg = getattr(runner.model, "config", None)
    return (type(runner).__name__, getattr(cfg, "model_type", None), runner.num_layers, runner.num_kv_heads,
            runner.head_dim, runner.vocab_size, getattr(cfg, "hidden_size", None),
            getattr(cfg, "intermediate_size", None), str(runner.dtype), str(runner.device), torch.get_num_threads())


def tune_row_products(runner: Any, cache: Any, token: int, max_rows: int, forms: tuple[str, ...] = FORMS,
                      budget_s: float = TUNE_BUDGET_S) -> RowProducts:
    """Measure forwards (no output head) of 1, 2, ... rows in each formulation in the scratch slots past `cache`'s
    committed ones (best of 2, after one warm-up forward), up to `max_rows` or until `budget_s` is spent (a big
    model on a CPU stops early: the counts it did not reach run plainly), then keep per row count the fastest
    formulation and the cheapest measured row count >= it. Memoised per process: an engine on a shape already tuned
    to as many rows (or as many as the budget reached) reuses the table."""
    max_rows = max(1, min(max_rows, MAX_TUNED_ROWS, cache.free))
    key = _shape_key(runner)
    known = _TUNED.get(key)
    if known is not None and (known.asked >= max_rows):
        return known
    table = RowProducts(tuned=True, asked=max_rows)
    if runner.device.type != "cpu" or max_rows < 2:
        _TUNED[key] = table
        return table
    no_head = torch.empty(0, dtype=torch.long)
    trials = {form: RowProducts(form={n: form for n in range(1, max_rows + 1)}) for form in forms}
    start = time.perf_counter()
    runner.run_segments_with(trials[forms[0]], torch.full((1,), int(token), dtype=torch.long), cache, no_head)
    reached = 0
    for n in range(1, max_rows + 1):
        ids = torch.full((n,), int(token), dtype=torch.long)
        for _ in range(2):
            for form in forms:
                t = time.perf_counter()
                runner.run_segments_with(trials[form], ids, cache, no_head)
                seconds = time.perf_counter() - t
                table.seconds[(form, n)] = min(table.seconds.get((form, n), seconds), seconds)
        reached = n
        if time.perf_counter() - start > budget_s:
            break
    best: dict[int, float] = {}
    for n in range(1, reached + 1):
        plain = table.seconds[(forms[0], n)]
        form, seconds = min(((f, table.seconds[(f, n)]) for f in forms), key=lambda fs: fs[1])
        table.form[n], best[n] = (form, seconds) if seconds < (1 - MIN_GAIN) * plain else (forms[0], plain)
    for n in range(1, reached + 1):
        run_at = min(range(n, reached + 1), key=lambda m: best[m])
        table.pad[n] = run_at if best[run_at] < (1 - MIN_GAIN) * best[n] else n
    table.head_pad = _head_pad_pays(runner)
    _TUNED[key] = table
    return table


def _head_pad_pays(runner: Any) -> bool:
    """Whether the output head on one row runs >= MIN_GAIN faster as two rows (best of 3 each, after a warm-up)."""
    head = getattr(runner, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    row = torch.zeros(1, head.weight.shape[1], dtype=head.weight.dtype, device=head.weight.device)  # [1, H]
    seconds = {False: float("inf"), True: float("inf")}
    for rep in range(4):
        for pad in (False, True):
            t = time.perf_counter()
            RowProducts(head_pad=pad).head(row, head.weight)
            if rep > 0:  # rep 0 warms up
                seconds[pad] = min(seconds[pad], time.perf_counter() - t)
    return seconds[True] < (1 - MIN_GAIN) * seconds[False]
