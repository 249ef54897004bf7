"""The recall buffer: a per-(sequence, layer) LRU of recalled block ids kept in HBM (`PolicySpec.recall_buffer_blocks`).

At each decode step a layer recalls some DDR blocks; a block still in the buffer is a hit and costs no copy, a
miss is copied host-to-device (the trace's `bytes_h2d` counts misses only) and enters the buffer, the least
recently recalled blocks leaving it once it holds more than its capacity. The buffer does not change which blocks
attention reads (the rule chooses them; the buffer only says which of them must cross the link), so any capacity
can be replayed from a trace's recorded `recalled_block_ids` without decoding again (`replay_hits`): the tracer
(tracer/cache/recall.py) and the simulator's replay both run this one class. Torch-free.

A step's recalled ids are admitted in ascending id order (the order the trace records them), every id counted as
a hit or a miss against the buffer as the step began. Its HBM: the blocks it holds after the step's recall (at
most `capacity`: a buffer grows page by page up to it, as a paged pool does), or the step's recall when that is
larger (the step's recalled blocks are all resident while it attends: `hbm_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


class RecallBuffer:
    """One (sequence, layer)'s LRU of recalled block ids, `capacity` of them at most, each in a slot of its own
    (0 .. capacity - 1: where a device buffer keeps the block, `admit_slots`)."""

    __slots__ = ("capacity", "_ids", "_unused")

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._ids: OrderedDict[int, int | None] = OrderedDict()  # id -> its slot, least recent first
        self._unused = 0  # slots below this have been handed out

    def admit(self, ids: Iterable[int]) -> int:
        """Recall `ids` (one step's): returns how many were already held (hits); all of them become the most
        recent, and the least recent leave past the capacity. (A buffer is used through `admit` or through
        `admit_slots`, not both: this one hands out no slots.)"""
        return self._admit(ids, False)[0]

    def admit_slots(self, ids: Iterable[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int | None]]]:
        """`admit`, with where the blocks are: (hits as (id, the slot it is read from), misses as (id, the slot it
        is written to, None when it does not stay past this step)). A hit that leaves in this same step (a step
        recalling more than the capacity) gives its slot to a miss: read the hits before writing the misses."""
        _, hits, misses = self._admit(ids, True)
        return hits, misses

    def _admit(self, ids: Iterable[int], slots: bool):
        held = self._ids
        hits, new = [], []
        for i in sorted(int(i) for i in ids):  # (ascending: the order the trace records them)
            if i in held:
                hits.append((i, held[i]))
                held.move_to_end(i)
            else:
                held[i] = None
                new.append(i)
        freed = []
        while len(held) > self.capacity:
            freed.append(held.popitem(last=False)[1])
        if not slots:
            return len(hits), None, None
        freed = [slot for slot in freed if slot is not None]
        misses = []
        for i in new:
            if i in held:
                if freed:
                    held[i] = freed.pop()
                else:
                    held[i], self._unused = self._unused, self._unused + 1
            misses.append((i, held.get(i)))
        return len(hits), hits, misses

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def hbm_blocks(held_blocks, recalled_blocks):
    """HBM blocks the recall takes at a step: what the buffer holds after it, or the step's recall when larger
    (without a buffer, the step's recall: its staging pages). Numbers or arrays (elementwise)."""
    return np.maximum(held_blocks, recalled_blocks)

def replay(recalled_ids: Sequence[Sequence[int]], capacity: int) -> tuple[list[int], list[int]]:
    """(hits, blocks held after the step) per step of one (sequence, layer) whose steps recalled `recalled_ids`
    (in step order), for a buffer of `capacity` blocks (0: none, every recall a miss, nothing held)."""
    if capacity <= 0:
        return [0] * len(recalled_ids), [0] * len(recalled_ids)
    buffer = RecallBuffer(capacity)
    hits, held = [], []
    for ids in recalled_ids:
        hits.append(buffer.admit(ids))
        held.append(len(buffer))
    return hits, held


def replay_hits(recalled_ids: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Hits per step (`replay`'s first list)."""
    return replay(recalled_ids, capacity)[0]
