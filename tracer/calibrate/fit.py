"""Fit `time = fixed + slope * x` to microbenchmark timings (numpy only, no torch).

Every calibrated term of the simulator's cost model has this shape: a copy of B bytes takes
`overhead_s + B / bytes_per_s`, a decode step of L layers takes `step_overhead_s + L * layer_overhead_s`,
attention over n KV bytes takes `launch_s + n / bytes_per_s`. Timings span five orders of magnitude (4 KB to
256 MB copies), so the fit minimises *relative* error (each row divided by its time): an ordinary least-squares
fit would let the largest copies decide everything and leave the small-copy overhead meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearFit:
    fixed: float  # intercept, e.g. seconds of overhead per copy (>= 0)
    slope: float  # e.g. seconds per byte (>= 0)
    max_rel_residual: float  # max |fit - measured| / measured over the points
    median_rel_residual: float
    n_points: int

    def predict(self, x: np.ndarray | float) -> np.ndarray | float:
        return self.fixed + self.slope * np.asarray(x, dtype=np.float64)

    @property
    def rate(self) -> float:
        """1 / slope, e.g. bytes per second; inf when the slope is zero."""
        return float("inf") if self.slope <= 0 else 1.0 / self.slope


def fit_fixed_plus_linear(x: np.ndarray, time_s: np.ndarray) -> LinearFit:
    """Non-negative relative-error least squares of `time_s ≈ fixed + slope * x`.

    Both coefficients are physical (an overhead, a time per unit), so they are constrained to be >= 0: when the
    unconstrained optimum has a negative coefficient, that coefficient is 0 and the other is refitted alone
    (the exact solution of this two-variable non-negative least-squares problem).
    """
    x = np.asarray(x, dtype=np.float64)
    t = np.asarray(time_s, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError("need two 1-D arrays of equal length >= 2")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be > 0 and x >= 0")
    weight = 1.0 / t  # relative error: every row is scaled to ~1
    design = np.stack([np.ones_like(x), x], axis=1) * weight[:, None]
    target = t * weight
    (fixed, slope), *_ = np.linalg.lstsq(design, target, rcond=None)
    if fixed < 0 or slope < 0:
        candidates = []
        for column in (0, 1):  # keep one coefficient, the other is clamped to 0
            a = design[:, column]
            coef = max(float(a @ target / (a @ a)), 0.0)
            residual = float(np.sum((a * coef - target) ** 2))
            candidates.append((residual, column, coef))
        _, column, coef = min(candidates)
        fixed, slope = (coef, 0.0) if column == 0 else (0.0, coef)
    rel = np.abs(fixed + slope * x - t) / t
    return LinearFit(float(fixed), float(slope), float(rel.max()), float(np.median(rel)), len(x))
