"""Accuracy with its 95% interval: every accuracy figure the project prints carries n and a Wilson CI."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Newcombe 1998, method 3).

    Unlike the normal approximation it stays inside [0, 1] and is usable at 0/n and n/n, which matters for
    the small per-policy sample counts we have. Returns (nan, nan) when n == 0.
    """
    if n < 0 or correct < 0 or correct > n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if n == 0:
        return math.nan, math.nan
    p_hat = correct / n
    z2 = z * z
    denominator = 1 + z2 / n
    center = (p_hat + z2 / (2 * n)) / denominator
    half_width = z / denominator * math.sqrt(p_hat * (1 - p_hat) / n + z2 / (4 * n * n))
    # At 0/n and n/n the bound is exactly 0 (1); the formula gets there only up to rounding.
    low = 0.0 if correct == 0 else max(0.0, center - half_width)
    high = 1.0 if correct == n else min(1.0, center + half_width)
    return low, high


def accuracy_line(correct: int, n: int) -> str:
    """'12/20 = 60.0% [38.7%, 78.1%] (95% Wilson CI, n=20)'."""
    if n == 0:
        return "no scored samples (random weights or no gold answers)"
    low, high = wilson_interval(correct, n)
    return f"{correct}/{n} = {correct / n:.1%} [{low:.1%}, {high:.1%}] (95% Wilson CI, n={n})"
