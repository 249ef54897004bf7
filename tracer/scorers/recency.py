"""Recency (StreamingLLM with sinks + window): the later the position, the more important."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.scorers.base import Scorer, _extended


@dataclass
class RecencyScorer(Scorer):
    """Recency (StreamingLLM with sinks + window): the later the position, the more important."""

    name: str = "recency"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores.scatter_(1, obs.positions, obs.positions.to(torch.float32))
        return scores
