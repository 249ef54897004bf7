"""Placement after attention: the policy contract's targets met by moving blocks between HBM, DDR and nowhere.

Every target comes from the contract (traces/policy.py: `movable_range`, `room_blocks`, `evict_target_blocks`;
block granularity, the sink blocks and the recent window incl. the partial block protected) and depends on the
logical length alone (`Targets`, kept by length). A row is placed when its targets move (a block becomes
movable, the room or the eviction target grows) or a recalled block may be promoted; otherwise its last
placement still holds. Which blocks move is its policy's decision (`tracer.cache.placements`); this module
plans it on the host (`PlacementPlan`: one per step, shared by its layers where their counts agree), applies
it on the device for every placing row at once (`place`: offload to DDR, free and pack the pages, promote,
mark recall's DDR mask) and hands the moves to the trace through the step's one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tracer.cache.indexing import device_index, first_true, flat_selection_index
from tracer.cache.placements import PLACEMENTS, MovableBlocks
from tracer.cache.rows import RowState
from tracer.recorder import Deferred
from traces.policy import PolicySpec, evict_target_blocks, hbm_target_tokens, movable_range, room_blocks
from traces.schema import TIER_DDR, TIER_HBM


class Targets(NamedTuple):
    """A row's placement targets at one length (`targets`)."""

    sink_blocks: int  # the first movable block
    movable_end: int  # blocks [sink_blocks, movable_end) may leave HBM
    room: int | None  # the movable blocks HBM has room for (None: unlimited)
    evict_target: int  # the blocks evicted by now


def targets(spec: PolicySpec, length: int) -> Targets | None:
    """The policy contract's targets at this length, or None when nothing can move."""
    evict_target = evict_target_blocks(spec, length)
    if hbm_target_tokens(spec, length) is None and evict_target == 0:
        return None
    sink_blocks, movable_end = movable_range(spec, length)
    if movable_end <= sink_blocks:
        return None
    return Targets(sink_blocks, movable_end, room_blocks(spec, length), evict_target)


class TargetsByLength(dict):
    """length -> `targets(spec, length)` for one placement policy (`spec`; cleared when it changes): every row of
    every layer asks at every step."""

    spec: PolicySpec | None = None

    def of(self, spec: PolicySpec, length: int) -> Targets | None:
        found = self.get(length)
        if found is None and length not in self:
            found = self[length] = targets(spec, length)
        return found


class RowPlacement(NamedTuple):
    """One placing row's plan."""

    entry: int  # its batch entry
    sink_blocks: int
    movable_end: int
    room: int  # the movable blocks it keeps in HBM at most
    victims: int  # the blocks it evicts now


class MoveCounts(NamedTuple):
    offloaded: int
    promoted: int
    evicted_from_hbm: int
    evicted_from_ddr: int


class MovedBlocks(NamedTuple):
    """A row's moves this step, as the trace records them (`tracer.recorder.LayerEntry.moved`)."""

    codes: Deferred  # [placed rows, blocks] move codes 1-4 (`tracer.cache.placements.Moves.outcomes`)
    index: int  # this row's
    bytes_d2h: int


@dataclass
class PlacementPlan:
    """A placement's host plan (`placement_plan`)."""

    rows: list[RowPlacement]  # the rows to place
    targets: list[Targets]  # the targets each then meets
    index: torch.Tensor | None = None  # [5, m] on the device: row ids, sink blocks, movable end, room, victims
    in_range: torch.Tensor | None = None  # [m, blocks] bool on the device: each row's movable blocks
    counts: list[MoveCounts] | None = None  # where the host knows them (`Placement.counts_known`), else None
    resident: list[int] = field(default_factory=list)  # each row's resident blocks before placement
    _after: torch.Tensor | None = None

    def resident_after(self, device: torch.device) -> torch.Tensor:
        """Each row's resident blocks after placement, on the device (known counts: once per step)."""
        if self._after is None:
            self._after = device_index([n - c.offloaded - c.evicted_from_hbm
                                        for n, c in zip(self.resident, self.counts, strict=True)], device)
        return self._after


