"""Recall at a decode step: the DDR blocks a row's current query reads, copied into its staging pages.

Per layer, after the new token is appended and before attention: each row with DDR blocks may recall
`recall_blocks(spec, L)` of them (at most its DDR blocks; `RecallPlan`, host-known); the layer's recall rule
chooses which (`tracer.cache.recall_rules`, by the rule name of the policy); `stage` copies them from the
DDR store into the last staging pages, one gather for all rows, so that attention reads one range of slots
(this step's staging pages, then the main pages). The ids reach the trace through the step's one copy. A
per-head choice also returns the mask of the staged slots each KV head must not attend (`hidden`).

With a recall buffer (`--recall-buffer-blocks`) on a GPU, the buffer is a region of HBM per layer
(`buffer_region`: [rows, capacity] blocks): `stage_from_buffer` copies a hit from its slot there into its staging
page (a device-local copy: the DDR store is not read for it) and gathers only the misses from DDR, keeping those
that stay in the buffer in their slots. On a CPU both tiers are host memory and `stage` gathers every chosen
block; the accounting (`bytes_h2d`: the misses) is the same either way, and so is what attention reads
(a DDR block never changes while it lives there: a held copy is the block). `PagedLayer.hits_from_hbm` forces
either path (tests run the GPU's on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tracer.attention import workspace
from tracer.cache.copies import LayerIds, as_int64
from tracer.cache.indexing import cached_device_index, device_index, flat_selection_index, staging_pages
from tracer.cache.recall_rules import RECALL_RULES, RecallChoice, RecallRequest
from tracer.cache.rows import RecalledIds, RowState
from traces.policy import recall_blocks
from traces.recall_buffer import RecallBuffer


@dataclass(frozen=True)
class RecallPlan:
    """Which batch entries recall this step and how much (host-known; shared by a step's layers)."""

    batch_index: tuple[int, ...] = ()  # the batch entries that recall
    wanted: tuple[int, ...] = ()  # the blocks each may recall
    n_blocks: int = 0  # the most blocks any of them has
    rows: tuple[int, ...] = ()  # their row ids

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch entries, their row ids) on the device: kept, as the same rows recall step after step."""
        device = str(device)
        return cached_device_index(self.batch_index, device), cached_device_index(self.rows, device)


def recall_plan(rows: list[int], states: list[RowState]) -> RecallPlan:
    wanted = [min(recall_blocks(s.spec, s.logical_len), s.n_ddr_blocks) for s in states]
    batch_index = tuple(i for i, k in enumerate(wanted) if k > 0)
    if not batch_index:
        return RecallPlan()
    return RecallPlan(batch_index, tuple(wanted[i] for i in batch_index), max(states[i].blocks() for i in batch_index),
                      tuple(rows[i] for i in batch_index))


class FlatRows(NamedTuple):
    """Each recalling row once per pick (`recall`), kept while the same rows recall as wide."""

    key: tuple | None = None  # (their row ids, the picks per row)
    rows: torch.Tensor | None = None


def recall(layer, rows: list[int], states: list[RowState], rows_t: torch.Tensor, query: torch.Tensor,
           together: bool = False, scaling: float | None = None) -> torch.Tensor | None:
    """Copy each recalling row's DDR blocks for its query into its staging pages (one gather for all rows);
    returns the per-head rule's hidden-key mask [rows, Hkv, slots] (None otherwise). The ids recalled reach the
    trace in the step's copy: this layer's added to it here, or, for layers placed `together`, every layer's
    at once after the last (`tracer.cache.step.after_attention_of_layers`)."""
    plan = layer.plan("recall", 1, lambda: recall_plan(rows, states))
    batch_index = plan.batch_index
    every_row = len(batch_index) == len(rows)
    if not every_row:  # the rows that recall nothing this step
        recalling = set(batch_index)
        for i, state in enumerate(states):
            if i not in recalling:
                state.clear_recall()
    if not batch_index:
        return None
    if every_row:
        entries, rec_rows, rec_query, selected = None, rows_t, query, layer.row_index(rows).select
    else:
        entries, rec_rows = plan.index(layer.device)
        rec_query, selected = query[entries], rec_rows
    group = query.shape[1] // layer.n_kv_heads
    q = rec_query.reshape(len(batch_index), layer.n_kv_heads, group, layer.head_dim)  # (one query: [m, Hq, 1, d])
    choice = RECALL_RULES[layer.spec.recall_rule].select(
        RecallRequest(q, selected, plan.wanted, plan.n_blocks, layer, scaling, entries))
    buffered = layer.spec.recall_buffer_blocks
    if buffered and hits_from_hbm(layer):  # hits read from the buffer's HBM region, misses from DDR
        staged, hits = stage_from_buffer(layer, rows, plan, states, choice)
    else:
        staged = stage(layer, rows, plan, rec_rows, selected, every_row, choice)
        hits = admit_to_buffers(layer, plan.batch_index, choice.per_row, states, staged.flat_ids) if buffered else None
    per_row, head_picks, width = choice.per_row, choice.head_picks, choice.ids.shape[1]
    flat_ids, n_bytes = staged.flat_ids, staged.n_bytes
    block_bytes = n_bytes // max(1, flat_ids.shape[0])
    # every row's ids in one copy (this layer's, or every layer's together: filled in after the last)
    recorded = layer.recalled_ids = LayerIds(flat_ids) if together else layer.copies.add(flat_ids, as_int64)
    start = 0
    for position, (i, n) in enumerate(zip(batch_index, per_row, strict=True)):
        state = states[i]
        state.recalled_blocks, state.bytes_h2d = n, n * block_bytes
        state.recalled = RecalledIds(flat_ids, recorded, start, n)
        if head_picks is not None:
            state.head_picks = head_picks[position, :n]
        start += n
    if hits is not None:  # `bytes_h2d`: the misses only
        for i, n, n_hits in zip(batch_index, per_row, hits, strict=True):
            states[i].buffer_hits, states[i].bytes_h2d = n_hits, (n - n_hits) * block_bytes
    if head_picks is None:
        return None
    hidden = torch.zeros(len(rows), layer.n_kv_heads, layer.keys.shape[2], dtype=torch.bool, device=layer.device)
    flat_picks = head_picks.reshape(-1, layer.n_kv_heads)  # [n_flat, Hkv]
    batch_of = (entries if entries is not None else cached_device_index(batch_index, str(layer.device))) \
        .repeat_interleave(width)
    if staged.select is not None:
        flat_picks, batch_of = flat_picks[staged.select], batch_of[staged.select]
    hidden.view(len(rows), layer.n_kv_heads, -1, layer.block_size)[batch_of, :, staged.pages] = ~flat_picks[:, :, None]
    return hidden


def hits_from_hbm(layer) -> bool:
    """Whether a buffer's hits are read from its HBM region (`stage_from_buffer`): on a GPU, unless the layer's
    `hits_from_hbm` says otherwise."""
    forced = getattr(layer, "hits_from_hbm", None)
    return layer.device.type == "cuda" if forced is None else forced


def _buffer_of(layer, state: RowState) -> RecallBuffer:
    if state.recall_buffer is None:
        state.recall_buffer = RecallBuffer(layer.spec.recall_buffer_blocks)
    return state.recall_buffer


def admit_to_buffers(layer, batch_index, per_row, states: list[RowState], flat_ids: torch.Tensor) -> list[int]:
    """`--recall-buffer-blocks` where every chosen block was gathered from DDR (`stage`, a CPU): each recalling
    row's LRU of recalled ids (`traces.recall_buffer.RecallBuffer`, per row and layer) counts this step's hits.
    The ids are read back (one synchronisation per layer, only with a buffer)."""
    ids = flat_ids.tolist()
    hits, start = [], 0
    for i, n in zip(batch_index, per_row, strict=True):
        hits.append(_buffer_of(layer, states[i]).admit(ids[start : start + n]))
        start += n
    return hits


def buffer_region(layer) -> torch.Tensor:
    """The layer's recall buffer in HBM, [rows, capacity, 2, Hkv, block, d] (a slot per block it holds, the DDR
    store's block layout), made at its first use and grown with the rows."""
    region, n_rows = layer.recall_region, max(len(layer.rows), layer.rows_hint)
    if region is None or region.shape[0] < n_rows:
        grown = torch.zeros((n_rows, layer.spec.recall_buffer_blocks, 2, layer.n_kv_heads, layer.block_size,
                             layer.head_dim), dtype=layer.kv.dtype, device=layer.device)
        if region is not None:
            grown[: region.shape[0]] = region
        layer.recall_region = region = grown
    return region


