"""The speedup oracle's model (oracle/cost_model.py): the runtime's own rate formula, the request-level expectation,
candidate choice per batch size, the vLLM schedule, and reading acceptance from evaluation / export reports."""

from __future__ import annotations

import json
import random

import pytest

from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import simulated_tau
from speculators.oracle.cost_model import (
    Acceptance,
    Costs,
    cohort_mean,
    cost_model,
    expected_seconds,
    load_acceptance,
    predict,
    predicted_schedule,
)
from speculators.oracle.costs import DrafterCosts
from speculators.runtime.adaptive import AdaptiveDepth
from speculators.runtime.cycle_costs import CostModel


def _costs(fwd_base: float = 0.010, per_token: float = 0.0005, draft_step: float = 0.0004,
           batches: tuple[int, ...] = (1, 4)) -> Costs:
    """A weight-bound target: a batch of B x n tokens costs base + per_token * B * n; chains draft one node per depth
    at `draft_step` seconds each."""
    forward = {b: {n: fwd_base + per_token * b * n for n in (1, 2, 4, 8, 16)} for b in batches}
    drafter = DrafterCosts(propose={"chain": {d: (draft_step * d, float(d)) for d in range(1, 7)}},
                           absorb={1: 0.0002, 8: 0.0003})
    return Costs(forward=forward, overhead_plain={b: 0.0001 * b for b in batches},
                 overhead_spec={b: {2: 0.0002 * b, 8: 0.0004 * b} for b in batches}, drafters={"eagle3": drafter})


def test_the_oracle_uses_the_adaptive_controllers_formula() -> None:
    acc = [0.8, 0.7, 0.6, 0.5]
    cm = cost_model(_costs(), 1, _costs().drafters["eagle3"], "chain", acc)
    ctrl = AdaptiveDepth(cost=cm, max_depth=4, max_new_tokens=100)
    ctrl.acceptance = list(acc)
    for depth in range(5):
        assert cm.rate(acc, depth) == pytest.approx(ctrl.rate(depth))
    seconds = cm.draft_cost(3) + cm.cycle(4)
    assert cm.rate(acc, 3) == pytest.approx(simulated_tau(acc[:3]) / seconds)


def test_from_measurements_interpolates_every_point() -> None:
    cm = CostModel.from_measurements({1: 1.0, 2: 2.0, 3: 2.5, 16: 4.0})
    assert [cm.cycle(n) for n in (1, 2, 3)] == [1.0, 2.0, 2.5]  # not bucketed: 2 and 3 stay apart
    assert cm.cycle(9.5) == pytest.approx(3.25)
    assert cm.cycle(0.5) == 1.0 and cm.cycle(20) > 4.0


def test_cohort_mean_keeps_the_mean_tau_at_every_depth() -> None:
    cohorts = [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.7, 0.2, 0.9]]
    a = cohort_mean(cohorts)
    for k in range(1, 4):
        assert simulated_tau(a[:k]) == pytest.approx(sum(simulated_tau(c[:k]) for c in cohorts) / 3)


def _simulate(cm: CostModel, acc: list[float], depth: int, tokens: int, max_new: int, rng: random.Random) -> float:
    """One request the way the engine runs it (stopping after `tokens`, e.g. at EOS): depth capped at
    max_new - generated - 1, accept depth k with a_k."""
    seconds, done = 0.0, 0
    while done < tokens:
        d = min(depth, max_new - done - 1)
        seconds += cm.cycle(1) if d == 0 else cm.draft_cost(d) + cm.cycle(1 + cm.draft_nodes(d))
        accepted = 0
        while accepted < d and rng.random() < acc[accepted]:
            accepted += 1
        done += accepted + 1
    return seconds


@pytest.mark.parametrize("depth, tokens, max_new", [(0, 7, 7), (3, 16, 16), (5, 64, 64), (4, 5, 5), (4, 5, 6),
                                                    (5, 12, 40)])