def placement_plan(layer, rows: list[int], states: list[RowState], placing: list[int]) -> PlacementPlan:
    spec, policy = layer.spec, PLACEMENTS[layer.spec.policy]
    plans, keys = [], []
    for i in placing:
        state = states[i]
        key = layer.targets.of(spec, state.logical_len)
        if key is None:
            continue
        if key == state.placed_key and not (state.recalled_blocks and spec.promote):
            continue  # the targets have not moved since the last placement met them
        n_movable = key.movable_end - key.sink_blocks
        victims = min(max(0, key.evict_target - state.n_evicted_blocks), n_movable - state.n_evicted_blocks)
        plans.append(RowPlacement(i, key.sink_blocks, key.movable_end,
                                  n_movable if key.room is None else min(key.room, n_movable), victims))
        keys.append(key)
    if not plans:
        return PlacementPlan([], [])
    index = device_index([[rows[p.entry] for p in plans], *([p[k] for p in plans] for k in range(1, 5))], layer.device)
    # [m, blocks]: each row's movable blocks, sink_blocks <= id < movable_end (made here once for the layers)
    column = np.arange(max(p.movable_end for p in plans))
    in_range = device_index((column >= np.array([p.sink_blocks for p in plans])[:, None])
                            & (column < np.array([p.movable_end for p in plans])[:, None]), layer.device)
    counts = None
    if policy.counts_known(spec):  # no victims, no promotion: min(room, candidates) stay, the rest leave
        counts = []
        for p in plans:
            state = states[p.entry]
            hbm_movable = p.movable_end - p.sink_blocks - state.n_ddr_blocks - state.n_evicted_blocks
            counts.append(MoveCounts(*policy.host_counts(hbm_movable - min(p.room, hbm_movable))))
    return PlacementPlan(plans, keys, index, in_range, counts, [states[p.entry].hbm_blocks() for p in plans])


def place(layer, rows: list[int], states: list[RowState], placing: list[int], query_tokens: int
          ) -> dict[int, MovedBlocks]:
    """Apply each row's targets (rows whose targets moved, or that may promote); returns per row id its moves
    (`MovedBlocks`: codes fetched at step end, bytes copied D2H)."""
    spec, bs = layer.spec, layer.block_size
    # (with promotion the plan reads this step's recall: which rows recalled a block, each a candidate)
    plan = layer.plan("place", query_tokens, lambda: placement_plan(layer, rows, states, placing),
                      reads_recall=spec.promote)
    if not plan.rows:
        return {}
    for p, key in zip(plan.rows, plan.targets, strict=True):
        states[p.entry].placed_key = key
    m, end = len(plan.rows), max(p.movable_end for p in plan.rows)
    place_rows, (room_t, victims_t) = plan.index[0], plan.index[3:, :, None]
    placed = [rows[p.entry] for p in plan.rows]  # (consecutive rows, e.g. a whole batch placing: views, no gathers)
    select = slice(placed[0], placed[0] + m) if placed == list(range(placed[0], placed[0] + m)) else place_rows
    recalled = None
    if spec.promote:  # the recalled blocks: candidates for HBM
        recalled = torch.zeros_like(plan.in_range)
        for index, p in enumerate(plan.rows):
            ids = states[p.entry].recalled_ids
            if ids is not None:
                recalled[index, ids] = True
    block_scores = layer.token_scores[select, : end * bs].view(m, end, bs).sum(2)
    moves = PLACEMENTS[spec.policy].decide(MovableBlocks(
        block_scores, layer.block_tier[select, :end], plan.in_range, room_t, victims_t,
        any(p.victims for p in plan.rows), recalled))
    tier = moves.tier
    counts = plan.counts
    if counts is None:  # data-dependent counts: one read-back for this layer's placement, all rows together
        zero = torch.zeros(m, dtype=torch.long, device=layer.device)
        counts = [MoveCounts(*c) for c in torch.stack(
            [zero if mask is None else mask.sum(1) for mask in moves.outcomes], dim=1).tolist()]
    if moves.offloaded is not None:
        bytes_d2h = _offload(layer, place_rows, moves.offloaded, [c.offloaded for c in counts])
    else:
        bytes_d2h = [0] * m
    layer.free_pages(place_rows, moves.was_hbm & (tier != TIER_HBM), end)
    layer.pack(place_rows, plan.resident, [n - c.offloaded - c.evicted_from_hbm for n, c in
                                           zip(plan.resident, counts, strict=True)],
               (lambda: plan.resident_after(layer.device)) if plan.counts is not None else None)
    if any(c.promoted for c in counts):
        for index, (p, c) in enumerate(zip(plan.rows, counts, strict=True)):
            if c.promoted:  # promotion can grow HBM (when it was under its room): pages for it first
                state = states[p.entry]
                kept = state.hbm_blocks() - c.offloaded - c.evicted_from_hbm
                layer.resize_pages(kept + c.promoted, layer.n_staging_pages)
                _promote(layer, rows[p.entry], state, moves.promoted[index], c.promoted, layer.n_staging_pages + kept)
    layer.block_tier[select, :end] = tier
    layer.ddr.bounds.mark(place_rows, tier == TIER_DDR)  # recall's mask, kept with the tiers
    # What happened to each movable block, recorded through the step's one deferred copy.
    codes = None
    for code, mask in enumerate(moves.outcomes, start=1):
        if mask is not None:
            term = mask.to(torch.int8) if code == 1 else code * mask.to(torch.int8)
            codes = term if codes is None else codes + term
    if codes is None:
        codes = torch.zeros((m, end), dtype=torch.int8, device=layer.device)
    host = layer.copies.add(codes, lambda a: a.astype(np.int8).reshape(m, -1))
    out = {}
    for index, (p, c) in enumerate(zip(plan.rows, counts, strict=True)):
        state = states[p.entry]
        state.n_ddr_blocks += c.offloaded - c.promoted - c.evicted_from_ddr
        state.n_evicted_blocks += c.evicted_from_hbm + c.evicted_from_ddr
        out[rows[p.entry]] = MovedBlocks(host, index, bytes_d2h[index])
    return out


