"""The capacity–accuracy table's bookkeeping: Wilson intervals, the cell grid and its sharding."""

from __future__ import annotations

import math

import pytest

from tracer.micro.table import BUDGETS, KEY_BUDGET, METHODS, QUANT_METHODS, cells, wilson_interval


@pytest.mark.parametrize(
    ("successes", "n", "expected"),
    [
        (0, 10, (0.0, 0.2775)),  # upper bound z^2 / (n + z^2)
        (10, 10, (0.7225, 1.0)),
        (5, 10, (0.2366, 0.7634)),
    ],
)
def test_wilson_interval_matches_closed_form_values(successes, n, expected):
    low, high = wilson_interval(successes, n)
    assert low == pytest.approx(expected[0], abs=1e-4)
    assert high == pytest.approx(expected[1], abs=1e-4)


@pytest.mark.parametrize(("successes", "n"), [(194, 200), (3, 20), (117, 200), (1, 500)])
def test_wilson_interval_is_the_root_pair_of_the_score_equation(successes, n):
    """Independent form: the bounds are the p solving (p - p_hat)^2 = z^2 p (1 - p) / n."""
    z, p_hat = 1.959964, successes / n
    a, b, c = 1 + z * z / n, -(2 * p_hat + z * z / n), p_hat * p_hat
    root = math.sqrt(b * b - 4 * a * c)
    low, high = wilson_interval(successes, n)
    assert low == pytest.approx((-b - root) / (2 * a), abs=1e-9)
    assert high == pytest.approx((-b + root) / (2 * a), abs=1e-9)


def test_cells_cover_the_grid_once_with_the_key_cells_first():
    every = cells("all")
    names = [c.name for c in every]
    assert len(names) == len(set(names)) == 1 + len(METHODS) * (len(BUDGETS) - 1) + len(QUANT_METHODS)
    key = cells("key")
    assert every[: len(key)] == key and key[0].method is None
    assert all(c.budget == KEY_BUDGET for c in key[1:])
    shards = [c for i in range(3) for c in every[i::3]]
    assert sorted(c.name for c in shards) == sorted(names)
