"""R-KV: importance minus redundancy, `lam * a / max(a) - (1 - lam) * r`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.scorers.base import Scorer, _extended


@dataclass
class RKVScorer(Scorer):
    """R-KV: importance minus redundancy, `lam * a / max(a) - (1 - lam) * r`.

    `a` = attention of the last `window` queries (mean over heads), `r` = mean cosine similarity of the entry's
    key to all attended keys (mean over KV heads). The mean pairwise cosine is computed exactly in O(n) as
    k̂_i · mean_j(k̂_j) (R-KV thresholds the similarity matrix; this is the unthresholded variant).
    """

    name: str = "rkv"
    window: int = 8
    lam: float = 0.1

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        attention = obs.weights_mean[:, -self.window :].mean(1)  # [rows, n]
        attention = attention / attention.amax(1, keepdim=True).clamp_min(1e-12)
        unit_keys = torch.nn.functional.normalize(obs.keys.float(), dim=-1)  # [rows, h, n, d]
        if obs.valid is None:
            mean_key = unit_keys.mean(2, keepdim=True)
        else:  # over the entries only (a paged cache's empty slots are not keys)
            valid = obs.valid.to(unit_keys.dtype)[:, None, :, None]
            mean_key = (unit_keys * valid).sum(2, keepdim=True) / valid.sum(2, keepdim=True).clamp_min(1)
        redundancy = (unit_keys * mean_key).sum(-1).mean(1)  # [rows, n]
        scores.scatter_(1, obs.positions, self.lam * attention - (1.0 - self.lam) * redundancy)
        return scores