def stage_from_buffer(layer, rows: list[int], plan: RecallPlan, states: list[RowState], choice: RecallChoice
                      ) -> tuple[Staged, list[int]]:
    """`stage` with the recall buffer in HBM: the chosen ids are read back (the one synchronisation per layer a
    buffer costs), each row's buffer says which are hits (`RecallBuffer.admit_slots`, the slot each is held
    in) and which misses; a row's j-th pick goes to staging page S - width + j as in `stage`. The hits are
    copied from their slots in `buffer_region` first, then the misses are gathered from the DDR store into their
    pages and written into the slots they keep (a hit leaving in this step may give its slot to a miss). Returns
    the staged picks and each recalling row's hits."""
    ids, per_row = choice.ids, choice.per_row
    width = ids.shape[1]
    if width > layer.n_staging_pages:
        layer.resize_pages(layer.n_pages, width)
    host_ids = ids.tolist()  # (the read-back)
    first_page = layer.n_staging_pages - width
    layer.staged_pages = width
    region = buffer_region(layer)
    picks: list[list[int]] = [[], [], []]  # every pick's row, page and id, rows in order
    hit: list[list[int]] = [[], [], []]  # row, slot, page
    miss: list[list[int]] = [[], [], []]  # row, id, page
    kept: list[list[int]] = [[], [], []]  # index among the misses, row, slot
    n_hits = []
    for position, (i, n) in enumerate(zip(plan.batch_index, per_row, strict=True)):
        row, row_ids = plan.rows[position], host_ids[position][:n]
        page_of = {block: first_page + j for j, block in enumerate(row_ids)}
        hits, misses = _buffer_of(layer, states[i]).admit_slots(row_ids)
        n_hits.append(len(hits))
        for block, slot in hits:
            for part, value in zip(hit, (row, slot, page_of[block]), strict=True):
                part.append(value)
        for block, slot in misses:
            if slot is not None:
                for part, value in zip(kept, (len(miss[0]), row, slot), strict=True):
                    part.append(value)
            for part, value in zip(miss, (row, block, page_of[block]), strict=True):
                part.append(value)
        for part, values in zip(picks, ([row] * n, range(first_page, first_page + n), row_ids), strict=True):
            part.extend(values)
    device = layer.device
    groups = (hit, miss, kept, picks)
    flat = device_index(np.fromiter((v for parts in groups for part in parts for v in part), dtype=np.int64), device)
    starts = np.cumsum([0] + [len(part) for parts in groups for part in parts]).tolist()  # (one upload, sliced)
    views = iter(flat[a:b] for a, b in zip(starts, starts[1:]))
    hit, miss, kept, picks = ([next(views) for _ in parts] for parts in groups)
    kv, slot_pos = layer.pages_view("kv"), layer.pages_view("slot_pos")  # [2, rows, Hkv, pages, block, d]
    slot_pos[layer.row_index(rows).select, first_page : first_page + width] = -1  # (pages this recall leaves empty)
    if hit[0].numel():  # (two advanced indices, apart, lead the result: [n, 2, Hkv, block, d], the blocks' layout)
        kv[:, hit[0], :, hit[2]] = region[hit[0], hit[1]]
    if miss[0].numel():
        blocks, _ = _get_blocks(layer, miss[0], miss[1], None)
        kv[:, miss[0], :, miss[2]] = blocks
        if kept[0].numel():
            region[kept[1], kept[2]] = blocks[kept[0]]
    slot_pos[picks[0], picks[1]] = torch.add(layer.offsets, picks[2][:, None], alpha=layer.block_size)
    select = flat_selection_index(tuple(per_row), width, str(device)) if min(per_row) < width else None
    return Staged(picks[2], picks[1], select, picks[2].shape[0] * layer.ddr.block_bytes()), n_hits


