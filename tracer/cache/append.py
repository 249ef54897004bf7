"""Appending a forward's new K/V to a layer's pages (`PagedLayer.update`, before the layer attends).

A decode step appends one token per row: into the row's next slot, in the page of its current block; a row
whose length is a multiple of the block size first opens a block in the main page after its resident ones
(rows stay packed). A prefill appends a prompt: one row's by one copy along its slots, several fresh rows'
(left-padded to one length, `new_tokens` their real counts) by one index each, the pads not stored. What the
host derives from the rows' counts (`AppendPlan`) is made once per step and shared by its layers where their
counts agree (`PagedLayer.plan`); so is every index it builds (`opening_index`, `DecodePositions`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from tracer.cache.indexing import block_of, device_index, ragged
from tracer.cache.rows import RowState, UnsupportedBatch
from traces.policy import n_blocks


@dataclass
class AppendPlan:
    """An append's host plan (`append_plan`)."""

    lengths: list[int]  # the rows' logical lengths before the append
    end: int  # the longest length after it
    opened: list[int]  # the blocks each row opens
    pages: int | None  # the main pages the rows then need; None when no block opens
    opening: list[int]  # the batch entries that open a block
    opening_rows: list[int]  # their row ids
    opening_blocks: list[int]  # the block each opens
    opening_resident: list[int]  # the resident blocks each holds (its new block's main page)
    _opening_index: dict = field(default_factory=dict)

    def opening_index(self, first_main_page: int, device: torch.device) -> torch.Tensor:
        """[3, n] on the device: the opening rows, their new blocks and those blocks' pages (the main page after
        their resident ones); made once per step (per first main page: layers may differ in staging pages)."""
        index = self._opening_index.get(first_main_page)
        if index is None:
            index = self._opening_index[first_main_page] = device_index(
                [self.opening_rows, self.opening_blocks, [first_main_page + n for n in self.opening_resident]], device)
        return index


def append_plan(rows: list[int], states: list[RowState], counts: list[int]) -> AppendPlan:
    lengths = [s.logical_len for s in states]
    if counts[0] == 1:  # a decode step (every row one token): a row opens a block where its length is a multiple
        bs = states[0].spec.block_size
        opened = [0 if length % bs else 1 for length in lengths]
    else:
        opened = [n_blocks(s.spec, s.logical_len + n) - s.blocks() for s, n in zip(states, counts, strict=True)]
    opening = [i for i, o in enumerate(opened) if o]
    pages = max(s.hbm_blocks() + o for s, o in zip(states, opened, strict=True)) if opening else None
    return AppendPlan(lengths, max(map(operator.add, lengths, counts)), opened, pages, opening,
                      [rows[i] for i in opening], [states[i].blocks() for i in opening],
                      [states[i].hbm_blocks() for i in opening])


