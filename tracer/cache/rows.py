"""A row's settings and host-side state: what the host knows of one sequence, and decides from.

A row is one sequence of a batch (`PagedLayer` holds every row of a decoder layer in `[rows, ...]` tensors).
`TierSettings` are its placement spec and scorer; `RowState` its counts per layer (logical length, blocks in
DDR and evicted, this step's recall), kept exact on the host so that no step reads the device to size a move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from thoughtkv_base import UserError
from tracer.recorder import Deferred
from tracer.scorers import Scorer
from traces.policy import PolicySpec, n_blocks
from traces.recall_buffer import RecallBuffer


class UnsupportedBatch(UserError):
    pass


@dataclass
class TierSettings:
    """The placement spec (every placement setting, validated by `PolicySpec`) plus what only the tracer needs."""

    spec: PolicySpec = field(default_factory=PolicySpec)
    scorer: Scorer | None = None  # None: no scoring (fine for the full policy)
    track_importance: bool = False  # accumulate per-token attention over decode steps (tokens table, oracle)


class RecalledIds(NamedTuple):
    """A row's recalled block ids of this step, as the trace records them (`tracer.recorder.LayerEntry.recalled`):
    every recalling row's ids laid end to end on the device, and this row's part of them."""

    ids: torch.Tensor  # every recalling row's ids, in staging order (device)
    recorded: Deferred | object  # the same ids in the step's copy (`Deferred`, or a layer's part of it)
    start: int  # this row's first
    count: int


@dataclass
class RowState:
    """One row's (sequence's) host-side state in a `PagedLayer`: everything the host decides from."""

    settings: TierSettings
    recorder: object = None
    logical_len: int = 0
    query_start: int = 0  # the first new position of this step
    n_ddr_blocks: int = 0  # exact (docs/design/tracer.md, "Sync-free steps")
    n_evicted_blocks: int = 0
    recalled_blocks: int = 0  # DDR blocks in this row's staging pages this step
    placed_key: tuple | None = None  # the targets the last placement met (`tracer.cache.placement.Targets`)
    step: int = 0
    defer_placement: bool = False
    deferred_query_tokens: int = 0
    recalled: RecalledIds | None = None  # this step's recalled block ids (sliced only when read)
    head_picks: torch.Tensor | None = None  # quest-per-head: [recalled, Hkv] bool
    bytes_h2d: int = 0
    recall_buffer: RecallBuffer | None = None  # `--recall-buffer-blocks`: the LRU of recalled ids (made on first use)
    buffer_hits: int = 0  # of this step's recalled blocks, those the buffer held (not copied)

    @property
    def spec(self) -> PolicySpec:
        return self.settings.spec

    @property
    def recalled_ids(self) -> torch.Tensor | None:
        """This step's recalled block ids, in staging order (device)."""
        if self.recalled is None:
            return None
        return self.recalled.ids[self.recalled.start : self.recalled.start + self.recalled.count]

    def blocks(self) -> int:
        return n_blocks(self.spec, self.logical_len)

    def clear_recall(self) -> None:
        """No DDR block recalled this step (yet)."""
        self.recalled_blocks, self.recalled, self.head_picks, self.bytes_h2d = 0, None, None, 0

    def hbm_blocks(self) -> int:
        return self.blocks() - self.n_ddr_blocks - self.n_evicted_blocks

    def step_index(self) -> int:
        """The row's decode step: its recorder's when it records, else its own count."""
        return self.recorder.step if self.recorder is not None else self.step