class Staged(NamedTuple):
    flat_ids: torch.Tensor  # every recalling row's picks laid end to end (staging order)
    pages: torch.Tensor | None  # each pick's staging page (None: the rows' last `width` pages, in order)
    select: torch.Tensor | None  # the valid picks among [rows x width] (None: all are)
    n_bytes: int  # copied H2D


def stage(layer, rows: list[int], plan: RecallPlan, rec_rows: torch.Tensor, selected: slice | torch.Tensor,
          every_row: bool, choice: RecallChoice) -> Staged:
    """Copy the chosen blocks from DDR into the recalling rows' staging pages: a row's j-th pick into staging page
    S - width + j (the last `width` staging pages, next to the main pages, so that attention reads one range of
    slots), whole pages at a time, and their positions into the pages' slots. The valid picks of every row are
    selected on the host (their count per row is known here): nothing is read back."""
    ids, per_row = choice.ids, choice.per_row
    width = ids.shape[1]  # (the most picks of any row)
    if width > layer.n_staging_pages:
        layer.resize_pages(layer.n_pages, width)
    key = (plan.rows, width)
    if layer.flat_rows.key != key:  # each recalling row once per pick (the same rows recall alike, step by step)
        layer.flat_rows = FlatRows(key, rec_rows.repeat_interleave(width))
    flat_rows, flat_ids = layer.flat_rows.rows, ids.reshape(-1)
    uneven_picks = min(per_row) < width  # some rows recall fewer blocks than the widest
    select = None
    if uneven_picks:
        select = flat_selection_index(tuple(per_row), width, str(layer.device))
        flat_rows, flat_ids = flat_rows[select], flat_ids[select]
    one_row = rows[plan.batch_index[0]] if len(plan.batch_index) == 1 else None  # (host-known: no row offsets)
    bs = layer.block_size
    layer.staged_pages, first_page = width, layer.n_staging_pages - width
    if uneven_picks or not every_row:  # pages this recall leaves unfilled are attended: empty them first
        layer.pages_view("slot_pos")[layer.row_index(rows).select, first_page : first_page + width] = -1
    pages = staging_pages(tuple(per_row), width, first_page, str(layer.device)) \
        if uneven_picks or choice.head_picks is not None or not isinstance(selected, slice) else None
    if pages is None:  # consecutive rows, `width` blocks each: one strided copy per tensor, no index
        page_range = slice(first_page, first_page + width)
        staged_kv, staged_pages, staged_pos = _staged(layer, selected, one_row, page_range)
        if staged_kv is not None:  # one row: gathered into its pages directly
            n_bytes = layer.ddr.get_into(one_row, flat_ids, staged_kv)
        elif staged_pages is not None:  # several rows: each staging page gathered into directly
            n_bytes = layer.ddr.get_pages_into(rec_rows, ids, staged_pages)
        else:
            blocks, n_bytes = _get_blocks(layer, flat_rows, flat_ids, one_row)
            layer.pages_view("kv")[:, selected, :, page_range] = blocks.view(
                len(plan.batch_index), width, *blocks.shape[1:]).permute(2, 0, 3, 1, 4, 5)
        # block b holds positions b * bs + offsets: written in place, one kernel (a gather and a copy took ~2x)
        torch.add(layer.offsets, ids.view(*ids.shape, 1), alpha=bs, out=staged_pos)
    else:  # (the two advanced indices, apart, lead the result: [n, 2, Hkv, block, d], the blocks' layout)
        blocks, n_bytes = _get_blocks(layer, flat_rows, flat_ids, one_row)
        layer.pages_view("kv")[:, flat_rows, :, pages] = blocks
        layer.pages_view("slot_pos")[flat_rows, pages] = torch.add(layer.offsets, flat_ids[:, None], alpha=bs)
    return Staged(flat_ids, pages, select, n_bytes)


