"""The speedup oracle's model: measured costs + per-position acceptance -> tokens/s and speedup per batch size.

The model is the runtime's own (`adaptive.CostModel.rate`, which the adaptive controller uses every cycle): a cycle
drafting to depth d commits E(d) = `metrics.simulated_tau(a[:d])` tokens per request in expectation and costs
  draft(d) + cycle(1 + nodes(d))  seconds,
with, for B requests sharing each target forward (`batching.BatchRunner`: every request drafts on its own, then one
forward for all of them):
  draft(d)  = B x (absorbing the last cycle's tokens + proposing to depth d)       (`costs.measure_drafter`)
  cycle(n)  = forward(B sequences x n tokens) + overhead(B, n)                    (`costs.measure_forward`)
  overhead  = one measured runtime step - its forward - its drafting               (`costs.measure_steps`)
Plain decoding is the root-only cycle: cycle(1) per token. Per batch size the oracle predicts every candidate
(chains of depth 1..K with the teacher-forced chain acceptance of `speculators evaluate`; the drafter's own tree
kind with the live tree acceptance the evaluation measured, when it did) and picks the fastest; speculation is off
(k = 0) where none beats plain decoding. `predicted_schedule` turns the chain choices into the batch-size schedule that
`speculators export` writes for vLLM (`export/launch_plan.py` rows: start_bs, end_bs, measured_at, k, ...).

`expected_seconds` is the same model over a whole request of N tokens (the depth shrinks near the end exactly as
`AdaptiveDepth.choose` shrinks it), used to check the oracle against `speculators bench`.

`load_acceptance` reads a_k from an evaluation report.json, an export directory (its report.json, else its
pairing.json's evaluation summary), a pairing.json, an eval dir (its selection.json's best) or a literal list
("0.8,0.7,0.6").

Not here: measuring (costs.py), the command and its report (profile.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import committed_distribution, per_position_from_reach, simulated_tau, temperature_key
from speculators.oracle.costs import DrafterCosts
from speculators.runtime.cycle_costs import CostModel


@dataclass
class Acceptance:
    """Per-position acceptance a_k of one speculator: a chain's (teacher-forced) and its tree's (live), if known."""

    source: str
    chain: list[float]  # the cohort mean's a_k (simulated_tau(chain[:k]) = mean over cohorts of tau(k))
    family: str | None = None
    temperature: float = 0.0
    cohorts: dict[str, list[float]] = field(default_factory=dict)  # teacher-forced chain a_k per cohort
    tree: list[float] | None = None  # live a_k of the runtime's default tree (pooled over cohorts)
    tree_cohorts: dict[str, list[float]] = field(default_factory=dict)
    tree_settings: dict | None = None  # the tree the live numbers were measured with

    def for_kind(self, kind: str) -> list[float] | None:
        return self.chain if kind == "chain" else self.tree


def cohort_mean(per_cohort: list[list[float]]) -> list[float]:
    """a_k whose simulated tau at every depth k is the mean over cohorts of the cohorts' simulated tau(k)."""
    depth = min(len(a) for a in per_cohort)
    taus = [sum(simulated_tau(a[:k]) for a in per_cohort) / len(per_cohort) for k in range(1, depth + 1)]
    return per_position_from_reach([t - prev for t, prev in zip(taus, [1.0, *taus[:-1]], strict=True)])


def _from_report(report: dict, source: str, temperature: float) -> Acceptance:
    key = temperature_key(temperature)
    temps = report.get("temperatures") or {}
    if key not in temps:
        raise SpeculatorsError(f"{source} has no evaluation at temperature {temperature} (it has "
                               f"{', '.join(sorted(temps)) or 'none'})")
    cohorts = {c: list(s["per_position_acceptance"]) for c, s in temps[key]["speculator"]["cohorts"].items()}
    if not cohorts or not all(cohorts.values()):
        raise SpeculatorsError(f"{source}: the evaluation at T={temperature} has no per-position acceptance")
    acc = Acceptance(source=source, chain=cohort_mean(list(cohorts.values())), family=report.get("family"),
                     temperature=float(temperature), cohorts=cohorts)
    live = ((report.get("live") or {}).get(key) or {})
    spec = live.get("speculator") or {}
    if spec.get("overall", {}).get("per_position_acceptance"):
        acc.tree = list(spec["overall"]["per_position_acceptance"])
        acc.tree_cohorts = {c: list(s["per_position_acceptance"]) for c, s in spec.items()
                            if c != "overall" and s.get("per_position_acceptance")}
        acc.tree_settings = (live.get("trees") or {}).get("speculator")
    return acc


