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
        observed = obs.weights_mean[:, -self.window :].mean(1)  # [rows, n]
        dense = torch.zeros(observed.shape[0], obs.logical_len, dtype=torch.float32, device=observed.device)
        dense.scatter_(1, obs.positions, observed)
        pooled = torch.nn.functional.max_pool1d(dense[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        scores.scatter_(1, obs.positions, pooled.gather(1, obs.positions))
        return scores
