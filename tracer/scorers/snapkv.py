"""SnapKV: attention of the last `window` queries (mean), max-pooled over neighbouring positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.scorers.base import Scorer, _extended


@dataclass
class SnapKVScorer(Scorer):
    """SnapKV: attention of the last `window` queries (mean), max-pooled over neighbouring positions.

    At prefill the window is the last `window` prompt queries (the paper's observation window); at decode the
    one new query. Pooling runs over logical positions (entries not attended count as 0).
    """

    name: str = "snapkv"
    window: int = 32
    kernel: int = 7

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        observed = obs.weights_mean[-self.window :].mean(0)
        dense = torch.zeros(obs.logical_len, dtype=torch.float32, device=observed.device)
        dense[obs.positions] = observed
        pooled = torch.nn.functional.max_pool1d(
            dense.view(1, 1, -1), self.kernel, stride=1, padding=self.kernel // 2
        ).view(-1)
        scores[obs.positions] = pooled[obs.positions]
        return scores
