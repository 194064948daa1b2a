"""The runtime's one sampling operator: parameters, filter order, edge cases, seeded sampling."""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

from speculators.core.sampling import inverse_cdf, logits_to_probs, sample, sample_without_replacement
from speculators.serving import SamplingParams


def params(**kw: object) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(**kw)  # type: ignore[arg-type]


def reference_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The documented definition, literally: one full stable sort per row, top-k, then top-p, renormalise."""
    z = logits.double() / p.temperature  # [R, V]
    probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [R, V]
    out = torch.zeros_like(probs)
    for r in range(z.shape[0]):
        order = sorted(range(z.shape[1]), key=lambda t: (-float(z[r, t]), t))
        k = p.top_k if 0 < p.top_k < len(order) else len(order)
        kept = order[:k]
        if p.top_p < 1:
            ranked = probs[r, kept]  # [k] rank order
            prefix = torch.cumsum(ranked, dim=0)
            limit = p.top_p * (prefix[-1] if p.top_k > 0 else probs[r].sum())
            kept = [t for t, before in zip(kept, (prefix - ranked).tolist(), strict=True) if before < limit]
        out[r, kept] = probs[r, kept]
    return out / out.sum(dim=-1, keepdim=True)


# ------------------------------------------------------------------------------------------------
# parameters


def test_defaults_are_greedy_and_unfiltered() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop) == (128, 0.0, 0, 1.0, None, None)
    assert p.greedy
    p.validate()


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed="7"), "seed"),
        (dict(stop="END"), "stop"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_validate_names_the_bad_field_in_one_line(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} ") as err:
        SamplingParams(**kw).validate()  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_logits_to_probs_validates_params() -> None:
    with pytest.raises(ValueError, match="top_p"):
        logits_to_probs(torch.zeros(4), params(top_p=2.0))


# ------------------------------------------------------------------------------------------------
# logits -> probs


def test_temperature_zero_is_one_hot_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 5.0]])
    out = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert out.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert out.dtype == torch.float32


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.5):
        assert torch.equal(logits_to_probs(logits, params(temperature=t)), torch.softmax(logits / t, dim=-1))


def test_filters_off_leave_the_softmax_bit_identical() -> None:
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(1))
    plain = torch.softmax(logits, dim=-1)
    for kw in (dict(), dict(top_k=9), dict(top_k=100), dict(top_p=1.0), dict(top_k=9, top_p=1.0)):
        assert torch.equal(logits_to_probs(logits, params(**kw)), plain), kw


def test_top_k_keeps_k_tokens_and_breaks_ties_by_lower_id() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 0.0, 2.0]])
    out = logits_to_probs(logits, params(top_k=2))
    assert (out > 0).tolist() == [[True, True, False, False, False]]
    out = logits_to_probs(logits, params(top_k=3))
    assert (out > 0).tolist() == [[True, True, True, False, False]]
    assert float(out.sum()) == pytest.approx(1.0)
    assert torch.equal(logits_to_probs(logits, params(top_k=1)), logits_to_probs(logits, SamplingParams()))


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for top_p, kept in ((0.4, 1), (0.6, 2), (0.85, 3), (0.97, 4)):
        out = logits_to_probs(logits, params(top_p=top_p))
        assert int((out > 0).sum()) == kept, top_p
    assert int((logits_to_probs(logits, params(top_p=1e-9)) > 0).sum()) == 1  # the top token always stays


def test_top_k_then_top_p_on_the_renormalised_survivors() -> None:
    """Order matters: top-p after top-k uses the survivors' mass (4/7 >= 0.5 keeps one token);
    top-p first would keep two (0.4 < 0.5)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = logits_to_probs(logits, params(top_k=2, top_p=0.5))
    assert out.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    out = logits_to_probs(logits, params(top_k=3, top_p=0.6))  # survivors .4/.9, .3/.9: 0.444 < 0.6 -> keep 2
    assert out[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=3),
        dict(top_p=0.7),
        dict(top_k=5, top_p=0.8),
        dict(top_k=40, top_p=0.3),
        dict(top_p=0.999),
        dict(top_k=1, top_p=0.5),
        dict(temperature=0.5, top_k=7, top_p=0.9),
    ],
)
def test_fast_filter_equals_the_documented_definition(kw: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    smooth = torch.randn(6, 50, generator=gen) * 2  # [6, 50]
    tied = torch.randint(-3, 3, (6, 50), generator=gen).float()  # [6, 50] many ties at every cut
    for logits in (smooth, tied):
        p = params(**kw)
        got, want = logits_to_probs(logits, p), reference_filter(logits, p)
        assert torch.equal(got > 0, want > 0), kw
        assert torch.allclose(got, want, atol=1e-6)


def test_top_p_on_a_large_flat_vocabulary_grows_past_the_first_candidates() -> None:
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3)) * 0.1  # flat: thousands kept
    p = params(top_p=0.9)
    assert torch.equal(logits_to_probs(logits, p) > 0, reference_filter(logits, p) > 0)