def test_expected_seconds_matches_a_simulated_request(depth: int, tokens: int, max_new: int) -> None:
    acc = [0.9, 0.7, 0.6, 0.5, 0.4]
    cm = cost_model(_costs(), 1, _costs().drafters["eagle3"], "chain", acc)
    rng = random.Random(0)
    sim = sum(_simulate(cm, acc, depth, tokens, max_new, rng) for _ in range(4000)) / 4000
    assert expected_seconds(cm, acc, depth, tokens, max_new) == pytest.approx(sim, rel=0.02)


def test_long_requests_approach_the_steady_rate() -> None:
    acc = [0.8, 0.7, 0.6]
    cm = cost_model(_costs(), 1, _costs().drafters["eagle3"], "chain", acc)
    assert expected_seconds(cm, acc, 3, 4000) == pytest.approx(4000 / cm.rate(acc, 3), rel=0.01)
    assert expected_seconds(cm, acc, 0, 10) == pytest.approx(10 * cm.cycle(1))


def test_predict_picks_the_fastest_candidate_and_turns_speculation_off_when_it_loses() -> None:
    acc = Acceptance(source="test", chain=[0.9, 0.8, 0.7, 0.6, 0.5])
    rows = predict(_costs(), acc, "eagle3")
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        best = max(r["candidates"], key=lambda c: c["speedup"])
        assert r["best"]["speedup"] == best["speedup"] > 1.0
        assert r["plain_tokens_per_s"] == pytest.approx(r["batch"] / (0.0105 + 0.0005 * (r["batch"] - 1)
                                                                      + 0.0001 * r["batch"]), rel=1e-3)
    # batching makes verification dearer (more tokens per forward): the best depth does not grow with the batch
    assert rows[1]["best"]["depth"] <= rows[0]["best"]["depth"]
    poor = predict(_costs(draft_step=0.02), Acceptance(source="test", chain=[0.2, 0.1]), "eagle3")
    assert all(r["best"]["kind"] == "plain" and r["best"]["speedup"] == 1.0 for r in poor)
    assert predicted_schedule(poor) == [{"start_bs": 1, "end_bs": 512, "measured_at": 1, "k": 0,
                                         "tokens_per_unit_cost": 1.0}]