def _staged(layer, selected: slice, one_row: int | None, pages: slice
            ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, torch.Tensor]:
    """Views of the staging `pages` of the `selected` rows that recall writes: one row's K and V as the store's
    block layout ([width, 2, Hkv, block, d], for `get_into`; None for several rows), several rows' pages one by
    one in that layout ([rows, 2, Hkv, block, d] each, for `get_pages_into`, on a CPU; None for one row), both
    None for a store without them; and their slot positions [rows, width, block]; kept while the rows and pages
    recur (step after step)."""
    def make():
        staged_kv = staged_pages = None
        kv = layer.pages_view("kv")  # [2, rows, Hkv, pages, block, d] -> the block layout
        if one_row is not None and hasattr(layer.ddr, "get_into"):
            staged_kv = kv[:, one_row, :, pages].permute(2, 0, 1, 3, 4)
        elif one_row is None and layer.device.type == "cpu" and hasattr(layer.ddr, "get_pages_into"):
            # (on a CPU the gather and a copy are each a memory-bound pass; on a GPU a gather per page would
            # launch width - 1 more kernels to save one copy of a few MB, a microsecond of bandwidth)
            staged_pages = [kv[:, selected, :, page].transpose(0, 1) for page in range(pages.start, pages.stop)]
        return staged_kv, staged_pages, layer.pages_view("slot_pos")[selected, pages]

    return layer.kept("staging", (selected.start, selected.stop, one_row, pages.start, pages.stop,
                                  torch.is_inference_mode_enabled()), make)


def _get_blocks(layer, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None) -> tuple[torch.Tensor, int]:
    """The DDR blocks (`rows`, `block_ids`) on the device as [n, 2, Hkv, block, d] (K and V side by side, as the
    pool holds them) and the bytes copied H2D: as stored (a block store's `get_blocks`) or stacked from `get`
    (a store that dequantizes, tracer.quant). On a CPU a block store gathers into a kept buffer (`workspace`:
    the caller copies them into its pages at once)."""
    if hasattr(layer.ddr, "get_blocks"):
        out = workspace("recalled blocks", (block_ids.shape[0], 2, layer.n_kv_heads,
                                            layer.block_size, layer.head_dim), layer.kv.dtype, layer.device)
        return layer.ddr.get_blocks(rows, block_ids, row, out=out)
    keys, values, n_bytes = layer.ddr.get(rows, block_ids, row)
    return torch.stack([keys, values], 1), n_bytes
