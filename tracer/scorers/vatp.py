"""Value-aware token pruning: cumulative attention (mean over heads) x ||v||_1 (mean over KV heads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.scorers.base import BadScorerOption, Observation, Scorer, _grown


@dataclass
class VATPScorer(Scorer):
    """Value-aware token pruning: cumulative attention (mean over heads) x ||v||_1 (mean over KV heads)."""

    name: str = "vatp"

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        values = getattr(obs, "values", None)
        if values is None:
            raise BadScorerOption("the vatp scorer needs the attended values in the observation (tracer.cache passes them)")
        scores = _grown(previous, obs.logical_len)
        value_norms = values.float().abs().sum(-1).mean(1)  # [rows, n]: ||v||_1 per entry, mean over KV heads
        return scores.scatter_add_(1, obs.positions, obs.weights_mean.sum(1) * value_norms)