def test_rows_do_not_depend_on_the_batch() -> None:
    """Verification rows [N, V] and plain-decoding rows [1, V] must be bit-identical."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 3
    for kw in (dict(), dict(top_k=20), dict(top_p=0.8), dict(top_k=50, top_p=0.9)):
        batch = logits_to_probs(logits, params(**kw))
        for i in range(5):
            assert torch.equal(batch[i : i + 1], logits_to_probs(logits[i : i + 1], params(**kw))), kw
            assert torch.equal(batch[i], logits_to_probs(logits[i], params(**kw))), kw
        assert torch.equal(logits_to_probs(logits.view(5, 1, 300), params(**kw)).view(5, 300), batch)


def test_dtypes() -> None:
    logits = torch.randn(2, 7)
    assert logits_to_probs(logits.double(), params(top_k=3)).dtype == torch.float64
    assert logits_to_probs(logits.half(), params(top_p=0.5)).dtype == torch.float32
    assert logits_to_probs(logits.bfloat16(), SamplingParams()).dtype == torch.float32
    with pytest.raises(ValueError, match="floating-point"):
        logits_to_probs(torch.ones(3, dtype=torch.long), params())


def test_masked_logits_never_survive() -> None:
    logits = torch.tensor([[2.0, -math.inf, 1.0, -math.inf]])
    for kw in (dict(), dict(top_k=3), dict(top_p=0.999)):
        out = logits_to_probs(logits, params(**kw))
        assert out[0, 1] == 0 and out[0, 3] == 0


# ------------------------------------------------------------------------------------------------
# sampling


def test_sample_is_deterministic_with_a_seeded_generator() -> None:
    probs = torch.softmax(torch.randn(30, generator=torch.Generator().manual_seed(5)), dim=-1)
    draws = [[sample(probs, torch.Generator().manual_seed(9)) for _ in range(5)] for _ in range(2)]
    assert draws[0] == draws[1]
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [sample(probs, g1) for _ in range(50)] == [sample(probs, g2) for _ in range(50)]


def test_sample_follows_the_row() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    gen = torch.Generator().manual_seed(6)
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(20_000)]), minlength=5)
    assert counts[1] == 0
    live = probs > 0
    pvalue = scipy.stats.chisquare(counts[live].double().numpy(), (probs[live] * 20_000).double().numpy()).pvalue
    assert pvalue > 1e-6


def test_inverse_cdf_guards_the_ends_of_the_unit_interval() -> None:
    probs = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.7, 0.0])
    assert inverse_cdf(probs, 0.0) == 2  # u == 0 never picks a leading zero-probability token
    assert inverse_cdf(probs, 0.29) == 2
    assert inverse_cdf(probs, 0.31) == 4
    assert inverse_cdf(probs, 1.0) == 4  # rounding to the very end falls back to the last token with mass
    assert inverse_cdf(torch.tensor([2.0, 6.0]), 0.5) == 1  # unnormalised rows are fine
    assert inverse_cdf(torch.eye(4)[3], 0.999999) == 3


def test_sample_rejects_bad_rows() -> None:
    gen = torch.Generator()
    with pytest.raises(ValueError, match="sum to 0"):
        sample(torch.zeros(4), gen)
    with pytest.raises(ValueError, match="sum to nan"):
        sample(torch.tensor([0.5, float("nan")]), gen)
    with pytest.raises(ValueError, match="1-D"):
        sample(torch.ones(2, 3) / 3, gen)


def test_sampling_a_one_hot_row_returns_its_token() -> None:
    row = logits_to_probs(torch.tensor([0.0, 9.0, 1.0]), SamplingParams())
    gen = torch.Generator().manual_seed(0)
    assert {sample(row, gen) for _ in range(100)} == {1}


def _sequential_law(probs: list[float], k: int) -> dict[tuple[int, ...], float]:
    """Exact law of k draws one after another without replacement (draw j from the row without earlier draws)."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(k):
        grown = {}
        for drawn, w in law.items():
            rest = sum(p for t, p in enumerate(probs) if t not in drawn)
            for t, p in enumerate(probs):
                if t not in drawn and p > 0:
                    grown[drawn + (t,)] = w * p / rest
        law = grown
    return law


def test_sample_without_replacement_is_a_sequential_draw() -> None:
    """The ordered k-tuples follow the sequential law exactly (chi-square over all 4*3*2 orders), zero-probability
    tokens never appear, and a row with fewer live tokens than k gives all of them."""
    probs = [0.45, 0.0, 0.3, 0.15, 0.1]
    law = _sequential_law(probs, 3)
    row = torch.tensor(probs)
    gen = torch.Generator().manual_seed(11)
    n = 20_000
    counts = dict.fromkeys(law, 0)
    for _ in range(n):
        counts[tuple(sample_without_replacement(row, 3, gen))] += 1  # KeyError: an impossible order
    keys = sorted(law)
    pvalue = scipy.stats.chisquare([counts[t] for t in keys], [law[t] * n for t in keys]).pvalue
    assert pvalue > 1e-6
    assert sorted(sample_without_replacement(row, 9, gen)) == [0, 2, 3, 4]
    assert sample_without_replacement(torch.zeros(3), 2, gen) == []
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert sample_without_replacement(row, 2, g1) == sample_without_replacement(row, 2, g2)
    with pytest.raises(ValueError, match="1-D"):
        sample_without_replacement(torch.ones(2, 2), 1, gen)
