"""Rank correlation between scorers' importances on the same trace (`thoughtkv analyze correlation RUN`).

Where the importances come from: `thoughtkv trace --also-score A,B` computes scorers A and B alongside the
policy (they do not place anything) and records each one's final score per token (mean over layers) in
`tokens.importance_by_scorer`; `attention` is always available too: `tokens.importance`, the attention a
token received summed over decode steps (under the full policy: the full cache's, i.e. the oracle's). All of
them are computed on the same decode, so they describe the same tokens.

Statistic: for each pair, the Spearman rank correlation over a sample's cached positions (all but the last
token, which is never fed back and so never scored), one value per sample; reported as the mean over samples
with a 95% percentile-bootstrap interval over samples (resampling samples, not tokens: tokens of one sample are
not independent). Pure functions of DataFrames, plus one forest-plot figure; no torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.stats import spearman
from analysis.style import new_figure, series_style, styled
from thoughtkv_base import UserError

ATTENTION = "attention"  # tokens.importance
N_BOOTSTRAP = 10_000


class NoScorerImportances(UserError):
    pass


def scorer_importances(tokens: pd.DataFrame) -> pd.DataFrame:
    """One row per (sample_id, position) that was cached, one column per scorer (incl. `attention`)."""
    tokens = tokens.sort_values(["sample_id", "position"])
    last = tokens.groupby("sample_id")["position"].transform("max")
    tokens = tokens[tokens["position"] < last]
    frame = tokens[["sample_id", "position"]].copy()
    frame[ATTENTION] = tokens["importance"].to_numpy(dtype=np.float64)
    column = tokens["importance_by_scorer"] if "importance_by_scorer" in tokens else pd.Series(dtype=object)
    records = [dict(entry) if entry is not None else {} for entry in column]
    if records:
        extra = pd.DataFrame.from_records(records, index=tokens.index).astype(np.float64)
        for name in extra.columns:
            frame[name] = extra[name]
    return frame.reset_index(drop=True)


def per_sample_spearman(importances: pd.DataFrame, scorer_a: str, scorer_b: str) -> pd.Series:
    """Spearman of two scorers over each sample's positions (ties: average ranks); nan where undefined."""
    return importances.groupby("sample_id").apply(
        lambda group: spearman(group[scorer_a].to_numpy(), group[scorer_b].to_numpy()), include_groups=False
    )


def bootstrap_mean_ci(values: np.ndarray, n_resamples: int = N_BOOTSTRAP, seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval of the mean (nan interval below 2 values)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(values.mean())
    if values.size < 2:
        return mean, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(n_resamples, values.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return mean, float(low), float(high)


@dataclass
class PairCorrelation:
    scorer_a: str
    scorer_b: str
    n_samples: int
    mean_spearman: float
    ci_low: float
    ci_high: float
    median_spearman: float


def correlation_table(importances: pd.DataFrame, scorers: list[str], seed: int = 0) -> pd.DataFrame:
    """Every pair of `scorers`: mean per-sample Spearman with its 95% bootstrap interval over samples."""
    rows = []
    for scorer_a, scorer_b in itertools.combinations(scorers, 2):
        per_sample = per_sample_spearman(importances, scorer_a, scorer_b).dropna()
        mean, low, high = bootstrap_mean_ci(per_sample.to_numpy(), seed=seed)
        median = float(per_sample.median()) if len(per_sample) else math.nan
        rows.append(PairCorrelation(scorer_a, scorer_b, len(per_sample), mean, low, high, median))
    return pd.DataFrame([vars(row) for row in rows])


def available_scorers(importances: pd.DataFrame) -> list[str]:
    return [c for c in importances.columns if c not in ("sample_id", "position")]


def choose_scorers(importances: pd.DataFrame, requested: list[str] | None, run_name: str) -> list[str]:
    available = available_scorers(importances)
    if requested is None:
        if len(available) < 2:
            raise NoScorerImportances(
                f"{run_name}: only `attention` is recorded; trace it with --also-score A,B (e.g. h2o,gradient) "
                "to compare scorers"
            )
        return available
    unknown = [name for name in requested if name not in available]
    if unknown:
        raise NoScorerImportances(
            f"{run_name}: no importances for {', '.join(unknown)}; recorded: {', '.join(available)} "
            "(trace with --also-score to add scorers)"
        )
    if len(requested) < 2:
        raise NoScorerImportances("--scorers needs at least two names, e.g. --scorers attention,gradient")
    return requested


@styled
def correlation_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """Forest plot: one row per scorer pair, mean Spearman with its 95% interval over samples."""
    figure = new_figure((3.5, 0.45 + 0.28 * max(len(table), 1)))
    axis = figure.add_subplot()
    style = series_style(0)
    labels = [f"{a} vs {b}" for a, b in zip(table["scorer_a"], table["scorer_b"], strict=True)]
    rows = np.arange(len(table))[::-1]
    means = table["mean_spearman"].to_numpy()
    errors = np.vstack([means - table["ci_low"].to_numpy(), table["ci_high"].to_numpy() - means])
    axis.errorbar(means, rows, xerr=np.nan_to_num(errors), fmt=style["marker"], color=style["color"], capsize=2)
    axis.axvline(0.0, color="0.5", linewidth=0.6)
    axis.set_yticks(rows, labels)
    axis.set_xlim(-1.05, 1.05)
    n = table["n_samples"]
    n_text = f"n={int(n.min())}" if len(n) and n.min() == n.max() else f"n={int(n.min())}-{int(n.max())}" if len(n) else "n=0"
    axis.set_xlabel(f"Spearman rank correlation (mean over samples, 95% CI; {n_text})")
    if title:
        axis.set_title(title)
    return figure
