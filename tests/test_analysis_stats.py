"""analysis.stats against published values and hand-computed cases."""

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from analysis import stats


@pytest.mark.parametrize(
    ("correct", "n", "low", "high"),
    [
        # Newcombe (1998), Statistics in Medicine 17:857-872, Table I, method 3 (Wilson score, no correction).
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0000, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_matches_newcombe_1998(correct, n, low, high):
    got_low, got_high = stats.wilson_interval(correct, n)
    assert got_low == pytest.approx(low, abs=5e-5)
    assert got_high == pytest.approx(high, abs=5e-5)


def test_wilson_is_symmetric_and_handles_edges():
    low, high = stats.wilson_interval(7, 20)
    mirrored_low, mirrored_high = stats.wilson_interval(13, 20)
    assert (low, high) == pytest.approx((1 - mirrored_high, 1 - mirrored_low))
    assert stats.wilson_interval(20, 20)[1] == 1.0 and stats.wilson_interval(20, 20)[0] < 1.0
    assert all(math.isnan(v) for v in stats.wilson_interval(0, 0))
    with pytest.raises(ValueError):
        stats.wilson_interval(5, 3)


@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_the_estimate_and_stays_in_unit_interval(pair):
    correct, n = pair
    low, high = stats.wilson_interval(correct, n)
    assert 0.0 <= low <= correct / n <= high <= 1.0


def test_top_share_on_constructed_distribution():
    # 10 tokens; the top 20% are the two heaviest: (50 + 20) / 100.
    mass = np.array([1, 50, 2, 3, 20, 4, 5, 6, 4, 5], dtype=float)
    assert stats.top_share(mass, 0.2) == pytest.approx(0.70)
    assert stats.top_share(np.ones(10), 0.2) == pytest.approx(0.2)  # uniform: share = fraction
    assert stats.top_share(mass, 1.0) == pytest.approx(1.0)
    # 7 tokens at 20%: ceil(1.4) = 2 tokens.
    assert stats.top_share(np.array([4, 3, 1, 1, 1, 0, 0.0]), 0.2) == pytest.approx(0.7)
    assert math.isnan(stats.top_share(np.zeros(4)))


def test_top_share_of_a_zipf_law_matches_its_closed_form():
    n = 1000
    mass = 1.0 / np.arange(1, n + 1)
    harmonic = np.cumsum(1.0 / np.arange(1, n + 1))
    assert stats.top_share(np.random.default_rng(0).permutation(mass), 0.2) == pytest.approx(harmonic[199] / harmonic[-1])


def test_mass_cdf_hits_the_exact_shares_at_token_ranks():
    mass = np.array([1.0, 6.0, 3.0])  # sorted: 6, 3, 1 of 10
    grid = np.array([0.0, 1 / 3, 2 / 3, 1.0, 0.5])
    cdf = stats.mass_cdf(mass, grid)
    assert cdf == pytest.approx([0.0, 0.6, 0.9, 1.0, 0.75])  # 0.5 is halfway between 1/3 and 2/3


def test_pareto_frontier_on_constructed_set():
    points = pd.DataFrame(
        {
            "cost": [1.0, 2.0, 2.0, 3.0, 4.0, 5.0, 0.5, np.nan],
            "benefit": [0.5, 0.7, 0.6, 0.7, 0.9, 0.8, 0.1, 1.0],
        },
        index=list("abcdefgh"),
    )
    frontier = stats.pareto_frontier(points, "cost", "benefit")
    # c is beaten by b (same cost, more benefit), d by b (more cost, same benefit), f by e; h has no cost.
    assert sorted(frontier[frontier].index) == ["a", "b", "e", "g"]


def test_error_stats_known_values():
    measured = np.array([1.0, 2.0, 4.0, 10.0])
    simulated = np.array([1.1, 1.8, 4.0, 15.0])  # +10%, -10%, 0%, +50%
    errors = stats.error_stats(simulated, measured)
    assert errors["n"] == 4
    assert errors["median_abs_rel_err"] == pytest.approx(0.10)
    assert errors["mean_rel_err"] == pytest.approx((0.1 - 0.1 + 0 + 0.5) / 4)
    assert errors["p95_abs_rel_err"] == pytest.approx(np.percentile([0.1, 0.1, 0.0, 0.5], 95))


def test_spearman_matches_a_hand_ranked_example():
    # Ranks x: 1..5, y ranks: 2,1,4,3,5 -> d^2 = 1+1+1+1+0 = 4 -> rho = 1 - 6*4/(5*24) = 0.8
    assert stats.spearman([1, 2, 3, 4, 5], [20, 10, 40, 30, 50]) == pytest.approx(0.8)
    assert stats.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(stats.spearman([1, 2], [1, 2]))
