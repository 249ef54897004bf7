"""H2O: cumulative attention received, summed over every query seen so far (prefill: all prompt queries)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.scorers.base import Scorer, _extended


@dataclass
class H2OScorer(Scorer):
    """H2O: cumulative attention received, summed over every query seen so far (prefill: all prompt queries)."""

    name: str = "h2o"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        return scores.scatter_add_(1, obs.positions, obs.weights_mean.sum(1))
