"""`AlsoScore`: scorers computed alongside the policy's own (they do not drive placement) whose final
per-token importance goes into `tokens.importance_by_scorer`, so that `thoughtkv analyze correlation` can
rank-correlate any two scorers on the same trace."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tracer.scorers.base import Observation, Scorer
from tracer.scorers.gradient import GradientScorer


@dataclass
class AlsoScore(Scorer):
    """The policy's scorer (None: no placement scoring, e.g. the full policy) plus `extras` computed alongside.

    Each extra keeps its own per-layer scores; `importance_by_scorer(n)` returns their final scores per position,
    mean over layers, for the trace's `tokens.importance_by_scorer` column.
    """

    primary: Scorer | None = None
    extras: dict[str, Scorer] = field(default_factory=dict)
    tables: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict, repr=False)
    score_under_full: bool = True  # the cache scores even under the full policy (for the extras)
    batchable = False  # tables per sample

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.primary.name if self.primary is not None else "none"

    @property
    def needs_autograd(self) -> bool:  # type: ignore[override]
        return any(s is not None and s.needs_autograd for s in [self.primary, *self.extras.values()])

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        for name, scorer in self.extras.items():
            layers = self.tables.setdefault(name, {})
            table = scorer.score(obs, layers.get(obs.layer_idx, torch.zeros(1, 0, device=previous.device)))
            if obs.valid is not None:  # a paged cache's scratch positions (Observation)
                scratch = torch.where(obs.valid, obs.positions, -1).amax(1) + 1  # one past the row's last entry
                table.scatter_(1, scratch[:, None], 0.0)
            layers[obs.layer_idx] = table
        return self.primary.score(obs, previous) if self.primary is not None else previous

    def after_step(self, model, cache, token_ids: list[int], step: int) -> None:
        for scorer in [self.primary, *self.extras.values()]:
            if hasattr(scorer, "after_step"):
                scorer.after_step(model, cache, token_ids, step)

    def importance_by_scorer(self, n_positions: int, n_layers: int) -> list[dict[str, float]]:
        """Per position {scorer: final score, mean over layers}; positions a layer never scored count 0."""
        columns = {}
        for name, scorer in self.extras.items():
            # The gradient scorer's own tables include the last step's backward pass (no forward copied it).
            layers = scorer.tables if isinstance(scorer, GradientScorer) else self.tables.get(name, {})
            matrix = np.zeros((n_layers, n_positions), dtype=np.float32)
            for layer_idx, scores in layers.items():
                scores = scores.reshape(-1)  # one row: this sample's
                n = min(n_positions, scores.shape[0])
                matrix[layer_idx, :n] = scores[:n].float().cpu().numpy()
            columns[name] = matrix.mean(0)
        return [{name: float(values[i]) for name, values in columns.items()} for i in range(n_positions)]
