"""H2O: cumulative attention received, summed over every query seen so far (prefill: all prompt queries)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.scorers.base import Scorer, _extended


@dataclass
class H2OScorer(Scorer):
    """H2O: cumulative attention received, summed over every query seen so far (prefill: all prompt queries)."""

    name: str = "h2o"
    adds_weights_only = True

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        weights = obs.weights_mean
        received = weights[:, 0] if weights.shape[1] == 1 else weights.sum(1)  # a decode step's one query: as is
        return scores.scatter_add_(1, obs.positions, received)