def _from_pairing(record: dict) -> dict:
    """A pairing.json's evaluation summary in the evaluation report's shape (what `_from_report` reads)."""
    summary = record["evaluation"]
    temps = {t: {"speculator": {"cohorts": {c: {"per_position_acceptance": a}
                                            for c, a in (e.get("per_position_acceptance") or {}).items()}}}
             for t, e in (summary.get("temperatures") or {}).items()}
    return {"family": (record.get("draft") or {}).get("family"), "temperatures": temps, "live": summary.get("live")}


def load_acceptance(source: str, temperature: float = 0.0) -> Acceptance:
    """See the module docstring."""
    text = str(source).strip()
    if text and all(part.strip().replace(".", "", 1).isdigit() for part in text.split(",")):
        values = [float(p) for p in text.split(",")]
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise SpeculatorsError(f"acceptance values must be probabilities in [0, 1], got {text}")
        return Acceptance(source=f"given: {text}", chain=values, temperature=float(temperature))
    path = Path(text)
    if path.is_dir():
        if (path / "selection.json").is_file():
            try:
                best = json.loads((path / "selection.json").read_text())["best"]
            except (OSError, json.JSONDecodeError, KeyError) as exc:
                raise SpeculatorsError(f"{path}/selection.json is unreadable: {exc}") from None
            path = path / str(best) / "report.json"
        else:
            path = path / ("report.json" if (path / "report.json").is_file() else "pairing.json")
    if not path.is_file():
        raise SpeculatorsError(f"acceptance source {source} not found: give an evaluation report.json, an eval/ dir, "
                               f"an export dir or a list such as 0.8,0.7,0.6")
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculatorsError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(report, dict) and "evaluation" in report and "temperatures" not in report:  # export / pairing
        if not report["evaluation"]:
            raise SpeculatorsError(f"{path}: this export was not evaluated, so it has no measured acceptance; run "
                                   f"`speculators evaluate` before exporting, or pass the acceptance as a list")
        report = _from_pairing(report) if "draft" in report else report["evaluation"]
    if not isinstance(report, dict) or "temperatures" not in report:
        raise SpeculatorsError(f"{path} is not an evaluation report (no 'temperatures'); give the report.json "
                               f"that `speculators evaluate` or `speculators export` wrote")
    return _from_report(report, str(path), temperature)


# ----------------------------------------------------------------------------------------------------------------
# the model


@dataclass
class Costs:
    """Everything measured (seconds): forward[B][n], per-step overhead, and each drafter's costs."""

    forward: dict[int, dict[int, float]]
    overhead_plain: dict[int, float] = field(default_factory=dict)  # B -> seconds per step (whole batch)
    overhead_spec: dict[int, dict[int, float]] = field(default_factory=dict)  # B -> verified nodes -> seconds
    drafters: dict[str, DrafterCosts] = field(default_factory=dict)


def _nearest(table: dict[int, object], b: int) -> int:
    return min(table, key=lambda x: (abs(x - b), x))


def overhead(costs: Costs, batch: int, nodes: float) -> float:
    """Per-step overhead of `batch` requests verifying `nodes` nodes each (1 = plain), from the nearest measured
    batch size scaled per request, interpolated in `nodes` like `CostModel.cycle`."""
    if nodes <= 1 or not costs.overhead_spec:
        if not costs.overhead_plain:
            return 0.0
        b = _nearest(costs.overhead_plain, batch)
        return costs.overhead_plain[b] * batch / b
    b = _nearest(costs.overhead_spec, batch)
    return CostModel.from_measurements(costs.overhead_spec[b]).cycle(nodes) * batch / b


def _absorb(drafter: DrafterCosts, tokens: float) -> float:
    return CostModel.from_measurements(drafter.absorb).cycle(tokens) if drafter.absorb else 0.0


def cost_model(costs: Costs, batch: int, drafter: DrafterCosts | None, kind: str, acceptance: list[float]
               ) -> CostModel:
    """The runtime's CostModel for `batch` requests drafting `kind` trees (see the module docstring). Absorbing is
    priced at the expected committed tokens of the deepest candidate."""
    fwd = costs.forward[batch]
    cycle = {n: t + overhead(costs, batch, n) for n, t in fwd.items()}
    if drafter is None or kind not in drafter.propose:
        return CostModel.from_measurements(cycle)
    prop = drafter.propose[kind]
    return CostModel.from_measurements(cycle, draft={d: batch * s for d, (s, _) in prop.items()},
                                       nodes={d: n for d, (_, n) in prop.items()},
                                       absorb=batch * _absorb(drafter, simulated_tau(acceptance)))