def test_schedule_rows_use_the_export_launch_format() -> None:
    rows = predicted_schedule(predict(_costs(per_token=0.004, batches=(1, 2, 8)), Acceptance("t", [0.9, 0.8, 0.6]),
                                      "eagle3"))
    assert rows[0]["start_bs"] == 1 and rows[-1]["end_bs"] == 512
    assert all(set(r) == {"start_bs", "end_bs", "measured_at", "k", "tokens_per_unit_cost"} for r in rows)
    assert all(a["k"] != b["k"] and a["end_bs"] + 1 == b["start_bs"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[0]["k"] >= rows[-1]["k"]


def _eval_report(family: str = "eagle3", live: bool = True) -> dict:
    cohorts = {"code": {"per_position_acceptance": [0.9, 0.8, 0.7]},
               "prose": {"per_position_acceptance": [0.5, 0.4, 0.3]}}
    report = {"format": "speculators.eval/v1", "family": family,
              "temperatures": {"0.0": {"speculator": {"cohorts": cohorts}}}}
    if live:
        report["live"] = {"0.0": {"speculator": {"code": {"per_position_acceptance": [0.95, 0.9]},
                                                 "overall": {"per_position_acceptance": [0.9, 0.85]}},
                                  "trees": {"speculator": {"kind": "dynamic", "topk": 2}}}}
    return report


def test_load_acceptance_from_reports_exports_eval_dirs_and_lists(tmp_path) -> None:
    (tmp_path / "eval" / "step-100").mkdir(parents=True)
    (tmp_path / "eval" / "step-100" / "report.json").write_text(json.dumps(_eval_report()))
    (tmp_path / "eval" / "selection.json").write_text(json.dumps({"best": "step-100"}))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "report.json").write_text(json.dumps({"evaluation": _eval_report("medusa", False)}))
    from_eval = load_acceptance(str(tmp_path / "eval"))
    assert from_eval.family == "eagle3" and from_eval.cohorts["code"] == [0.9, 0.8, 0.7]
    assert simulated_tau(from_eval.chain) == pytest.approx((simulated_tau([0.9, 0.8, 0.7])
                                                            + simulated_tau([0.5, 0.4, 0.3])) / 2)
    assert from_eval.tree == [0.9, 0.85] and from_eval.tree_settings == {"kind": "dynamic", "topk": 2}
    assert load_acceptance(str(tmp_path / "eval" / "step-100" / "report.json")).chain == from_eval.chain
    from_export = load_acceptance(str(tmp_path / "export"))
    assert from_export.family == "medusa" and from_export.tree is None
    (tmp_path / "paired").mkdir()  # a speculator dir with only pairing.json's evaluation summary
    summary = {"temperatures": {"0.0": {"per_position_acceptance": {"code": [0.9, 0.8, 0.7], "prose": [0.5, 0.4, 0.3]},
                                        "mean_tau": 2.0}}, "live": _eval_report()["live"]}
    (tmp_path / "paired" / "pairing.json").write_text(json.dumps({"draft": {"family": "mtp"}, "evaluation": summary}))
    from_pairing = load_acceptance(str(tmp_path / "paired"))
    assert from_pairing.family == "mtp" and from_pairing.chain == pytest.approx(from_eval.chain)
    assert from_pairing.tree == [0.9, 0.85]
    assert load_acceptance("0.8, 0.6").chain == [0.8, 0.6]


@pytest.mark.parametrize("source, message", [
    ("1.5,0.2", "probabilities"), ("missing-dir", "not found"), ("notjson", "not valid JSON"),
    ("notreport", "not an evaluation report"), ("unevaluated", "not evaluated"), ("hot", "no evaluation at"),
])
def test_bad_acceptance_sources_fail_with_one_line(tmp_path, source: str, message: str) -> None:
    (tmp_path / "notjson.json").write_text("{")
    (tmp_path / "notreport.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "unevaluated.json").write_text(json.dumps({"evaluation": None, "launch": {}}))
    hot = _eval_report()
    hot["temperatures"] = {"1.0": hot["temperatures"]["0.0"]}
    (tmp_path / "hot.json").write_text(json.dumps(hot))
    path = source if "," in source else str(tmp_path / (source + ("" if source == "missing-dir" else ".json")))
    with pytest.raises(SpeculatorsError, match=message):
        load_acceptance(path)


def test_a_fixed_k_family_gets_its_own_k_or_plain_in_the_vllm_schedule() -> None:
    """vLLM drafts DFlash's whole block and one token per Medusa head: their schedule may only say k = K or plain,
    where a free-k family takes the fastest chain per bucket."""
    from types import SimpleNamespace

    from speculators.models import SPECULATORS
    from speculators.oracle.profile import family_schedule

    pred = predict(_costs(per_token=0.004, batches=(1, 2, 8)), Acceptance("t", [0.9, 0.8, 0.6]), "eagle3")
    free = family_schedule(pred, SimpleNamespace(num_steps=3, VLLM_FIXED_K=SPECULATORS["eagle3"].VLLM_FIXED_K))
    assert [r["k"] for r in free] == [r["k"] for r in predicted_schedule(pred)] and {r["k"] for r in free} - {0, 3}
    for family in ("dflash", "medusa"):
        fixed = family_schedule(pred, SimpleNamespace(num_steps=3, VLLM_FIXED_K=SPECULATORS[family].VLLM_FIXED_K))
        assert {r["k"] for r in fixed} <= {0, 3} and fixed[0]["k"] == 3, (family, fixed)
