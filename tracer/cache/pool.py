"""The page pool and block tables of one decoder layer, for every row of a batch (vLLM's PagedAttention layout).

Per row, `n_staging_pages` recall staging pages, then `n_pages` main pages, then one scratch page (a target for
writes that must go nowhere), each `block_size` slots. K and V share one pool, `kv` `[2, rows, Hkv, slots, d]`
(`keys` and `values` its halves), so a block's K and V are one `[2, Hkv, block, d]` view, the DDR store's block
layout: moving a block is one block copy. Block tables: `block_page` `[rows, blocks]` (-1: not resident),
`page_block` `[rows, pages]` (-1: free), `slot_pos` `[rows, slots]` the logical position a slot holds (-1:
empty), `block_tier` `[rows, blocks]` TIER_* codes, `next_slot` `[rows]` the next token's slot. A row's
resident blocks stay packed in its first main pages (`pack`), so attention reads one range of slots.

This module owns allocation (sized at once for the policy's peak, `reserve_length`; grown when exceeded),
the views the step reads and writes (kept while they recur, `kept`), and the page moves that keep rows packed
(`free_pages`, `pack`). Appending is `tracer.cache.append`'s; `PagedLayer` (tracer.cache.layer) is a PagePool.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from tracer.attention import EmptySlots
from tracer.cache.indexing import block_of, device_index
from tracer.quant import make_block_store
from traces.policy import max_recall_blocks, peak_hbm_tokens
from traces.schema import TIER_HBM


class LengthHint(NamedTuple):
    """The longest prompt and sequence the pools are sized for (0: not known yet)."""

    max_prompt: int = 0
    max_len: int = 0


class Kept(NamedTuple):
    """A view kept by `PagePool.kept`: made under `key` from the pools `slot_pos` was part of."""

    key: tuple
    slot_pos: torch.Tensor
    value: object


class PagePool:
    """The pages, block tables and DDR store of one layer's rows (see the module docstring). Sized lazily, at the
    first append (`init_storage`: the shapes come from the model's K/V)."""

    def __init__(self, tables):
        # Every layer's token scores and importance, one tensor each (`tracer.cache.step.LayerTables`): this
        # layer's `token_scores`, `importance` and `importance_max` are its views, bound by `tables.reserve`.
        self.tables = tables
        self.tables.layers.append(self)
        self.rows_hint = 0  # the batch size, when known: rows are allocated for it at once
        self.length_hint = LengthHint()  # when known: pages are sized for them at once
        self.initialized = False
        self.n_rows = self.n_pages = self.n_staging_pages = self.block_capacity = 0

    def init_storage(self, key_states: torch.Tensor) -> None:
        _, self.n_kv_heads, _, self.head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.block_size = self.spec.block_size
        self.offsets = torch.arange(self.block_size, device=self.device)
        self.n_rows = 0
        # K and V in one pool, [2, rows, Hkv, slots, d]: `keys` and `values` are its halves (each as contiguous as a
        # pool of its own, for attention), and a block's K and V move with one copy (recall, packing, offload)
        self.bind_kv(torch.zeros((2, 0, self.n_kv_heads, self.block_size, self.head_dim), dtype=self.dtype,
                                 device=self.device))
        self.slot_pos = torch.full((0, self.block_size), -1, dtype=torch.long, device=self.device)
        self.page_block = torch.full((0, 1), -1, dtype=torch.long, device=self.device)
        self.next_slot = torch.full((0,), -1, dtype=torch.long, device=self.device)  # per row: the next token's slot
        self.block_page = torch.full((0, 0), -1, dtype=torch.long, device=self.device)
        self.block_tier = torch.zeros((0, 0), dtype=torch.int8, device=self.device)
        self.tables.reserve(0, 0, self.device)  # (binds this layer's token_scores, importance, importance_max)
        self.ddr = make_block_store(self.spec.ddr_dtype, self.n_kv_heads, self.block_size, self.head_dim, self.dtype,
                                    self.device)
        self.token_bytes = 2 * self.n_kv_heads * self.head_dim * self.keys.element_size()  # K+V of one token
        self.initialized = True
        self.grow_rows(len(self.rows))
        self._reserve_pages()

    # -- sizes -------------------------------------------------------------------------------------------------
    def reserve_length(self, max_prompt: int, max_len: int) -> None:
        """Size the pools for sequences of up to `max_prompt` prompt tokens decoded to `max_len` tokens: the pages
        at the policy's peak (`traces.policy.peak_hbm_tokens`) and recall's staging pages, at once (as
        `tracer.run.kv_buffer_bytes` sized them), not grown as they fill: each growth copies the whole pool and,
        with more staging pages, shifts every row's main pages (a copy of the whole pool inside a decode step, and
        another at the first recall). Beyond these (a promotion past its room) the pools still grow.
        The cache passes the longest so far (`TieredCache.reserve_length`); before the first update they wait."""
        self.length_hint = LengthHint(max_prompt, max_len)
        if self.initialized:
            self._reserve_pages()

    def _reserve_pages(self) -> None:
        max_prompt, max_len = self.length_hint
        if max_len:
            self.ensure_blocks(max_len)
            pages = -(-peak_hbm_tokens(self.spec, max_prompt, max_len) // self.block_size)
            self.resize_pages(pages, max_recall_blocks(self.spec, max_len, self.n_kv_heads), slack=False)

    def grow_rows(self, n_rows: int) -> None:
        """Room for `n_rows` rows: the batch size when the decode loop named it (`TieredCache.reserve_rows`),
        else doubling (a batch admits its rows one by one)."""
        if n_rows <= self.n_rows:
            return
        n_rows = max(n_rows, self.rows_hint or 2 * self.n_rows)
        extra = n_rows - self.n_rows

        def grown(tensor: torch.Tensor, fill) -> torch.Tensor:
            more = torch.full((extra, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=self.device)
            return torch.cat([tensor, more])

        self.bind_kv(torch.cat([self.kv, torch.zeros((2, extra, *self.kv.shape[2:]), dtype=self.dtype,
                                                     device=self.device)], 1))
        self.slot_pos, self.page_block, self.block_page = grown(self.slot_pos, -1), grown(self.page_block, -1), \
            grown(self.block_page, -1)
        self.next_slot = grown(self.next_slot, -1)
        self.block_tier = grown(self.block_tier, TIER_HBM)
        self.tables.reserve(n_rows, self.block_capacity * self.block_size, self.device)
        self.n_rows = n_rows
        self.ddr.reserve(n_rows, max(1, self.block_capacity))

    def clear_row(self, row: int) -> None:
        """A refilled row starts empty (its previous sample's pages, tiers and scores are gone)."""
        self.slot_pos[row], self.page_block[row], self.block_page[row] = -1, -1, -1
        self.block_tier[row] = TIER_HBM
        self.ddr.bounds.clear(row)  # no block of the row is in DDR (recall's mask)
        self.token_scores[row], self.importance[row], self.importance_max[row] = 0, 0, 0

    def resize_pages(self, pages: int, staging_pages: int, slack: bool = True) -> None:
        """At least `pages` main and `staging_pages` staging pages per row; what the pages hold is kept (the
        staging pages too: a placement may promote from them after a resize). More staging pages shift the main
        pages up, and the block tables and next slots with them: rare, as the recall count seldom grows."""
        if pages <= self.n_pages and staging_pages <= self.n_staging_pages:
            return
        # An eighth of slack amortises growth past what was reserved (attention reads only the pages in use:
        # packed, see `pack`); a reservation (`reserve_length`) asks for what it needs.
        if pages > self.n_pages:
            pages += max(2, pages // 8) if slack else 0
        else:
            pages = self.n_pages
        staging_pages = max(staging_pages, self.n_staging_pages)
        bs, shift = self.block_size, staging_pages - self.n_staging_pages
        old_pages = self.n_staging_pages + self.n_pages  # staging + main, not the scratch page
        target = slice(shift * bs, (shift + old_pages) * bs)
        total = (staging_pages + pages + 1) * bs
        kv = torch.zeros((2, self.n_rows, self.n_kv_heads, total, self.head_dim), dtype=self.dtype, device=self.device)
        kv[:, :, :, target] = self.kv[:, :, :, : old_pages * bs]
        self.bind_kv(kv)
        slot_pos = torch.full((self.n_rows, total), -1, dtype=torch.long, device=self.device)
        slot_pos[:, target] = self.slot_pos[:, : old_pages * bs]
        page_block = torch.full((self.n_rows, staging_pages + pages + 1), -1, dtype=torch.long, device=self.device)
        page_block[:, shift : shift + old_pages] = self.page_block[:, :old_pages]
        if shift:
            self.block_page = torch.where(self.block_page >= 0, self.block_page + shift, -1)
            self.next_slot = torch.where(self.next_slot >= 0, self.next_slot + shift * bs, -1)
        self.slot_pos, self.page_block = slot_pos, page_block
        self.n_pages, self.n_staging_pages = pages, staging_pages

    def ensure_blocks(self, positions: int) -> None:
        blocks = math.ceil((positions + 1) / self.block_size)  # + the scratch position scorers may write
        if blocks <= self.block_capacity:
            return
        capacity = max(blocks, 2 * self.block_capacity, 64)
        extra = capacity - self.block_capacity

        def widened(tensor: torch.Tensor, columns: int, fill) -> torch.Tensor:
            more = torch.full((self.n_rows, columns), fill, dtype=tensor.dtype, device=self.device)
            return torch.cat([tensor, more], dim=1)

        self.block_tier = widened(self.block_tier, extra, TIER_HBM)
        self.block_page = widened(self.block_page, extra, -1)
        self.tables.reserve(self.n_rows, capacity * self.block_size, self.device)
        self.block_capacity = capacity
        self.ddr.reserve(self.n_rows, capacity)

    # -- views ---------------------------------------------------------------------------------------------------
    @property
    def scratch_page(self) -> int:
        return self.n_staging_pages + self.n_pages

    @property
    def main_slots(self) -> slice:
        """The main pages' slots (after the staging pages, before the scratch page)."""
        return slice(self.n_staging_pages * self.block_size, self.scratch_page * self.block_size)

    def bind_kv(self, kv: torch.Tensor) -> None:
        self.kv, self.keys, self.values = kv, kv[0], kv[1]
        self._views: dict[str, Kept] = {}  # (`kept`: what was made from the pool it replaces goes with it)

    def pages_view(self, name: str) -> torch.Tensor:
        """`kv` as [2, rows, Hkv, pages, block, d], `slot_pos` as [rows, pages, block] (views): a page is then one
        index, so moving a block indexes it once rather than once per slot."""
        tensor, bs = getattr(self, name), self.block_size
        if name == "slot_pos":
            return tensor.view(tensor.shape[0], -1, bs)
        return tensor.view(*tensor.shape[:3], -1, bs, tensor.shape[4])

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Slots of pages [...] -> [..., block_size] flattened on the last axis."""
        return (pages[..., None] * self.block_size + self.offsets).flatten(-2)

    def kept(self, name: str, key: tuple, make):
        """`make()`, kept under `name` while `key` recurs and the pools stay (`bind_kv` drops them all, and a new
        `slot_pos` each): the views a decode step reads and writes step after step, made once rather than by a few
        view ops per call and layer (~1 us each on a CPU). `key` holds plain values (ints, dtypes, flags), and the
        grad mode where the views are written (a view made under inference mode is written only under it)."""
        kept = self._views.get(name)
        if kept is None or kept.key != key or kept.slot_pos is not self.slot_pos:
            kept = self._views[name] = Kept(key, self.slot_pos, make())
        return kept.value

    def attended(self, selected: slice | torch.Tensor, used: slice, dtype: torch.dtype | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EmptySlots | None]:
        """The keys, values and slot positions attention reads (the `used` slots of the `selected` rows) and, for a
        decode step (`dtype` given), the mask input it fills from them (`EmptySlots`): for consecutive rows (a full
        batch, one row) views, kept while those rows and slots recur (most steps: the slots in use change only as a
        block opens or leaves, or as the recall width does), else gathers (attention then makes its own mask)."""
        def read():
            return self.keys[selected, :, used], self.values[selected, :, used], self.slot_pos[selected, used]

        if not isinstance(selected, slice):
            return (*read(), None)
        key = (selected.start, selected.stop, used.start, used.stop)
        keys, values, slot_pos = self.kept("attended", key, read)
        if dtype is None:
            return keys, values, slot_pos, None
        # (one made under inference mode holds an inference tensor: kept per mode)
        empty_slots = self.kept("empty slots", (*key, dtype, torch.is_inference_mode_enabled()),
                                lambda: EmptySlots(slot_pos, self.n_kv_heads, dtype))
        return keys, values, slot_pos, empty_slots

    def final_tiers(self, row: int) -> torch.Tensor:
        """TIER_* code of every logical position of `row`."""
        state = self.rows[row]
        return self.block_tier[row, : state.blocks()].repeat_interleave(self.block_size)[: state.logical_len]

    # -- page moves ----------------------------------------------------------------------------------------------
    def free_pages(self, place_rows: torch.Tensor, left: torch.Tensor, end: int) -> None:
        """Free the pages of the blocks that left HBM (mask [m, blocks]); the others write to the scratch page,
        so no count reaches the host."""
        pages = self.block_page[place_rows, :end]
        freed = torch.where(left, pages, self.scratch_page)
        rows = place_rows[:, None]
        self.page_block[rows, freed] = -1
        self.pages_view("slot_pos")[rows, freed] = -1
        self.block_page[place_rows, :end] = torch.where(left, -1, pages)

    def pack(self, place_rows: torch.Tensor, before: list[int], after: list[int], after_on_device=None) -> None:
        """Keep every row's resident blocks in its first main pages, so that attention reads only the pages in use
        (a pool sized by a long prompt would otherwise be read whole at every step after its blocks left): the
        blocks in pages at or above a row's new HBM count (`after`; `before` it held that many) move down into the
        pages its departed blocks freed, one block copy each, every row in one gather and one scatter. At most
        before - after blocks move per row; their number, data-dependent, stays on the device (the unused moves
        copy the scratch page onto itself). `after_on_device()`: `after` on the device, where the caller keeps it."""
        width = max(b - a for b, a in zip(before, after, strict=True))
        if width <= 0:
            return
        first, bs = self.n_staging_pages, self.block_size
        column = torch.arange(max(before), device=self.device)
        counts = (after_on_device() if after_on_device is not None else device_index(after, self.device))[:, None]
        occupied = self.page_block[place_rows, first : first + column.shape[0]] >= 0
        above, holes = occupied & (column >= counts), ~occupied & (column < counts)
        source = torch.argsort((~above).to(torch.int8), dim=1, stable=True)[:, :width]
        target = torch.argsort((~holes).to(torch.int8), dim=1, stable=True)[:, :width]
        moving = above.gather(1, source)  # as many holes as blocks above: the j-th of each pair up
        source = torch.where(moving, source + first, self.scratch_page)
        target = torch.where(moving, target + first, self.scratch_page)
        rows = place_rows[:, None]
        pages = self.pages_view("kv")  # [2, rows, Hkv, pages, block, d]
        pages[:, rows, :, target] = pages[:, rows, :, source]
        slot_pos = self.pages_view("slot_pos")  # [rows, pages, block]
        slot_pos[rows, target] = slot_pos[rows, source]
        slot_pos[rows, source] = -1
        blocks = self.page_block[rows, source]  # -1 for the scratch page
        self.page_block[rows, target] = blocks
        self.page_block[rows, source] = -1
        shift = torch.where(moving, target - source, 0)
        self.block_page.index_put_((rows.expand_as(blocks), blocks.clamp_min(0)), shift, accumulate=True)
        next_slot = self.next_slot[place_rows]  # the row's current block may have moved: its next slot with it
        hit = moving & (source == block_of(next_slot, bs)[:, None])
        self.next_slot[place_rows] = next_slot + (hit * shift).sum(1) * bs