def usable_depths(drafter: DrafterCosts, kind: str, acceptance: list[float], max_nodes: int) -> list[int]:
    """Depths with a known a_k whose tree grows with the depth (a Medusa head count caps it) and whose verified
    nodes stay inside the measured forward sizes."""
    prop = drafter.propose.get(kind, {})
    out, last = [], 0.0
    for d in sorted(prop):
        nodes = prop[d][1]
        if d > len(acceptance) or nodes <= last or 1 + nodes > max_nodes:
            break
        out.append(d)
        last = nodes
    return out


def predict(costs: Costs, acceptance: Acceptance, family: str) -> list[dict]:
    """Per measured batch size: plain tokens/s, every candidate (kind, depth) and the best one."""
    drafter = costs.drafters[family]
    rows = []
    for b in sorted(costs.forward):
        plain_cm = cost_model(costs, b, None, "chain", acceptance.chain)
        plain = plain_cm.rate(acceptance.chain, 0)
        cands = []
        for kind in drafter.propose:
            acc = acceptance.for_kind(kind)
            if not acc:
                continue
            cm = cost_model(costs, b, drafter, kind, acc)
            for d in usable_depths(drafter, kind, acc, max(costs.forward[b])):
                rate = cm.rate(acc, d)
                cands.append({"kind": kind, "depth": d, "nodes": cm.draft_nodes(d),
                              "tau": round(simulated_tau(acc[:d]), 4),
                              "step_ms": round(1000 * simulated_tau(acc[:d]) / rate, 4),
                              "tokens_per_s": round(b * rate, 2), "speedup": round(rate / plain, 4)})
        best = max(cands, key=lambda c: c["speedup"], default=None)
        if best is None or best["speedup"] <= 1.0:
            best = {"kind": "plain", "depth": 0, "nodes": 0, "tau": 1.0, "step_ms": round(1000 / plain, 4),
                    "tokens_per_s": round(b * plain, 2), "speedup": 1.0}
        rows.append({"batch": b, "plain_tokens_per_s": round(b * plain, 2), "plain_step_ms": round(1000 / plain, 4),
                     "best": best, "candidates": cands})
    return rows


def best_chain(row: dict, ks: list[int] | None = None) -> tuple[int, float]:
    """(k, speedup) of the fastest chain of one `predict` row (k = 0: plain); `ks` restricts k."""
    chains = [c for c in row["candidates"] if c["kind"] == "chain" and (ks is None or c["depth"] in ks)]
    best = max(chains, key=lambda c: c["speedup"], default=None)
    return (best["depth"], best["speedup"]) if best and best["speedup"] > 1.0 else (0, 1.0)


def predicted_schedule(predictions: list[dict], ks: list[int] | None = None, max_batch: int = 512) -> list[dict]:
    """k per max-concurrency bucket in `export/launch_plan.py`'s row format: bucket B covers concurrencies (previous B,
    B], the last one extends to `max_batch`; consecutive buckets with the same k merge."""
    rows: list[dict] = []
    lo = 1
    for i, row in enumerate(predictions):
        hi = max_batch if i == len(predictions) - 1 else row["batch"]
        k, value = best_chain(row, ks)
        rows.append({"start_bs": lo, "end_bs": hi, "measured_at": row["batch"], "k": k,
                     "tokens_per_unit_cost": round(value, 4)})
        lo = hi + 1
    return merge_buckets(rows)


def merge_buckets(rows: list[dict]) -> list[dict]:
    merged: list[dict] = []
    for r in rows:
        if merged and merged[-1]["k"] == r["k"]:
            merged[-1]["end_bs"] = r["end_bs"]
        else:
            merged.append(dict(r))
    return merged


def expected_seconds(cost: CostModel, acceptance: list[float], depth: int, tokens: int,
                     max_new_tokens: int | None = None) -> float:
    """Expected seconds of the cycles that generate `tokens` tokens drafting to `depth` (0 = plain), the depth
    capped at (max_new_tokens - generated) - 1 as `AdaptiveDepth.choose` caps it (a request that stops at EOS
    before max_new_tokens is capped by max_new_tokens, not by where it stops):
    g(r) = cost(d_r) + sum_j P_{d_r}(j) g(r - j), r = tokens still to generate."""
    slack = max(0, (max_new_tokens or tokens) - tokens)
    g = [0.0] * (tokens + 1)
    for r in range(1, tokens + 1):
        d = min(depth, r + slack - 1)
        step = cost.cycle(1) if d == 0 else cost.draft_cost(d) + cost.cycle(1 + cost.draft_nodes(d))
        probs = committed_distribution(acceptance, d)
        g[r] = step + sum(p * g[max(0, r - j)] for j, p in enumerate(probs, 1))
    return g[tokens]
