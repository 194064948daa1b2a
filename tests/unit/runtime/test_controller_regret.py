"""The plan controller against its own parts on counted work (tests/unit/runtime/controller_sim.py: known
per-position acceptance, SmolLM2's one-thread cycle costs in plain steps): a drafter that never pays is dropped
within a few cycles and then costs only bounded probes, a good one is kept, prompt lookup alone is chosen where it is
the best part, and the combination commits per second at least what its best part alone does, minus 3%, averaged
over seeds (each seed's requests run one after another through the engine's acceptance memory)."""

from __future__ import annotations

import statistics

import pytest

from tests.unit.runtime.controller_sim import STEP, Workload, simulate

LOOKUP_GOOD = [0.8, 0.75, 0.7, 0.65, 0.6, 0.6]
SCENARIOS = {  # name -> workload (the model's a_k, the lookup's b_k and how often it finds a continuation)
    "decoy model, good lookup": Workload(model=[0.02] * 4, lookup=LOOKUP_GOOD, lookup_share=0.5),
    "weak model, fair lookup (SmolLM2-like)": Workload(model=[0.25, 0.15, 0.1, 0.1], lookup=[0.6] * 6,
                                                       lookup_share=0.4),
    "good model, poor lookup": Workload(model=[0.85, 0.75, 0.7, 0.65], lookup=[0.3] * 6, lookup_share=0.3),
    "both moderate": Workload(model=[0.6, 0.5, 0.4, 0.3], lookup=[0.7, 0.7, 0.6, 0.6, 0.5, 0.5], lookup_share=0.5),
    "copy-heavy": Workload(model=[0.3, 0.2, 0.15, 0.1], lookup=[0.9, 0.9, 0.85, 0.85, 0.8, 0.8], lookup_share=0.8),
    "marginal model alone": Workload(model=[0.2, 0.1, 0.1, 0.1]),
}
SEEDS = range(6)


def test_a_drafter_that_never_pays_is_dropped_within_a_few_cycles_then_only_probed() -> None:
    out = simulate([Workload(model=[0.0] * 4)] * 5, "model", cycles_per_request=150)
    first = [source for source, _ in out.trace[:150]]
    assert first.index("plain") <= 7, first[:12]  # no history: dropped after at most 7 cycles
    assert out.model_cycles_by_request[0] <= 12  # and probed with a growing interval afterwards
    assert max(out.model_cycles_by_request[1:]) <= 4  # later requests start from the memory: probes only (<= 3%)


def test_a_drafter_that_rarely_proposes_drafts_where_its_proposals_pay() -> None:
    """Prompt lookup in the model drafter's place proposes in 10% of cycles: a cycle without a proposal costs a plain
    one, so it is worth drafting iff its proposals pay. Good proposals: kept (>= 95% of cycles) and at least as fast
    as plain decoding; poor ones: dropped within the cycles a few proposals take, then only probed."""
    good = Workload(model=[0.8, 0.7, 0.6, 0.5], model_share=0.1)
    for seed in SEEDS:
        out = simulate([good] * 3, "model", cycles_per_request=150, seed=seed)
        assert out.model_cycles >= 0.95 * out.cycles and out.rate >= 1 / STEP, (seed, out.sources)
    poor = simulate([Workload(model=[0.02] * 4, model_share=0.3)] * 5, "model", cycles_per_request=150)
    assert poor.model_cycles_by_request[0] <= 45, poor.model_cycles_by_request
    assert max(poor.model_cycles_by_request[1:]) <= 6, poor.model_cycles_by_request


def test_a_stream_of_short_requests_still_probes_a_drafter_that_is_out() -> None:
    """Requests shorter than the probe interval: the cycles without the model are counted across them."""
    out = simulate([Workload(model=[0.0] * 4)] * 40, "model", cycles_per_request=10)
    later = out.model_cycles_by_request[4:]  # after the first requests dropped it
    assert 0.01 * 10 * len(later) <= sum(later) <= 0.04 * 10 * len(later), later


def test_a_good_drafter_is_kept() -> None:
    for seed in SEEDS:
        out = simulate([Workload(model=[0.8, 0.7, 0.6, 0.5])] * 3, "model", cycles_per_request=100, seed=seed)
        assert out.model_cycles >= 0.97 * out.cycles, (seed, out.sources)


def test_the_lookup_alone_is_chosen_where_it_is_the_best_part() -> None:
    lookup_share, plain_share = [], []
    for seed in SEEDS:
        out = simulate([Workload(model=[0.02] * 4, lookup=[0.9] * 6, lookup_share=0.6)] * 4, "both",
                       cycles_per_request=100, seed=seed)
        later = out.trace[100:]  # after the first request has dropped the decoy
        found = [source for source, has in later if has]
        lookup_share.append(found.count("lookup") / len(found))
        missing = [source for source, has in later if not has]
        plain_share.append(missing.count("plain") / len(missing))  # a lucky probe may bring the decoy back briefly
    assert statistics.mean(lookup_share) >= 0.95 and min(lookup_share) >= 0.9, lookup_share
    assert statistics.mean(plain_share) >= 0.95 and min(plain_share) >= 0.85, plain_share


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_combination_commits_at_least_what_its_best_part_does(name: str) -> None:
    work = SCENARIOS[name]
    ratios = []
    for seed in SEEDS:
        rates = {parts: simulate([work] * 4, parts, cycles_per_request=60, seed=seed).rate
                 for parts in ("model", "lookup", "both")}
        ratios.append(rates["both"] / max(rates["model"], rates["lookup"], 1 / STEP))
    assert statistics.mean(ratios) >= 0.97, (name, [round(r, 3) for r in ratios])
    assert min(ratios) >= 0.93, (name, [round(r, 3) for r in ratios])
