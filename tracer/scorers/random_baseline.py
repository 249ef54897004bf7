"""Uniform random score per position, seeded; identical across layers (a position's score is a function"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tracer.scorers.base import Scorer
from tracer.transfer import host_to_device


@dataclass
class RandomScorer(Scorer):
    """Uniform random score per position, seeded; identical across layers (a position's score is a function
    of (seed, position) only, drawn in chunks of 4096)."""

    name: str = "random"
    seed: int = 0
    _table: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)
    _on_device: torch.Tensor | None = field(default=None, repr=False)  # the table where the scores are made

    def _chunked_table(self, length: int) -> torch.Tensor:
        chunk = 4096
        while self._table.shape[0] < length:
            index = self._table.shape[0] // chunk
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            self._table = torch.cat([self._table, torch.rand(chunk, generator=generator)])
        return self._table

    def score(self, obs, previous):
        table = self._on_device
        if table is None or table.shape[0] < obs.logical_len or table.device != previous.device:
            # copied once per 4096 positions, not per step (on CUDA a blocking copy would wait for the device)
            table = self._on_device = host_to_device(self._chunked_table(obs.logical_len), previous.device)
        return table[: obs.logical_len].expand(previous.shape[0], -1).clone()