@dataclass
class DecodePositions:
    """The new tokens' positions of a decode append, on the device, shared by a cache's layers: they append in
    lockstep, so the first layer's tensors serve them all."""

    key: tuple | None = None  # (rows, lengths) they were made for
    positions: torch.Tensor | None = None  # [rows]: each row's new position (its length before the append)
    lengths: torch.Tensor | None = None  # [rows]: after the append (positions + 1)
    made_for: list | None = None  # the plan's lengths list (a shared plan's is the one every layer receives)

    def of(self, rows: list[int], lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.made_for is not lengths:
            key = (tuple(rows), tuple(lengths))
            if self.key != key:
                last = self.key
                if last is not None and last[0] == key[0] and tuple(n + 1 for n in last[1]) == key[1]:
                    positions = self.lengths  # the same rows one token on: the last lengths tensor
                else:
                    positions = device_index(lengths, device)
                self.key, self.positions, self.lengths = key, positions, positions + 1
            self.made_for = lengths
        return self.positions, self.lengths


def append(layer, rows: list[int], key_states: torch.Tensor, value_states: torch.Tensor,
           new_tokens: list[int] | None = None) -> None:
    """Append each row's new K/V [rows, Hkv, n, d] to `layer` (a `PagedLayer`)."""
    if not layer.initialized:
        layer.init_storage(key_states)
    n_new, bs = key_states.shape[-2], layer.block_size
    states = [layer.rows[r] for r in rows]
    layer.pads = None
    if n_new > 1 and len(rows) > 1:
        if new_tokens is None or len(new_tokens) != len(rows) or any(s.logical_len for s in states):
            raise UnsupportedBatch(
                "a multi-token forward of several rows prefills fresh rows, left-padded, with each row's "
                "token count (TieredCache.set_active(rows, new_tokens)); otherwise one row at a time")
        counts = list(new_tokens)
        if min(counts) < n_new:  # (prompts of one length: no pads, scored in one call, one query start)
            layer.pads = [n_new - n for n in counts]
    else:
        counts = [n_new] * len(rows)
    plan = layer.plan("append", n_new, lambda: append_plan(rows, states, counts))
    if plan.end >= layer.block_capacity * bs:  # (the blocks for `end` positions + the scratch one do not fit)
        layer.ensure_blocks(plan.end)
    if plan.pages is not None:  # (only an opened block grows a row's resident count; promotion sizes its own)
        layer.resize_pages(plan.pages, layer.n_staging_pages)
    rows_t, selected = layer.row_index(rows)
    if n_new == 1:
        if plan.opening:  # a new block takes the main page after the row's resident blocks (packed: `pack`)
            open_rows, new_blocks, free_page = plan.opening_index(layer.n_staging_pages, layer.device)
            layer.page_block[open_rows, free_page] = new_blocks
            layer.block_page[open_rows, new_blocks] = free_page
            layer.next_slot[open_rows] = free_page * bs
        positions, layer.lengths = layer.positions.of(rows, plan.lengths, layer.device)
        slots = layer.next_slot[selected]  # each row's next slot: in its current block's page
        if len(rows) == 1:  # one row: a copy along its slots (cheaper than an advanced-index put)
            row = rows[0]
            keys, values, slot_pos = layer.kept("row", (row, torch.is_inference_mode_enabled()),
                                                lambda: (layer.keys[row], layer.values[row], layer.slot_pos[row]))
            keys.index_copy_(1, slots, key_states[0])
            values.index_copy_(1, slots, value_states[0])
            slot_pos.index_copy_(0, slots, positions)
        else:
            layer.keys[rows_t, :, slots] = key_states[:, :, 0]
            layer.values[rows_t, :, slots] = value_states[:, :, 0]
            layer.slot_pos[rows_t, slots] = positions
        if isinstance(selected, slice):
            slots.add_(1)  # (a view of `next_slot`, read by the copies before, in stream order)
        else:
            layer.next_slot[selected] += 1
    elif len(rows) > 1:
        _append_prompts(layer, rows, rows_t, key_states, value_states, counts, plan.opened)
    else:
        _append_prompt(layer, rows[0], states[0], key_states, value_states, plan.opened[0])
    layer.staged_pages = 0  # this step's recall has not run yet
    for state, n in zip(states, counts, strict=True):
        state.query_start, state.logical_len = state.logical_len, state.logical_len + n
    if n_new > 1:  # (a decode step's recall sets every row's: `tracer.cache.recall`)
        for state in states:
            state.clear_recall()


def _append_prompt(layer, row: int, state: RowState, key_states, value_states, opened: int) -> None:
    """One row's prompt (or prefill chunk): its new blocks after its resident ones (packed), its tokens along
    their slots."""
    bs, n_new = layer.block_size, key_states.shape[-2]
    first, end = state.blocks(), state.blocks() + opened
    if opened:  # after the row's resident blocks (packed)
        pages = torch.arange(opened, device=layer.device) + (layer.n_staging_pages + state.hbm_blocks())
        layer.page_block[row, pages] = torch.arange(first, end, device=layer.device)
        layer.block_page[row, first:end] = pages
    positions = torch.arange(state.logical_len, state.logical_len + n_new, device=layer.device)
    slots = layer.block_page[row, block_of(positions, bs)] * bs + positions % bs
    layer.keys[row].index_copy_(1, slots, key_states[0])
    layer.values[row].index_copy_(1, slots, value_states[0])
    layer.slot_pos[row].index_copy_(0, slots, positions)
    layer.lengths = positions[-1:] + 1
    layer.next_slot[row : row + 1] = slots[-1:] + 1  # a prompt ending on a block boundary opens the next


def _append_prompts(layer, rows, rows_t, key_states, value_states, counts: list[int], opened: list[int]) -> None:
    """Several fresh rows' prompts, left-padded to one length: row i's blocks take its first main pages and its
    `counts[i]` real tokens (the last ones of its batch entry) the slots from there on, in order; the pads are
    not stored. All rows in one index each (built on the host, from host-known counts)."""
    bs, first, row_ids = layer.block_size, layer.n_staging_pages, np.asarray(rows)
    length, real = key_states.shape[-2], np.asarray(counts)
    selected = layer.row_index(rows).select
    if isinstance(selected, slice) and (real == length).all():  # consecutive rows, no pads: strided copies
        # (one strided copy per tensor instead of the token-indexed put below: the common case of a batched prefill)
        slots = slice(first * bs, first * bs + length)
        layer.keys[selected, :, slots], layer.values[selected, :, slots] = key_states, value_states
        layer.slot_pos[selected, slots] = torch.arange(length, device=layer.device)
    else:
        entry, within = ragged(real)  # each real token's batch entry and position
        tokens = device_index(np.stack([entry, within + np.repeat(length - real, real),
                                        row_ids[entry], first * bs + within, within]), layer.device)
        layer.keys[tokens[2], :, tokens[3]] = key_states[tokens[0], :, tokens[1]]
        layer.values[tokens[2], :, tokens[3]] = value_states[tokens[0], :, tokens[1]]
        layer.slot_pos[tokens[2], tokens[3]] = tokens[4]
    entry, within = ragged(np.asarray(opened))  # each new block's batch entry and id
    pages = device_index(np.stack([row_ids[entry], first + within, within]), layer.device)
    layer.page_block[pages[0], pages[1]] = pages[2]
    layer.block_page[pages[0], pages[2]] = pages[1]
    # Each row's length, next slot, and the position of its batch entry's first (padded) query: -pads.
    ends = device_index(np.stack([real, first * bs + real, real - length]), layer.device)
    layer.lengths, layer.next_slot[rows_t], layer.query_starts = ends[0], ends[1], ends[2]
