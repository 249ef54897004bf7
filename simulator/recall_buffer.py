"""A recall buffer of any size, replayed from a trace's recorded recalls without decoding again.

The buffer (`traces.recall_buffer`: a per-(sequence, layer) LRU of recalled blocks kept in HBM) changes what
crosses the link, not what attention reads: the blocks a step attends are the recall rule's, whatever the buffer
holds. So a trace's `recalled_block_ids` fix every step's recall, and a buffer of N blocks turns them into hits
(no copy) and misses (copied: `bytes_h2d`), with the blocks it holds (at most N; or the step's recall, when
larger) in HBM. `replay_buffer` does that for one sample with the one LRU the tracer runs; for the size the run was
traced with, its misses and bytes are the tracer's own (tests/test_recall_design.py holds them equal).
`with_recall_buffer` turns a sample's step arrays into those of that buffer: what `simulate`, `serve-sim` and
`capacity` replay with `--recall-buffer-blocks N` (simulator.options.SimOptions), so that a hit costs no copy and
the buffer's HBM counts against capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from simulator.workload import StepArrays
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
    layer_of = frame["layer"].to_numpy()
    layers = np.unique(layer_of)
    n_steps = int(frame["step"].max()) + 1
    shape = (n_steps, len(layers))
    recalled, hits, held = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    all_ids = [[] if v is None else list(v) for v in frame["recalled_block_ids"]]
    step_of = frame["step"].to_numpy()
    bounds = np.searchsorted(layer_of, layers, side="left").tolist() + [len(frame)]  # (sorted by layer)
    for j in range(len(layers)):
        rows = slice(bounds[j], bounds[j + 1])
        ids, step = all_ids[rows], step_of[rows]
        recalled[step, j] = [len(v) for v in ids]
        hits[step, j], held[step, j] = replay(ids, capacity)
    misses = recalled - hits
    return BufferReplay(capacity, recalled, hits, misses, misses * block_bytes,
                        hbm_blocks(held, recalled) * block_hbm_bytes)

def block_copy_bytes(frame, arrays: StepArrays, default_bytes: float) -> float:
    """Bytes one miss copies (a DDR block as stored) in one sample's steps: its copied bytes over its copied blocks
    (the misses where the trace had a buffer, `recall_misses`, else every recalled block); `default_bytes` where
    the sample copied nothing."""
    recalled = float(arrays.recalled_blocks.sum())
    misses = frame["recall_misses"] if "recall_misses" in frame else None
    copied = float(misses.fillna(0).sum()) if misses is not None and misses.notna().any() else recalled
    n_bytes = float(arrays.bytes_h2d.sum())
    return n_bytes / copied if copied > 0 and n_bytes > 0 else float(default_bytes)


def with_recall_buffer(arrays: StepArrays, frame, capacity: int, block_size: int,
                       kv_bytes_per_token_layer: float) -> StepArrays:
    """One sample's step arrays ([steps, layers], `simulator.workload.step_arrays`) with the recorded recalls
    replayed through a buffer of `capacity` blocks (`replay_buffer`; 0: none, every recalled block copied):
    `bytes_h2d` the misses' bytes, `hbm_kv_bytes` the resident and recalled tokens plus what the buffer holds
    beyond the step's recall (the trace's own buffer, if it had one, replaced). What attention reads, the
    tokens and the recalled blocks, is the trace's. `frame`: the sample's steps rows (recalled_block_ids, and
    recall_misses where the trace had a buffer)."""
    block_hbm_bytes = block_size * kv_bytes_per_token_layer
    played = replay_buffer(frame, capacity, block_copy_bytes(frame, arrays, block_hbm_bytes), block_hbm_bytes)
    if played.recalled_blocks.shape != arrays.recalled_blocks.shape or \
            (played.recalled_blocks != arrays.recalled_blocks).any():
        raise ValueError("the recalled ids and the step arrays are of different steps")
    held_beyond = played.recall_hbm_bytes - played.recalled_blocks * block_hbm_bytes
    return replace(arrays, bytes_h2d=played.bytes_h2d.astype(np.float64),
                   hbm_kv_bytes=arrays.attended_tokens * kv_bytes_per_token_layer + held_beyond)