def _offload(layer, place_rows: torch.Tensor, offloaded: torch.Tensor, counts: list[int]) -> list[int]:
    """Copy each row's offloaded blocks (mask [m, blocks], `counts` per row) from their pages to DDR in one
    scatter; returns the bytes per row."""
    total = sum(counts)
    if not total:
        return [0] * len(counts)
    width = max(counts)
    order = torch.argsort((~offloaded).to(torch.int8), dim=1, stable=True)[:, :width]  # ascending ids first
    select = flat_selection_index(tuple(counts), width, str(layer.device))
    flat_rows = place_rows.repeat_interleave(width)[select]
    block_ids = order.reshape(-1)[select]
    pages = layer.block_page[flat_rows, block_ids]
    # [n, 2, Hkv, bs, d]: each block's page, K and V, positions in order (the indices, apart, lead the result)
    blocks = layer.pages_view("kv")[:, flat_rows, :, pages]
    if hasattr(layer.ddr, "put_blocks"):
        n_bytes = layer.ddr.put_blocks(flat_rows, block_ids, blocks)
    else:
        n_bytes = layer.ddr.put(flat_rows, block_ids, blocks[:, 0], blocks[:, 1])
    return [n * (n_bytes // total) for n in counts]


def _promote(layer, row: int, state: RowState, promoted: torch.Tensor, n: int, first_page: int) -> None:
    """Move `n` promoted blocks of `row` from its staging pages into main pages `first_page`, ... (the pages
    after its resident blocks)."""
    block_ids = first_true(promoted, n)
    staged = (state.recalled_ids[None, :] == block_ids[:, None]).to(torch.int8).argmax(1)  # staging order
    source = layer.page_slots(layer.n_staging_pages - layer.staged_pages + staged)
    pages = torch.arange(first_page, first_page + n, device=layer.device)
    target = layer.page_slots(pages)
    layer.kv[:, row].index_copy_(2, target, layer.kv[:, row].index_select(2, source))
    layer.slot_pos[row].index_copy_(0, target, layer.slot_pos[row].index_select(0, source))
    layer.page_block[row, pages] = block_ids
    layer.block_page[row, block_ids] = pages


class QuantErrors(NamedTuple):
    """Where a row's blocks offloaded this step sit in the quantized tier's per-block errors (deferred)."""

    errors: Deferred  # [blocks, 2]: max and mean-square relative error
    first: int
    count: int


def quant_errors(layer, rows: list[int], moves: dict[int, MovedBlocks]) -> dict[int, QuantErrors]:
    """Each row's offloaded blocks' errors in the quantized tier (row id -> `QuantErrors`); {} for an exact tier."""
    pop = getattr(layer.ddr, "pop_block_errors", None)
    errors = None if pop is None else pop()
    if errors is None:
        return {}
    host = layer.copies.add(errors, lambda a: a.astype(np.float64).reshape(-1, 2))
    out, start = {}, 0
    block_bytes = layer.ddr.block_bytes()
    for row in rows:  # `_offload` stored the rows' blocks in this order
        if row not in moves or not moves[row].bytes_d2h:
            continue
        n = moves[row].bytes_d2h // block_bytes
        out[row] = QuantErrors(host, start, n)
        start += n
    return out
