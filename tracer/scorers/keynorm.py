"""Key-norm (Devoto et al. 2024): a low L2 norm of the key marks an important token; score = -‖k‖ (mean"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.scorers.base import Scorer, _extended


@dataclass
class KeyNormScorer(Scorer):
    """Key-norm (Devoto et al. 2024): a low L2 norm of the key marks an important token; score = -‖k‖ (mean
    over KV heads)."""

    name: str = "keynorm"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores.scatter_(1, obs.positions, -obs.keys.float().norm(dim=-1).mean(1))
        return scores
