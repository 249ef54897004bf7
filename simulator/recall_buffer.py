"""A recall buffer of any size, replayed from a trace's recorded recalls without decoding again.

The buffer (`traces.recall_buffer`: a per-(sequence, layer) LRU of recalled blocks kept in HBM) changes what
crosses the link, not what attention reads: the blocks a step attends are the recall rule's, whatever the buffer
holds. So a trace's `recalled_block_ids` fix every step's recall, and a buffer of N blocks turns them into hits
(no copy) and misses (copied: `bytes_h2d`), with the blocks it holds (at most N; or the step's recall, when
larger) in HBM. `replay_buffer` does that for one sample with the one LRU the tracer runs; for the size the run was
traced with, its misses and bytes are the tracer's own (tests/test_recall_design.py holds them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.recall_buffer import hbm_blocks, replay


@dataclass
class BufferReplay:
    """[steps, layers] arrays of one sample under a buffer of `capacity` blocks."""

    capacity: int
    recalled_blocks: np.ndarray  # blocks the rule recalled (attended from HBM)
    hits: np.ndarray  # of which the buffer held (no copy)
    misses: np.ndarray  # of which copied host -> device
    bytes_h2d: np.ndarray  # the misses' bytes (DDR blocks as stored)
    recall_hbm_bytes: np.ndarray  # HBM the recall holds: max(blocks the buffer holds, recalled) blocks


def replay_buffer(steps, capacity: int, block_bytes: int, block_hbm_bytes: int) -> BufferReplay:
    """`steps`: one sample's steps table (columns step, layer, recalled_block_ids); `block_bytes`: one
    DDR block as stored (what a miss copies); `block_hbm_bytes`: one block in HBM (what the buffer holds)."""
    frame = steps.sort_values(["layer", "step"])
    layers = sorted(frame["layer"].unique())
    n_steps = int(frame["step"].max()) + 1
    shape = (n_steps, len(layers))
    recalled, hits, held = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    for j, layer in enumerate(layers):
        rows = frame[frame["layer"] == layer]
        step = rows["step"].to_numpy()
        ids = [list(v) for v in rows["recalled_block_ids"]]
        recalled[step, j] = [len(v) for v in ids]
        hits[step, j], held[step, j] = replay(ids, capacity)
    misses = recalled - hits
    taken = np.array([[hbm_blocks(h, r) for h, r in zip(a, b, strict=True)] for a, b in zip(held, recalled, strict=True)])
    return BufferReplay(capacity, recalled, hits, misses, misses * block_bytes, taken.reshape(shape) * block_hbm_bytes)
