"""TOVA: the attention of the last query only (replaces the previous score of every attended entry)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.scorers.base import Scorer, _extended


@dataclass
class TOVAScorer(Scorer):
    """TOVA: the attention of the last query only (replaces the previous score of every attended entry)."""

    name: str = "tova"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores.scatter_(1, obs.positions, obs.weights_mean[:, -1])
        return scores
