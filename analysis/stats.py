"""The numbers behind the figures: pure functions of arrays and DataFrames, no drawing, no file access.

Wilson intervals for accuracies, the share of attention held by the top tokens, the cumulative mass curve,
the Pareto frontier and simulated-vs-measured error statistics.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from traces.stats import Z_95, wilson_interval  # noqa: F401  (re-exported: the figures' CIs)


def top_share(mass: np.ndarray, top_frac: float = 0.2) -> float:
    """Share of the total mass held by the ceil(top_frac * n) heaviest entries (nan for empty/zero mass)."""
    mass = np.asarray(mass, dtype=np.float64)
    total = mass.sum()
    if mass.size == 0 or total <= 0:
        return math.nan
    k = max(1, math.ceil(top_frac * mass.size - 1e-9))
    return float(np.sort(mass)[::-1][:k].sum() / total)


def mass_cdf(mass: np.ndarray, rank_grid: np.ndarray) -> np.ndarray:
    """Cumulative share of mass held by the top `rank_grid` fraction of entries, sorted heaviest first.

    The curve through (0, 0) and (i/n, share of the i heaviest) is interpolated linearly onto `rank_grid`
    (fractions in [0, 1]) so that samples of different lengths can be averaged.
    """
    mass = np.asarray(mass, dtype=np.float64)
    total = mass.sum()
    if mass.size == 0 or total <= 0:
        return np.full(len(rank_grid), np.nan)
    cumulative = np.concatenate([[0.0], np.cumsum(np.sort(mass)[::-1]) / total])
    ranks = np.arange(mass.size + 1) / mass.size
    return np.interp(rank_grid, ranks, cumulative)


def pareto_frontier(frame: pd.DataFrame, x: str, y: str) -> pd.Series:
    """Boolean mask of the points no other point beats: lower-or-equal `x` AND higher-or-equal `y`, one strictly.

    `x` is a cost (latency, bytes), `y` a benefit (accuracy). Rows with NaN in either are never on it.
    """
    on_frontier = pd.Series(False, index=frame.index)
    valid = frame[[x, y]].dropna()
    # Cheapest first; among equal cost the best first, so a sweep keeps exactly the non-dominated points.
    ordered = valid.sort_values([x, y], ascending=[True, False], kind="mergesort")
    best_y = -math.inf
    for index, row in ordered.iterrows():
        if row[y] > best_y:
            on_frontier[index] = True
            best_y = row[y]
    return on_frontier


def error_stats(simulated: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    """Relative error of simulated vs measured times: n, median and p95 of |error|, mean signed error (bias)."""
    simulated = np.asarray(simulated, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    keep = np.isfinite(simulated) & np.isfinite(measured) & (measured > 0)
    relative_error = (simulated[keep] - measured[keep]) / measured[keep]
    if relative_error.size == 0:
        return {"n": 0, "median_abs_rel_err": math.nan, "p95_abs_rel_err": math.nan, "mean_rel_err": math.nan}
    absolute = np.abs(relative_error)
    return {
        "n": int(relative_error.size),
        "median_abs_rel_err": float(np.median(absolute)),
        "p95_abs_rel_err": float(np.percentile(absolute, 95)),
        "mean_rel_err": float(relative_error.mean()),
    }


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson on average ranks, so ties are handled); nan below 3 points."""
    frame = pd.DataFrame({"x": x, "y": y}).dropna()
    if len(frame) < 3 or frame["x"].nunique() < 2 or frame["y"].nunique() < 2:
        return math.nan
    return float(np.corrcoef(frame["x"].rank(), frame["y"].rank())[0, 1])
