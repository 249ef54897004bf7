"""The tiered KV cache: per layer, blocks of `block_size` logical positions live in HBM (pages of a pool on the
compute device), DDR (`tracer.transfer.PinnedBlockStore`, host memory) or are evicted (only their ids are kept).

Paged layout (the way vLLM's PagedAttention holds KV): each layer's HBM tier is a pool of pages, one block of
`block_size` slots each: the recall staging pages, then the main pages, then one scratch page (a target for
writes that must go nowhere); `block_page` maps a block to its page (-1 when it is not resident), `page_block`
a page to its block (-1 when free), `slot_pos` each slot to the logical position it holds (-1 when empty).
K and V share the pool (`kv`, [2, rows, Hkv, slots, d]; `keys` and `values` its halves): a block's K and V are
one [2, Hkv, block, d] view, the DDR store's block layout, so moving a block is one block copy; nothing is
compacted. A row's resident blocks stay packed in its first main
pages: a new block takes the page after them (known on the host), and when blocks leave HBM the ones above the
new count move down into the freed pages (`_pack`: a block copy each, at placement). So attention reads one
range of slots in use, this step's staging pages then the fullest row's resident pages, not the whole pool
(which a long prompt sizes at prefill); the empty slots in it are masked out (weight 0: at decode inside the
logits GEMM, tracer.attention), and the slots' order does not matter (softmax over a set).

Batched: one `PagedLayer` per decoder layer holds every row (sequence) of a batch in `[rows, ...]` tensors, and a
step appends, recalls (one gather for all rows), attends, scores and places all its rows with one set of
kernels, each row on its own slice, with its counts on the host: the kernels a step issues do not grow with
the batch. Fresh rows' prompts can come in one left-padded forward (`update`'s `new_tokens`): each row keeps
only its real tokens, and its pads' queries read position 0 and reach no scorer. The rows share one page count (the fullest row's), so a shorter row attends empty, masked pages
(compute, never another row's entries). `TieredLayer` is one row's view, what HF, the tokens table and the
gradient scorer read for one sequence. Memory per layer: rows x (pages + staging pages + 1) x block_size x the
K+V bytes of a token on the device (`tracer.run.kv_buffer_bytes` sizes it before a run), and rows x blocks
ever offloaded x block bytes of host memory for the DDR tier.

Sync-free steps: every decision inside a decode step is a device tensor (which blocks move, which DDR blocks a
query recalls, the new token's slot), and the host sizes every buffer and every move from counts it knows
without reading the device: the policy's targets depend only on the logical length, and under the default
hierarchy (no eviction, no promote) and the evict policy the number of blocks each tier holds follows from
them exactly. The block ids that moved reach the trace through the step's one deferred copy. Where a count is
data-dependent, the layer reads it back, once per layer that places or recalls: `--evict-ratio > 0` with a DDR
tier (eviction may take a DDR or an HBM block), `--promote`, and the per-head rule (its union's size).

Host plans shared by layers: where the counts follow from the lengths as above, every layer's rows hold the same
counts at a decode step, so what the host derives from them (which rows open a block, recall, place or record,
each placement's targets and counts, the recording's host counts) is made once per forward, by its first layer,
and reused by the others (`PagedLayer._plan`). Under the quest rule (or none) with H2O (or no scorer), such a
step's scoring, importance and block masses then run for every layer at once after the last layer has attended
(`_after_attention_of_layers`: the layers' score tables are one [layers, rows, positions] tensor, `_LayerTables`),
and each layer places after that; its next step is the first to read what its placement moved, so the numbers
are those of placing right after its own attention.

Correct by construction:
- `update` writes the new K/V into their pages and returns the pool; the attention function
  (tracer/attention.py) adds the recalled DDR blocks, attends, and only then does the layer score and move
  blocks. Nothing is pruned before the step that produced it has attended to it.
- Positions are logical: `logical_len` counts every entry ever appended, `get_seq_length()` the ones stored in
  HBM. Callers pass true `position_ids` (the decode loop does; `generate` derives them from its attention
  mask), so RoPE never sees the shrunken stored length.

Recall rules (`PolicySpec.recall_rule`, traces/policy.py), at each decode step, per layer, for the *current*
query; the number of blocks is `recall_blocks(spec, logical_len)` (`recall_k`, or `--recall-budget`):
- "quest": every DDR block gets the upper bound `max over query heads of sum_d max(q_d * kmin_d, q_d * kmax_d)`
  of its attention logit (kmin/kmax: elementwise key bounds of the block, kept on the device; the sum is one
  GEMM, [max(q, 0), min(q, 0), 1] . [kmax, kmin, mask], `tracer.transfer.KeyBounds`, whose mask row puts every
  block outside DDR at the dtype's lowest value); the top blocks are copied to HBM staging pages and every head
  attends them.
- "quest-per-head": each KV head ranks the DDR blocks by the same bound maximised over its own query group
  only and picks its own top blocks. A block is copied once when any head picks it (the union is what moves,
  and what bytes_h2d / recalled_block_ids record), and each KV head attends only the recalled blocks *it*
  picked, plus HBM: the other heads' picks are masked out of its softmax (`hidden_keys`). Per-head masking
  rather than "union for everyone" because the union would let a head read blocks its own bound did not
  select, so the rule's accuracy would not be the per-head rule's; the mask is one [Hkv, n_keys] boolean
  added to the logits, no second attention path.
With `promote` (off by default: it ranks blocks every step), recalled blocks then compete with the movable
HBM blocks for the HBM budget by score (a swap with the weakest HBM block when they score higher).

Placement after attention, with every target from the policy contract (traces/policy.py: `movable_range`,
`protected_tokens`, `evict_target_blocks`, `room_blocks`; block granularity, sink blocks and the recent window
incl. the partial block protected): 1) evict the lowest-scored blocks until `evict_target_blocks` are evicted;
2) if the movable HBM blocks exceed `room_blocks`, keep the highest-scored ones and move the rest to DDR
(hierarchy) or drop them (evict). It runs when a target changes (a block becomes movable, the room or the
eviction target moves) or a recalled block may be promoted; otherwise the last placement still holds.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from thoughtkv_base import UserError
from tracer.attention import EmptySlots, attend, head_mean_max, set_pending, workspace
from tracer.quant import make_block_store
from tracer.recorder import Deferred, LayerEntry, StepRecording, repeated
from tracer.scorers import Observation, Scorer
from tracer.transfer import host_to_device
from traces.policy import (
    PolicySpec,
    evict_target_blocks,
    hbm_target_tokens,
    max_recall_blocks,
    movable_range,
    n_blocks,
    peak_hbm_tokens,
    recall_blocks,
    room_blocks,
)
from traces.schema import TIER_DDR, TIER_EVICTED, TIER_HBM


class UnsupportedBatch(UserError):
    pass


@dataclass
class TierSettings:
    """The placement spec (every placement setting, validated by `PolicySpec`) plus what only the tracer needs."""

    spec: PolicySpec = field(default_factory=PolicySpec)
    scorer: Scorer | None = None  # None: no scoring (fine for the full policy)
    track_importance: bool = False  # accumulate per-token attention over decode steps (tokens table, oracle)


def counts_are_exact(spec: PolicySpec) -> bool:
    """Whether the host knows every tier's block count from the policy's targets alone (no read-back):
    without eviction into a DDR tier and without promotion, each placement keeps min(room, candidates)."""
    if spec.policy != "hierarchy":
        return True
    return spec.evict_ratio == 0 and not spec.promote


@dataclass
class RowState:
    """One row's (sequence's) host-side state in a `PagedLayer`: everything the host decides from."""

    settings: TierSettings
    recorder: object = None
    logical_len: int = 0
    query_start: int = 0  # the first new position of this step
    n_ddr_blocks: int = 0  # exact (see the module doc)
    n_evicted_blocks: int = 0
    recalled_blocks: int = 0  # DDR blocks in this row's staging pages this step
    placed_key: tuple | None = None  # the targets the last placement met
    step: int = 0
    defer_placement: bool = False
    deferred_query_tokens: int = 0
    # This step's recalled block ids (sorted): (every recalling row's ids on the device, the same as the trace
    # records them (`Deferred`, fetched at step end), this row's first, count); sliced only when read.
    recalled: tuple | None = None
    head_picks: torch.Tensor | None = None  # quest-per-head: [recalled, Hkv] bool
    bytes_h2d: int = 0

    @property
    def spec(self) -> PolicySpec:
        return self.settings.spec

    @property
    def recalled_ids(self) -> torch.Tensor | None:
        """This step's recalled block ids, in staging order (device)."""
        if self.recalled is None:
            return None
        ids, _, start, n = self.recalled
        return ids[start : start + n]

    def blocks(self) -> int:
        return n_blocks(self.spec, self.logical_len)

    def clear_recall(self) -> None:
        """No DDR block recalled this step (yet)."""
        self.recalled_blocks, self.recalled, self.head_picks, self.bytes_h2d = 0, None, None, 0

    def hbm_blocks(self) -> int:
        return self.blocks() - self.n_ddr_blocks - self.n_evicted_blocks


class PagedLayer:
    """One decoder layer's tiered KV for every row of a batch: `[rows, ...]` tensors, so that one set of
    kernels appends, recalls, attends, scores and places for the whole batch (a batch of one row is the same
    code). Rows differ in length: each row's pages, staging and scores sit in its own slice of the shared
    tensors, padded to the longest row (the empty slots are masked), and the host keeps each row's counts.

    Layout per row: `n_pages` main pages, then `n_staging_pages`, then one scratch page, each `block_size`
    slots: `keys`/`values` `[rows, Hkv, slots, d]`, `slot_pos` `[rows, slots]` (-1: empty), `page_block`
    `[rows, pages]` (-1: free), `block_page` / `block_tier` `[rows, blocks]`, `token_scores` `[rows, positions]`.
    """

    def __init__(self, layer_idx: int, copies: DeferredCopies, positions: list | None = None,
                 targets: _TargetsByLength | None = None, recording: StepRecording | None = None,
                 step_masses: _StepMasses | None = None, step_plans: dict | None = None,
                 tables: _LayerTables | None = None):
        self.layer_idx, self.copies = layer_idx, copies
        self.recording = recording if recording is not None else StepRecording()  # the cache's, shared too
        self.step_masses = step_masses if step_masses is not None else _StepMasses(layer_idx + 1)  # and this
        # [(rows, lengths), (positions, lengths) on the device, the plan's lengths list they were made for] of the
        # last decode append, shared by the layers
        self.positions = positions if positions is not None else [None, None, None]
        self.targets = targets if targets is not None else _TargetsByLength()  # shared by the layers too
        # This forward's host plans (`_plan`), shared by the layers: cleared by the cache as each forward begins.
        self.step_plans = step_plans if step_plans is not None else {}
        # Every layer's token scores and importance, one tensor each (`_LayerTables`), and a decode step's
        # attention of every layer, scored and placed after the last layer's (`_after_attention_of_layers`).
        self.tables = tables if tables is not None else _LayerTables(layer_idx + 1)
        self.tables.layers.append(self)
        self.rows: list[RowState | None] = []
        self._rows_cache: tuple = ((), None, None)  # (rows as a tuple, their index, the list they came in)
        self._flat_rows: tuple = (None, None)  # (recalling rows and picks per row, the rows repeated per pick)
        self._score_plan: tuple = ((), [], False)  # (the last scored rows' states, rows that score, one call?)
        self._constants: tuple = (None, None)  # (the DDR store, `LayerEntry.constants` read with it)
        self.rows_hint = 0  # the batch size, when known: rows are allocated for it at once
        self.length_hint = (0, 0)  # (longest prompt, longest sequence), when known: pages are sized for them at once
        self.initialized = False
        self.n_pages = self.n_staging_pages = self.block_capacity = 0
        self.staged_pages = 0  # staging pages this step's recall filled (the last ones before the main pages)
        self.pads = None  # a left-padded prefill of several rows: each row's pad count (else None)

    # -- rows and storage ----------------------------------------------------------------------------------
    def reset_row(self, row: int, settings: TierSettings, recorder=None) -> None:
        while len(self.rows) <= row:
            self.rows.append(None)
        others = [r.spec for i, r in enumerate(self.rows) if r is not None and i != row]
        if any(spec != settings.spec for spec in others):
            raise UnsupportedBatch("the rows of a batch share one placement policy (only the scorer state is per "
                                   "sample); decode runs with different policies separately")
        self.rows[row] = RowState(settings, recorder)
        if self.targets.spec != settings.spec:
            self.targets.clear()
            self.targets.spec = settings.spec
        self.spec = settings.spec
        # (`_layers_share_plans` of a decode step, by whether the plan reads this step's recall: asked ~6 times
        # per layer and step)
        exact = counts_are_exact(self.spec)
        self._shares_plans = (exact, exact and self.spec.recall_rule == "quest")
        if self.initialized:
            self._grow_rows(len(self.rows))
            self._clear_row(row)

    def _init_storage(self, key_states: torch.Tensor) -> None:
        _, self.n_kv_heads, _, self.head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.block_size = self.spec.block_size
        self.offsets = torch.arange(self.block_size, device=self.device)
        self.n_rows = 0
        # K and V in one pool, [2, rows, Hkv, slots, d]: `keys` and `values` are its halves (each as contiguous as a
        # pool of its own, for attention), and a block's K and V move with one copy (recall, packing, offload)
        self._bind_kv(torch.zeros((2, 0, self.n_kv_heads, self.block_size, self.head_dim), dtype=self.dtype,
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
        self._grow_rows(len(self.rows))
        self._reserve_pages()

    def reserve_length(self, max_prompt: int, max_len: int) -> None:
        """Size the pools for sequences of up to `max_prompt` prompt tokens decoded to `max_len` tokens: the pages
        at the policy's peak (`traces.policy.peak_hbm_tokens`) and recall's staging pages, at once (as
        `tracer.run.kv_buffer_bytes` sized them), not grown as they fill: each growth copies the whole pool and,
        with more staging pages, shifts every row's main pages (on the micro model at B = 32, ~1.3% of a decode
        step, and a copy at the first recall). Beyond these (a promotion past its room) the pools still grow.
        The cache passes the longest so far (`TieredCache.reserve_length`); before the first update they wait."""
        self.length_hint = (max_prompt, max_len)
        if self.initialized:
            self._reserve_pages()

    def _reserve_pages(self) -> None:
        max_prompt, max_len = self.length_hint
        if max_len:
            self._ensure_blocks(max_len)
            pages = -(-peak_hbm_tokens(self.spec, max_prompt, max_len) // self.block_size)
            self._resize_pages(pages, max_recall_blocks(self.spec, max_len, self.n_kv_heads), slack=False)

    def _grow_rows(self, n_rows: int) -> None:
        """Room for `n_rows` rows: the batch size when the decode loop named it (`TieredCache.reserve_rows`),
        else doubling (a batch admits its rows one by one)."""
        if n_rows <= self.n_rows:
            return
        n_rows = max(n_rows, self.rows_hint or 2 * self.n_rows)
        extra = n_rows - self.n_rows

        def grown(tensor: torch.Tensor, fill) -> torch.Tensor:
            more = torch.full((extra, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=self.device)
            return torch.cat([tensor, more])

        self._bind_kv(torch.cat([self.kv, torch.zeros((2, extra, *self.kv.shape[2:]), dtype=self.dtype,
                                                      device=self.device)], 1))
        self.slot_pos, self.page_block, self.block_page = grown(self.slot_pos, -1), grown(self.page_block, -1), \
            grown(self.block_page, -1)
        self.next_slot = grown(self.next_slot, -1)
        self.block_tier = grown(self.block_tier, TIER_HBM)
        self.tables.reserve(n_rows, self.block_capacity * self.block_size, self.device)
        self.n_rows = n_rows
        self.ddr.reserve(n_rows, max(1, self.block_capacity))

    def _clear_row(self, row: int) -> None:
        """A refilled row starts empty (its previous sample's pages, tiers and scores are gone)."""
        self.slot_pos[row], self.page_block[row], self.block_page[row] = -1, -1, -1
        self.block_tier[row] = TIER_HBM
        self.ddr.bounds.clear(row)  # no block of the row is in DDR (recall's mask)
        self.token_scores[row], self.importance[row], self.importance_max[row] = 0, 0, 0

    def _resize_pages(self, pages: int, staging_pages: int, slack: bool = True) -> None:
        """At least `pages` main and `staging_pages` staging pages per row; what the pages hold is kept (the
        staging pages too: a placement may promote from them after a resize). More staging pages shift the main
        pages up, and the block tables and next slots with them: rare, as the recall count seldom grows."""
        if pages <= self.n_pages and staging_pages <= self.n_staging_pages:
            return
        # An eighth of slack amortises growth past what was reserved (attention reads only the pages in use:
        # packed, see `_pack`); a reservation (`reserve_length`) asks for what it needs.
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
        self._bind_kv(kv)
        slot_pos = torch.full((self.n_rows, total), -1, dtype=torch.long, device=self.device)
        slot_pos[:, target] = self.slot_pos[:, : old_pages * bs]
        page_block = torch.full((self.n_rows, staging_pages + pages + 1), -1, dtype=torch.long, device=self.device)
        page_block[:, shift : shift + old_pages] = self.page_block[:, :old_pages]
        if shift:
            self.block_page = torch.where(self.block_page >= 0, self.block_page + shift, -1)
            self.next_slot = torch.where(self.next_slot >= 0, self.next_slot + shift * bs, -1)
        self.slot_pos, self.page_block = slot_pos, page_block
        self.n_pages, self.n_staging_pages = pages, staging_pages

    def _ensure_blocks(self, positions: int) -> None:
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

    @property
    def scratch_page(self) -> int:
        return self.n_staging_pages + self.n_pages

    @property
    def main_slots(self) -> slice:
        """The main pages' slots (after the staging pages, before the scratch page)."""
        return slice(self.n_staging_pages * self.block_size, self.scratch_page * self.block_size)

    def _bind_kv(self, kv: torch.Tensor) -> None:
        self.kv, self.keys, self.values = kv, kv[0], kv[1]
        self._views: dict = {}  # (`_kept`: what was made from the pool it replaces goes with it)

    def _pages(self, name: str) -> torch.Tensor:
        """`kv` as [2, rows, Hkv, pages, block, d], `slot_pos` as [rows, pages, block] (views): a page is then one
        index, so moving a block indexes it once rather than once per slot."""
        tensor, bs = getattr(self, name), self.block_size
        if name == "slot_pos":
            return tensor.view(tensor.shape[0], -1, bs)
        return tensor.view(*tensor.shape[:3], -1, bs, tensor.shape[4])

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Slots of pages [...] -> [..., block_size] flattened on the last axis."""
        return (pages[..., None] * self.block_size + self.offsets).flatten(-2)

    def _plan(self, name: str, n_new: int, make, reads_recall: bool = False):
        """What the host derives from its rows' counts for `name` this forward: made by the forward's first layer
        and reused by the others (`step_plans`, which the cache clears as each forward begins), where every
        layer's rows hold the same counts: a decode step (one token per row) under a policy whose counts follow
        from the lengths (`counts_are_exact`: each layer then places alike), and, for a plan that `reads_recall`
        (this step's recalled blocks), the quest rule (the per-head rule's union differs by layer). Otherwise each
        layer makes its own. At B = 16 on a 28-layer model the per-row lists these are took ~60 us per layer and
        step."""
        if not self._layers_share_plans(n_new, reads_recall):
            return make()
        plan = self.step_plans.get(name)
        if plan is None:
            plan = self.step_plans[name] = make()
        return plan

    def _layers_share_plans(self, n_new: int, reads_recall: bool = False) -> bool:
        return n_new == 1 and self._shares_plans[reads_recall]

    # -- append (update) -----------------------------------------------------------------------------------
    def update(self, rows: list[int], key_states: torch.Tensor, value_states: torch.Tensor,
               new_tokens: list[int] | None = None) -> None:
        """Append each row's new K/V [rows, Hkv, n, d]. A multi-token forward of several rows is a prefill of fresh
        rows, left-padded to a common length: `new_tokens` gives each row's real count (its last ones)."""
        if not self.initialized:
            self._init_storage(key_states)
        n_new, bs = key_states.shape[-2], self.block_size
        states = [self.rows[r] for r in rows]
        self.pads = None
        if n_new > 1 and len(rows) > 1:
            if new_tokens is None or len(new_tokens) != len(rows) or any(s.logical_len for s in states):
                raise UnsupportedBatch(
                    "a multi-token forward of several rows prefills fresh rows, left-padded, with each row's "
                    "token count (TieredCache.set_active(rows, new_tokens)); otherwise one row at a time")
            counts = list(new_tokens)
            if min(counts) < n_new:  # (prompts of one length: no pads, scored in one call, one query start)
                self.pads = [n_new - n for n in counts]
        else:
            counts = [n_new] * len(rows)
        lengths, end, opened, pages, opening = self._plan("append", n_new, lambda: self._append_plan(states, counts))
        if end >= self.block_capacity * bs:  # (the blocks for `end` positions + the scratch one do not fit)
            self._ensure_blocks(end)
        if pages is not None:  # (only an opened block grows a row's resident count; promotion sizes its own)
            self._resize_pages(pages, self.n_staging_pages)
        rows_t = self._rows_tensor(rows)
        if n_new == 1:
            if opening:  # a new block takes the main page after the row's resident blocks (packed: `_pack`)
                open_rows = rows_t[opening] if len(opening) < len(rows) else rows_t
                new_blocks, free_page = host_to_device(
                    [[states[i].blocks() for i in opening],
                     [self.n_staging_pages + states[i].hbm_blocks() for i in opening]], self.device)
                self.page_block[open_rows, free_page] = new_blocks
                self.block_page[open_rows, new_blocks] = free_page
                self.next_slot[open_rows] = free_page * bs
            # (the layers append in lockstep: the first one's tensors serve them all; a shared plan's `lengths` is
            # the one list every layer of the step receives)
            if self.positions[2] is not lengths:
                key = (tuple(rows), tuple(lengths))
                if self.positions[0] != key:
                    last = self.positions[0]
                    if last is not None and last[0] == key[0] and tuple(n + 1 for n in last[1]) == key[1]:
                        positions = self.positions[1][1]  # the same rows one token on: the last lengths tensor
                    else:
                        positions = host_to_device(lengths, self.device)
                    self.positions[:2] = key, (positions, positions + 1)
                self.positions[2] = lengths
            positions, self.lengths = self.positions[1]
            selected = self._select(rows)
            slots = self.next_slot[selected]  # each row's next slot: in its current block's page
            if len(rows) == 1:  # one row: a copy along its slots (an advanced-index put costs ~2x here)
                row = rows[0]
                keys, values, slot_pos = self._kept("row", (row, torch.is_inference_mode_enabled()),
                                                    lambda: (self.keys[row], self.values[row], self.slot_pos[row]))
                keys.index_copy_(1, slots, key_states[0])
                values.index_copy_(1, slots, value_states[0])
                slot_pos.index_copy_(0, slots, positions)
            else:
                self.keys[rows_t, :, slots] = key_states[:, :, 0]
                self.values[rows_t, :, slots] = value_states[:, :, 0]
                self.slot_pos[rows_t, slots] = positions
            if isinstance(selected, slice):
                slots.add_(1)  # (a view of `next_slot`, read by the copies before, in stream order)
            else:
                self.next_slot[selected] += 1
        elif len(rows) > 1:
            self._append_prompts(rows, rows_t, key_states, value_states, counts, opened)
        else:
            row, state = rows[0], states[0]
            first, end = state.blocks(), state.blocks() + opened[0]
            if opened[0]:  # after the row's resident blocks (packed)
                pages = torch.arange(opened[0], device=self.device) + (self.n_staging_pages + state.hbm_blocks())
                self.page_block[row, pages] = torch.arange(first, end, device=self.device)
                self.block_page[row, first:end] = pages
            positions = torch.arange(state.logical_len, state.logical_len + n_new, device=self.device)
            slots = self.block_page[row, _block_of(positions, bs)] * bs + positions % bs
            self.keys[row].index_copy_(1, slots, key_states[0])
            self.values[row].index_copy_(1, slots, value_states[0])
            self.slot_pos[row].index_copy_(0, slots, positions)
            self.lengths = positions[-1:] + 1
            self.next_slot[row : row + 1] = slots[-1:] + 1  # a prompt ending on a block boundary opens the next
        self.staged_pages = 0  # this step's recall has not run yet
        for state, n in zip(states, counts, strict=True):
            state.query_start, state.logical_len = state.logical_len, state.logical_len + n
        if n_new > 1:  # (a decode step's recall sets every row's: `_recall`)
            for state in states:
                state.clear_recall()

    @staticmethod
    def _append_plan(states: list[RowState], counts: list[int]) -> tuple:
        """(the rows' lengths, the longest after the append, the blocks each opens, the main pages the rows then
        need or None when no block opens, the batch entries that open one)."""
        lengths = [s.logical_len for s in states]
        if counts[0] == 1:  # a decode step (every row one token): a row opens a block where its length is a multiple
            bs = states[0].spec.block_size
            opened = [0 if length % bs else 1 for length in lengths]
        else:
            opened = [n_blocks(s.spec, s.logical_len + n) - s.blocks() for s, n in zip(states, counts, strict=True)]
        opening = [i for i, o in enumerate(opened) if o]
        pages = max(s.hbm_blocks() + o for s, o in zip(states, opened, strict=True)) if opening else None
        return lengths, max(map(operator.add, lengths, counts)), opened, pages, opening

    def _append_prompts(self, rows, rows_t, key_states, value_states, counts: list[int], opened: list[int]) -> None:
        """Several fresh rows' prompts, left-padded to one length: row i's blocks take its first main pages and its
        `counts[i]` real tokens (the last ones of its batch entry) the slots from there on, in order; the pads are
        not stored. All rows in one index each (built on the host, from host-known counts)."""
        bs, first, row_ids = self.block_size, self.n_staging_pages, np.asarray(rows)
        length, real = key_states.shape[-2], np.asarray(counts)
        selected = self._select(rows)
        if isinstance(selected, slice) and (real == length).all():  # consecutive rows, no pads: strided copies
            # (B = 32 prompts of 128 tokens: ~5x faster than the token-indexed put below, on a CPU)
            slots = slice(first * bs, first * bs + length)
            self.keys[selected, :, slots], self.values[selected, :, slots] = key_states, value_states
            self.slot_pos[selected, slots] = torch.arange(length, device=self.device)
        else:
            entry, within = _ragged(real)  # each real token's batch entry and position
            tokens = host_to_device(np.stack([entry, within + np.repeat(length - real, real),
                                              row_ids[entry], first * bs + within, within]), self.device)
            self.keys[tokens[2], :, tokens[3]] = key_states[tokens[0], :, tokens[1]]
            self.values[tokens[2], :, tokens[3]] = value_states[tokens[0], :, tokens[1]]
            self.slot_pos[tokens[2], tokens[3]] = tokens[4]
        entry, within = _ragged(np.asarray(opened))  # each new block's batch entry and id
        pages = host_to_device(np.stack([row_ids[entry], first + within, within]), self.device)
        self.page_block[pages[0], pages[1]] = pages[2]
        self.block_page[pages[0], pages[2]] = pages[1]
        # Each row's length, next slot, and the position of its batch entry's first (padded) query: -pads.
        ends = host_to_device(np.stack([real, first * bs + real, real - length]), self.device)
        self.lengths, self.next_slot[rows_t], self.query_starts = ends[0], ends[1], ends[2]

    # -- recall, attention, scoring, placement (the attention function calls this) -------------------------
    def attend(self, rows: list[int], query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Recall for the rows' current queries, attend their pages + recalled blocks, then score, record and
        place. Returns the attention output [rows, lq, Hq, d]."""
        states = [self.rows[r] for r in rows]
        rows_t = self._rows_tensor(rows)
        # Whether this step's layers are scored and placed together, after the last one (`_layers_alike`)
        together = self._layers_share_plans(query.shape[-2], reads_recall=True) and self._plan(
            "layers", 1, lambda: self._layers_alike(rows, states), reads_recall=True)
        hidden = self._recall(rows, states, rows_t, query, together) if query.shape[-2] == 1 else None
        # The slots in use, one range: the staging pages this step's recall filled (the last `staged_pages`),
        # then the main pages up to the fullest row's resident blocks (packed at the front).
        bs, staging = self.block_size, self.n_staging_pages
        resident = self._plan("resident", query.shape[-2], lambda: max(s.hbm_blocks() for s in states))
        used = slice((staging - self.staged_pages) * bs, (staging + resident) * bs)
        keys, values, slot_pos, empty_slots = self._attended(
            self._select(rows), used, query.dtype if query.shape[-2] == 1 else None)
        query_start = states[0].query_start if self.pads is None else self.query_starts  # per row when padded
        # (layers placed together hand back their weights per head: `_after_attention_of_layers` reduces them all)
        output, weights_mean, weights_max = attend(query, keys, values, scaling, slot_pos, query_start,
                                                   None if hidden is None else hidden[:, :, used],
                                                   reduce_heads=not together, empty_slots=empty_slots)
        if together:
            self.tables.pending.append(
                (self, rows, states, rows_t, weights_mean, weights_max, keys, values, slot_pos))
            if self.layer_idx == self.tables.n_layers - 1:  # the step's last layer has attended
                self.tables.run_pending()
        else:
            self._after_attention(rows, states, rows_t, weights_mean, weights_max, keys, values, slot_pos)
        return output

    def _kept(self, name: str, key: tuple, make):
        """`make()`, kept under `name` while `key` recurs and the pools stay (`_bind_kv` drops them all, and a new
        `slot_pos` each): the views a decode step reads and writes step after step, made once rather than by a few
        view ops per call and layer (~1 us each on a CPU). `key` holds plain values (ints, dtypes, flags), and the
        grad mode where the views are written (a view made under inference mode is written only under it)."""
        kept = self._views.get(name)
        if kept is None or kept[0] != key or kept[1] is not self.slot_pos:
            kept = self._views[name] = (key, self.slot_pos, make())
        return kept[2]

    def _attended(self, selected: slice | torch.Tensor, used: slice, dtype: torch.dtype | None
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
        keys, values, slot_pos = self._kept("attended", key, read)
        if dtype is None:
            return keys, values, slot_pos, None
        # (one made under inference mode holds an inference tensor: kept per mode)
        empty_slots = self._kept("empty slots", (*key, dtype, torch.is_inference_mode_enabled()),
                                 lambda: EmptySlots(slot_pos, self.n_kv_heads, dtype))
        return keys, values, slot_pos, empty_slots

    def _rows_tensor(self, rows: list[int]) -> torch.Tensor:
        """`rows` as a device tensor, made once per set of rows (a step's rows are every layer's)."""
        return self._rows_index(rows)[0]

    def _select(self, rows: list[int]) -> slice | torch.Tensor:
        """Index of `rows` into the shared tensors: a slice (a view, no gather) when they are consecutive, as a
        full batch or one row is, else a tensor."""
        return self._rows_index(rows)[1]

    def _rows_index(self, rows: list[int]) -> tuple[torch.Tensor, slice | torch.Tensor]:
        if self._rows_cache[2] is rows:  # (the cache passes one list per set of rows: `TieredCache.set_active`)
            return self._rows_cache[1]
        key = tuple(rows)
        if self._rows_cache[0] != key:
            tensor = host_to_device(rows, self.device)
            consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
            self._rows_cache = (key, (tensor, slice(rows[0], rows[0] + len(rows)) if consecutive else tensor), rows)
        else:
            self._rows_cache = (*self._rows_cache[:2], rows)
        return self._rows_cache[1]

    def _recall(self, rows, states, rows_t, query, together: bool = False) -> torch.Tensor | None:
        """Copy each recalling row's DDR blocks for its query into its staging pages (one gather for all rows);
        returns the per-head rule's hidden-key mask [rows, Hkv, slots] (None for quest). The ids recalled reach the
        trace in the step's copy: this layer's added to it here, or, for layers placed `together`, every layer's
        at once after the last (`_after_attention_of_layers`)."""
        spec, bs = self.spec, self.block_size
        batch_index, wanted, n_blocks_max, recall_rows = self._plan("recall", 1, lambda: self._recall_plan(rows, states))
        every_row = len(batch_index) == len(rows)
        if not every_row:  # the rows that recall nothing this step
            recalling = set(batch_index)
            for i, state in enumerate(states):
                if i not in recalling:
                    state.clear_recall()
        if not batch_index:
            return None
        rec_rows = rows_t if every_row else rows_t[batch_index]
        rec_query = query if every_row else query[batch_index]
        selected = self._select(rows) if every_row else rec_rows  # a view when the rows are consecutive
        group = query.shape[1] // self.n_kv_heads
        q = rec_query.reshape(len(batch_index), self.n_kv_heads, group, self.head_dim)  # (one query: [m, Hq, 1, d])
        bounds = self.ddr.bounds.logit_bounds(q, selected, n_blocks_max)  # [m, Hkv, group, blocks]: Quest's bound
        k_max = max(wanted)
        if spec.recall_rule != "quest":
            ranks = torch.arange(k_max, device=self.device)
            counts_t = host_to_device(wanted, self.device)
        head_picks = None
        if spec.recall_rule == "quest":
            # (every block outside DDR is bounded at the dtype's lowest value: below any DDR block, never picked)
            best = bounds.flatten(1, 2).amax(1)
            # By bound, highest first: a row's first `wanted` are its picks (the selection below keeps them), in
            # that order (the trace records them sorted; attention reads them as a set).
            ids = best.topk(k_max, dim=1).indices
            per_row = wanted
        else:  # quest-per-head: each KV head its own top blocks; the union is copied
            in_ddr = self.ddr.bounds.in_ddr(selected, n_blocks_max)
            per_head = bounds.amax(2).transpose(1, 2)  # [m, blocks, Hkv] (outside DDR: the lowest value)
            top = per_head.topk(k_max, dim=1).indices  # [m, k_max, Hkv]
            picks = torch.zeros_like(per_head, dtype=torch.bool)
            picks.scatter_(1, top, (ranks < counts_t[:, None])[:, :, None].expand_as(top))
            picks &= in_ddr[:, :, None]
            union = picks.any(2)
            per_row = union.sum(1).tolist()  # the union's size is data-dependent: one read-back per layer
            ids = torch.argsort((~union).to(torch.int8), dim=1, stable=True)[:, : max(per_row)]
            head_picks = picks.gather(1, ids[:, :, None].expand(-1, -1, self.n_kv_heads))
        # The valid picks of every row, flattened: their count per row is known here, so the selection is built
        # on the host and nothing is read back.
        width = ids.shape[1]  # (the most picks of any row)
        if width > self.n_staging_pages:
            self._resize_pages(self.n_pages, width)
        key = (recall_rows, width)
        if self._flat_rows[0] != key:  # each recalling row once per pick (the same rows recall alike, step by step)
            self._flat_rows = (key, rec_rows.repeat_interleave(width))
        flat_rows, flat_ids = self._flat_rows[1], ids.reshape(-1)
        uneven_picks = min(per_row) < width  # some rows recall fewer blocks than the widest
        select = None
        if uneven_picks:
            select = host_to_device(_flat_selection(tuple(per_row), width)[0], self.device)
            flat_rows, flat_ids = flat_rows[select], flat_ids[select]
        one_row = rows[batch_index[0]] if len(batch_index) == 1 else None  # (host-known: no row offsets to add)
        n_flat = flat_ids.shape[0]
        # A row's j-th recalled block goes to staging page S - width + j (the last `width` staging pages, next
        # to the main pages, so that attention reads one range of slots), whole pages at a time.
        self.staged_pages, first_page = width, self.n_staging_pages - width
        if uneven_picks or not every_row:  # pages this recall leaves unfilled are attended: empty them first
            self._pages("slot_pos")[self._select(rows), first_page : first_page + width] = -1
        staging = _staging_pages(tuple(per_row), width, first_page, str(self.device)) \
            if uneven_picks or spec.recall_rule != "quest" or not isinstance(selected, slice) else None
        if staging is None:  # consecutive rows, `width` blocks each: one strided copy per tensor, no index
            pages = slice(first_page, first_page + width)
            staged_kv, staged_pages, staged_pos = self._staged(selected, one_row, pages)
            if staged_kv is not None:  # one row: gathered into its pages directly
                n_bytes = self.ddr.get_into(one_row, flat_ids, staged_kv)
            elif staged_pages is not None:  # several rows: each staging page gathered into directly
                n_bytes = self.ddr.get_pages_into(rec_rows, ids, staged_pages)
            else:
                blocks, n_bytes = self._get_blocks(flat_rows, flat_ids, one_row)
                self._pages("kv")[:, selected, :, pages] = blocks.view(len(batch_index), width, *blocks.shape[1:]) \
                    .permute(2, 0, 3, 1, 4, 5)
            # block b holds positions b * bs + offsets: written in place, one kernel (a gather and a copy took ~2x)
            torch.add(self.offsets, ids.view(*ids.shape, 1), alpha=bs, out=staged_pos)
        else:  # (the two advanced indices, apart, lead the result: [n, 2, Hkv, block, d], the blocks' layout)
            blocks, n_bytes = self._get_blocks(flat_rows, flat_ids, one_row)
            self._pages("kv")[:, flat_rows, :, staging] = blocks
            self._pages("slot_pos")[flat_rows, staging] = torch.add(self.offsets, flat_ids[:, None], alpha=bs)
        block_bytes = n_bytes // max(1, n_flat)
        # every row's ids in one copy (this layer's, or every layer's together: filled in after the last)
        recorded = self.recalled_ids = _LayerIds(flat_ids) if together else self.copies.add(flat_ids, _as_int64)
        start = 0
        for position, (i, n) in enumerate(zip(batch_index, per_row, strict=True)):
            state = states[i]
            state.recalled_blocks, state.bytes_h2d = n, n * block_bytes
            state.recalled = (flat_ids, recorded, start, n)
            if head_picks is not None:
                state.head_picks = head_picks[position, :n]
            start += n
        if head_picks is None:
            return None
        hidden = torch.zeros(len(rows), self.n_kv_heads, self.keys.shape[2], dtype=torch.bool, device=self.device)
        flat_picks = head_picks.reshape(-1, self.n_kv_heads)  # [n_flat, Hkv]
        batch_of = host_to_device(batch_index, self.device).repeat_interleave(width)
        if isinstance(select, torch.Tensor):
            flat_picks, batch_of = flat_picks[select], batch_of[select]
        hidden.view(len(rows), self.n_kv_heads, -1, bs)[batch_of, :, staging] = ~flat_picks[:, :, None]
        return hidden

    def _staged(self, selected: slice, one_row: int | None, pages: slice
                ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, torch.Tensor]:
        """Views of the staging `pages` of the `selected` rows that recall writes: one row's K and V as the store's
        block layout ([width, 2, Hkv, block, d], for `get_into`; None for several rows), several rows' pages one by
        one in that layout ([rows, 2, Hkv, block, d] each, for `get_pages_into`, on a CPU; None for one row), both None for a
        store without them; and their slot positions [rows, width, block]; kept while the rows and pages recur
        (step after step)."""
        def make():
            staged_kv = staged_pages = None
            kv = self._pages("kv")  # [2, rows, Hkv, pages, block, d] -> the block layout
            if one_row is not None and hasattr(self.ddr, "get_into"):
                staged_kv = kv[:, one_row, :, pages].permute(2, 0, 1, 3, 4)
            elif one_row is None and self.device.type == "cpu" and hasattr(self.ddr, "get_pages_into"):
                # (on a CPU the gather and a copy are each a memory-bound pass; on a GPU a gather per page would
                # launch width - 1 more kernels to save one copy of a few MB, a microsecond of bandwidth)
                staged_pages = [kv[:, selected, :, page].transpose(0, 1) for page in range(pages.start, pages.stop)]
            return staged_kv, staged_pages, self._pages("slot_pos")[selected, pages]

        return self._kept("staging", (selected.start, selected.stop, one_row, pages.start, pages.stop,
                                      torch.is_inference_mode_enabled()), make)

    def _get_blocks(self, rows: torch.Tensor, block_ids: torch.Tensor, row: int | None) -> tuple[torch.Tensor, int]:
        """The DDR blocks (`rows`, `block_ids`) on the device as [n, 2, Hkv, block, d] (K and V side by side, as the
        pool holds them) and the bytes copied H2D: as stored (a block store's `get_blocks`) or stacked from `get`
        (a store that dequantizes, tracer.quant). On a CPU a block store gathers into a kept buffer (`workspace`:
        the caller copies them into its pages at once)."""
        if hasattr(self.ddr, "get_blocks"):
            out = workspace("recalled blocks", (block_ids.shape[0], 2, self.n_kv_heads,
                                                self.block_size, self.head_dim), self.kv.dtype, self.device)
            return self.ddr.get_blocks(rows, block_ids, row, out=out)
        keys, values, n_bytes = self.ddr.get(rows, block_ids, row)
        return torch.stack([keys, values], 1), n_bytes

    @staticmethod
    def _recall_plan(rows: list[int], states: list[RowState]) -> tuple:
        """(the batch entries that recall, the blocks each wants, the most blocks any of them has, their row ids)."""
        wanted = [min(recall_blocks(s.spec, s.logical_len), s.n_ddr_blocks) for s in states]
        batch_index = [i for i, k in enumerate(wanted) if k > 0]
        if not batch_index:
            return (), (), 0, ()
        return (batch_index, tuple(wanted[i] for i in batch_index), max(states[i].blocks() for i in batch_index),
                tuple(rows[i] for i in batch_index))

    def _after_attention(self, rows, states, rows_t, weights_mean, weights_max, keys, values, slot_pos):
        """Score, record and place after this layer's attention (a decode step of layers alike does it for every
        layer at once: `_after_attention_of_layers`)."""
        lengths = self.lengths  # [rows]: each row's logical length (made by `update`, which just ran for these rows)
        valid = slot_pos >= 0  # the slots holding an entry (the scorers'; attention makes its own mask)
        # Empty slots (weight 0) point at each row's scratch position, one past its last token.
        positions = torch.where(valid, slot_pos, lengths[:, None])
        self._score(rows, states, rows_t, lengths, positions, weights_mean, weights_max, keys, values, valid)
        query_tokens = weights_mean.shape[1]
        placing, decoding, recording, host, mass_key = self._plan(
            "after", query_tokens, lambda: self._after_plan(rows, states, query_tokens), reads_recall=True)
        if len(placing) < len(states):
            for state in states:
                if state.defer_placement:  # a prefill chunk before the last: scored, not placed nor recorded
                    state.deferred_query_tokens += query_tokens
        if not placing:
            return
        if decoding:
            self._add_importance(rows, rows_t, decoding, positions, weights_mean, weights_max)
        masses = self._occupancy(mass_key, weights_mean[:, -1], positions) if recording else None
        self._place_and_record(rows, states, placing, recording, host, masses, query_tokens)

    def _add_importance(self, rows, rows_t, decoding: list[int], positions, weights_mean, weights_max) -> None:
        """Add the last query's attention (mean and max over heads) of the batch entries `decoding` to their rows'
        importance."""
        selected = self._select(rows)
        if len(decoding) == len(rows) and isinstance(selected, slice):  # the rows' slice: in place
            self.importance[selected].scatter_add_(1, positions, weights_mean[:, -1])
            self.importance_max[selected].scatter_add_(1, positions, weights_max[:, -1])
        else:
            index = host_to_device(decoding, self.device)
            target_rows = rows_t[index].repeat_interleave(positions.shape[1])
            at = positions[index].reshape(-1)
            self.importance.index_put_((target_rows, at), weights_mean[index, -1].reshape(-1), accumulate=True)
            self.importance_max.index_put_((target_rows, at), weights_max[index, -1].reshape(-1), accumulate=True)

    def _place_and_record(self, rows, states, placing, recording, host, masses, query_tokens: int) -> None:
        moves = self._place(rows, states, placing, query_tokens)
        # (This step's staging pages keep their entries: attention reads only the staging pages its own step's
        # recall filled, `staged_pages`, reset by `update`, so a stale page is never attended nor cleared.)
        errors = self._quant_errors(rows, moves)
        if recording:
            # The rows' host counts and device values (masses, moved and recalled ids, quantization errors),
            # resolved with every other layer's at step end (tracer.recorder.StepRows).
            row_ids, host = host
            n = len(recording)
            recorded = states if n == len(states) else [states[i] for i in recording]
            if moves:
                moved = [moves.get(rows[i]) for i in recording]
                bytes_d2h = [0 if m is None else m[2] for m in moved]
            else:  # (most steps place nothing: the shared per-row "nothing", as the recorder checks it)
                moved, bytes_d2h = repeated(None, n), repeated(0, n)
            entry = LayerEntry(
                self._entry_constants(), host, bytes_d2h, masses, self.layer_idx, None if n == len(rows) else recording,
                [s.recalled for s in recorded], moved,
                [errors.get(rows[i]) for i in recording] if errors else repeated(None, n))
            self.recording.add(row_ids, recorded, entry)
        for i in placing:
            state = states[i]
            state.deferred_query_tokens = 0
            state.step = self._step(state) + 1

    def _layers_alike(self, rows: list[int], states: list[RowState]) -> bool:
        """Whether this decode step's layers (whose host plans are shared: `_plan`) are scored, recorded and placed
        together after the last one has attended (`_after_attention_of_layers`): the rows are every row of the
        tables (so that [layers, rows] flattens to one axis as a view), none defers its placement, and they are
        scored by one scorer that only adds the weights (H2O) or by none."""
        active, shared = self._scoring(states)
        if active:
            scorer = states[active[0]].settings.scorer
            if not (shared and len(active) == len(rows) and scorer.adds_weights_only):
                return False
        return rows == list(range(self.tables.tensors[0].shape[1])) and not any(s.defer_placement for s in states)

    def _after_plan(self, rows: list[int], states: list[RowState], query_tokens: int) -> tuple:
        """(the batch entries that place (a prefill chunk before the last does not), those that add this step's
        attention to their importance, those that record; the recording rows' host counts at attention time (after
        recall, before placement: a tuple of `tracer.recorder.HOST_FIELDS` each) with their row ids; the step's
        mass tensor key and width (`_StepMasses`); both None when no row records)."""
        placing = [i for i, s in enumerate(states) if not s.defer_placement]
        decoding = [i for i in placing if query_tokens == 1 and self._step(states[i]) > 0
                    and states[i].settings.track_importance]
        recording = [i for i in placing if states[i].recorder is not None]
        if not recording:
            return placing, decoding, recording, None, None
        host = [(s.logical_len - s.query_start + s.deferred_query_tokens, s.logical_len, s.blocks(),
                 s.n_ddr_blocks, s.n_evicted_blocks, s.recalled_blocks, s.bytes_h2d)
                for s in (states[i] for i in recording)]
        # (every batch entry's attention is scattered, recorded or not: the width covers every row's blocks, and
        # a scratch position, the row's length, falls in its block count's column)
        lengths = [s.logical_len for s in states]
        mass_key = ((tuple(rows), tuple(lengths)), n_blocks(self.spec, max(lengths)) + 1)
        return placing, decoding, recording, (tuple(rows[i] for i in recording), host), mass_key

    def _entry_constants(self) -> tuple[int, int, int, int]:
        """`LayerEntry.constants` (layer, block size, KV bytes of an HBM token, bytes of a DDR block), kept with
        the DDR store they were read from (a refilled row may bring another)."""
        if self._constants[0] is not self.ddr:
            self._constants = (self.ddr, (self.layer_idx, self.block_size, self.token_bytes, self.ddr.block_bytes()))
        return self._constants[1]

    @staticmethod
    def _step(state: RowState) -> int:
        return state.recorder.step if state.recorder is not None else state.step

    def _scoring(self, states: list[RowState]) -> tuple[list[int], bool]:
        """(the batch entries that score, whether they share one scorer call)."""
        cached_states, active, shared = self._score_plan
        if len(cached_states) != len(states) or not all(map(operator.is_, cached_states, states)):
            # Decided once per set of rows (the same states step after step): which rows score, and whether
            # they share one call. Rows whose scorers keep no per-sample state and have the same settings
            # share it; the others (oracle, gradient, AlsoScore) are scored one row at a time, with the same
            # code. Scorers are compared by identity and repr (they are dataclasses, and may hold tensors).
            scorers = [s.settings.scorer for s in states]
            active = [i for i, s in enumerate(states) if scorers[i] is not None and (
                s.spec.policy != "full" or getattr(scorers[i], "score_under_full", False))]
            first = scorers[active[0]] if active else None
            shared = bool(active) and first.batchable and all(
                type(scorers[i]) is type(first) and repr(scorers[i]) == repr(first) for i in active)
            self._score_plan = (list(states), active, shared)  # (kept alive here, so never a stale identity)
        return active, shared

    def _score(self, rows, states, rows_t, lengths, positions, weights_mean, weights_max, keys, values, valid):
        active, shared = self._scoring(states)
        if not active:
            return
        width, pads = self.token_scores.shape[1], self.pads
        # A left-padded prefill is scored row by row, on each row's real queries: a scorer that reads the last
        # queries (snapkv, rkv) then sees exactly what the row alone would.
        groups = [active] if shared and pads is None else [[i] for i in active]
        for group in groups:
            scorer = states[group[0]].settings.scorer
            if len(group) == len(rows) and pads is None:  # every row, unpadded: the tensors as they are
                observation = Observation(self.layer_idx, self._step(states[group[0]]), width, positions,
                                          weights_mean, weights_max, keys, values=values, valid=valid)
                selected, score_rows, score_lengths = self._select(rows), rows_t, lengths
            else:
                # (one row, as a padded prefill scores them: views of it, not gathers)
                index = slice(group[0], group[0] + 1) if len(group) == 1 else host_to_device(group, self.device)
                pad = 0 if pads is None else pads[group[0]]
                observation = Observation(
                    self.layer_idx, self._step(states[group[0]]), width, positions[index],
                    weights_mean[index][:, pad:], weights_max[index][:, pad:], keys[index], values=values[index],
                    valid=valid[index],
                )
                selected, score_rows, score_lengths = self._select([rows[i] for i in group]), rows_t[index], \
                    lengths[index]
            previous = self.token_scores[selected]  # a view for consecutive rows: in-place scorers write through
            scores = scorer.score(observation, previous)
            if scores is not previous or not isinstance(selected, slice):
                self.token_scores[selected] = scores[:, :width]
            if not scorer.adds_weights_only:  # the scratch positions (weight 0 added leaves them at 0)
                self.token_scores[score_rows, score_lengths] = 0.0

    def _occupancy(self, mass_key: tuple, last_weights: torch.Tensor, positions: torch.Tensor) -> Deferred:
        """The attention masses of every batch entry's blocks, in this layer's slice of the step's one tensor for
        every layer (`_StepMasses`, of `mass_key`'s key and width), which reaches the host in the step's one copy
        (`DeferredCopies`). Empty slots carry weight 0, so where their scratch position lands adds nothing. (A
        recalled block is in DDR, so its mass is that of its staged slots: the DDR mass is theirs, on the host.)"""
        block_mass, masses = self.step_masses.layer(self.copies, *mass_key, self.layer_idx, self.device)
        block_mass.scatter_add_(1, _block_of(positions, self.block_size), last_weights)
        return masses

    def _placement_plan(self, rows: list[int], states: list[RowState], placing: list[int]) -> tuple:
        """(plans: per row to place, (batch index, sink blocks, movable end, room, victims); the targets each
        meets; the plans as one [5, m] device tensor (one transfer: rows, sink blocks, movable end, room,
        victims); each such row's (offloaded, promoted, evicted from HBM, evicted from DDR) counts when the host
        knows them (`counts_are_exact`), else None; its resident blocks before placement)."""
        spec, targets = self.spec, self.targets
        plans, keys = [], []
        for i in placing:
            state = states[i]
            key = targets.get(state.logical_len)
            if key is None and state.logical_len not in targets:
                key = targets[state.logical_len] = _targets(spec, state.logical_len)
            if key is None:
                continue
            sink_blocks, movable_end, room, evict_target = key
            if key == state.placed_key and not (state.recalled_blocks and spec.promote):
                continue  # the targets have not moved since the last placement met them
            n_movable = movable_end - sink_blocks
            victims = min(max(0, evict_target - state.n_evicted_blocks), n_movable - state.n_evicted_blocks)
            plans.append((i, sink_blocks, movable_end, n_movable if room is None else min(room, n_movable), victims))
            keys.append(key)
        if not plans:
            return (), (), None, None, (), None
        plan_t = host_to_device([[rows[p[0]] for p in plans], *([p[k] for p in plans] for k in range(1, 5))],
                                self.device)
        # [m, blocks]: each row's movable blocks, sink_blocks <= id < movable_end (made here once for the layers)
        column = np.arange(max(p[2] for p in plans))
        in_range = host_to_device((column >= np.array([p[1] for p in plans])[:, None])
                                  & (column < np.array([p[2] for p in plans])[:, None]), self.device)
        counts = None
        if counts_are_exact(spec):  # no victims, no promotion: min(room, candidates) stay, the rest leave
            counts = []
            for i, sink_blocks, movable_end, room, _ in plans:
                state = states[i]
                hbm_movable = movable_end - sink_blocks - state.n_ddr_blocks - state.n_evicted_blocks
                leaving = hbm_movable - min(room, hbm_movable)
                counts.append((leaving, 0, 0, 0) if spec.uses_ddr else (0, 0, leaving, 0))
        return plans, keys, plan_t, counts, [states[plan[0]].hbm_blocks() for plan in plans], in_range

    def _place(self, rows: list[int], states: list[RowState], placing: list[int], query_tokens: int) -> dict:
        """Apply each row's targets (rows whose targets moved, or that may promote); returns per row id
        (promoted, offloaded, evicted) block ids (`Deferred` lists fetched at step end) and bytes copied D2H."""
        spec, bs = self.spec, self.block_size
        plans, keys, plan_t, counts, resident, in_range = self._plan(
            "place", query_tokens, lambda: self._placement_plan(rows, states, placing))
        if not plans:
            return {}
        for (i, *_), key in zip(plans, keys, strict=True):
            states[i].placed_key = key
        m, end = len(plans), max(p[2] for p in plans)
        place_rows, (room_t, victims_t) = plan_t[0], plan_t[3:, :, None]
        placed = [rows[p[0]] for p in plans]  # (consecutive rows, e.g. a whole batch placing: views, no gathers)
        select = slice(placed[0], placed[0] + m) if placed == list(range(placed[0], placed[0] + m)) else place_rows
        block_scores = self.token_scores[select, : end * bs].view(m, end, bs).sum(2)
        tier = self.block_tier[select, :end]
        was_hbm = (tier == TIER_HBM) & in_range
        # (a mask no block can be in under this policy is None: no kernel makes it, none reads it)
        evict_now = None
        if any(p[4] for p in plans):  # the lowest-scored alive blocks, as many as each row's target asks
            alive = (tier != TIER_EVICTED) & in_range
            evict_now = (_ranks(block_scores.masked_fill(~alive, float("inf")), descending=False) < victims_t) & alive
            tier = torch.where(evict_now, TIER_EVICTED, tier)
        # (without victims the tiers are as they were: the candidates are the blocks in HBM)
        candidates = was_hbm if evict_now is None and not spec.promote else (tier == TIER_HBM) & in_range
        if spec.promote:
            recalled = torch.zeros_like(candidates)
            for index, plan in enumerate(plans):
                ids = states[plan[0]].recalled_ids
                if ids is not None:
                    recalled[index, ids] = True
            candidates |= recalled & (tier == TIER_DDR)
        # The top `room` candidates by score (all of them when there are fewer), ranked on the device.
        keep = (_ranks(block_scores.masked_fill(~candidates, float("-inf")), descending=True) < room_t) & candidates
        demoted = candidates & ~keep & was_hbm
        promoted = None
        if spec.promote:  # (without promotion every candidate, so every kept block, is in HBM)
            promoted = keep & (tier == TIER_DDR)
            tier = torch.where(promoted, TIER_HBM, tier)
        tier = torch.where(demoted, TIER_DDR if spec.uses_ddr else TIER_EVICTED, tier).to(torch.int8)
        offloaded, evicted_from_hbm, evicted_from_ddr = demoted if spec.uses_ddr else None, None, None
        if not spec.uses_ddr:  # (demoted blocks were in HBM)
            evict_now = demoted if evict_now is None else evict_now | demoted
        if evict_now is not None:
            evicted_from_hbm = evict_now & was_hbm
            if spec.uses_ddr:  # (only victims can be DDR blocks)
                evicted_from_ddr = evict_now & ~was_hbm
        outcomes = (offloaded, promoted, evicted_from_hbm, evicted_from_ddr)  # move codes 1-4, in this order

        if counts is None:  # data-dependent counts: one read-back for this layer's placement, all rows together
            zero = torch.zeros(m, dtype=torch.long, device=self.device)
            counts = torch.stack([zero if mask is None else mask.sum(1) for mask in outcomes], dim=1).tolist()
        if offloaded is not None:
            bytes_d2h = self._offload(place_rows, offloaded, [c[0] for c in counts])
        else:
            bytes_d2h = [0] * m
        self._free_pages(place_rows, was_hbm & (tier != TIER_HBM), end)
        self._pack(place_rows, resident, [n - c[0] - c[2] for n, c in zip(resident, counts, strict=True)])
        if any(c[1] for c in counts):
            for index, (plan, c) in enumerate(zip(plans, counts, strict=True)):
                if c[1]:  # promotion can grow HBM (when it was under its room): pages for it first
                    state = states[plan[0]]
                    kept = state.hbm_blocks() - c[0] - c[2]
                    self._resize_pages(kept + c[1], self.n_staging_pages)
                    self._promote(rows[plan[0]], state, promoted[index], c[1], self.n_staging_pages + kept)
        self.block_tier[select, :end] = tier
        self.ddr.bounds.mark(place_rows, tier == TIER_DDR)  # recall's mask, kept with the tiers
        # What happened to each movable block, recorded through the step's one deferred copy.
        moves = None
        for code, mask in enumerate(outcomes, start=1):
            if mask is not None:
                term = mask.to(torch.int8) if code == 1 else code * mask.to(torch.int8)
                moves = term if moves is None else moves + term
        if moves is None:
            moves = torch.zeros((m, end), dtype=torch.int8, device=self.device)
        host = self.copies.add(moves, lambda a: a.astype(np.int8).reshape(m, -1))
        out = {}
        for index, ((i, *_), (n_off, n_promoted, n_ev_hbm, n_ev_ddr)) in enumerate(zip(plans, counts, strict=True)):
            state = states[i]
            state.n_ddr_blocks += n_off - n_promoted - n_ev_ddr
            state.n_evicted_blocks += n_ev_hbm + n_ev_ddr
            out[rows[i]] = (host, index, bytes_d2h[index])
        return out

    def _offload(self, place_rows: torch.Tensor, offloaded: torch.Tensor, counts: list[int]) -> list[int]:
        """Copy each row's offloaded blocks (mask [m, blocks], `counts` per row) from their pages to DDR in one
        scatter; returns the bytes per row."""
        total = sum(counts)
        if not total:
            return [0] * len(counts)
        width = max(counts)
        order = torch.argsort((~offloaded).to(torch.int8), dim=1, stable=True)[:, :width]  # ascending ids first
        select = host_to_device(_flat_selection(tuple(counts), width)[0], self.device)
        flat_rows = place_rows.repeat_interleave(width)[select]
        block_ids = order.reshape(-1)[select]
        pages = self.block_page[flat_rows, block_ids]
        # [n, 2, Hkv, bs, d]: each block's page, K and V, positions in order (the indices, apart, lead the result)
        blocks = self._pages("kv")[:, flat_rows, :, pages]
        if hasattr(self.ddr, "put_blocks"):
            n_bytes = self.ddr.put_blocks(flat_rows, block_ids, blocks)
        else:
            n_bytes = self.ddr.put(flat_rows, block_ids, blocks[:, 0], blocks[:, 1])
        return [n * (n_bytes // total) for n in counts]

    def _free_pages(self, place_rows: torch.Tensor, left: torch.Tensor, end: int) -> None:
        """Free the pages of the blocks that left HBM (mask [m, blocks]); the others write to the scratch page,
        so no count reaches the host."""
        pages = self.block_page[place_rows, :end]
        freed = torch.where(left, pages, self.scratch_page)
        rows = place_rows[:, None]
        self.page_block[rows, freed] = -1
        self._pages("slot_pos")[rows, freed] = -1
        self.block_page[place_rows, :end] = torch.where(left, -1, pages)

    def _pack(self, place_rows: torch.Tensor, before: list[int], after: list[int]) -> None:
        """Keep every row's resident blocks in its first main pages, so that attention reads only the pages in use
        (a pool sized by a long prompt would otherwise be read whole at every step after its blocks left): the
        blocks in pages at or above a row's new HBM count (`after`; `before` it held that many) move down into the
        pages its departed blocks freed, one block copy each, every row in one gather and one scatter. At most
        before - after blocks move per row; their number, data-dependent, stays on the device (the unused moves
        copy the scratch page onto itself)."""
        width = max(b - a for b, a in zip(before, after, strict=True))
        if width <= 0:
            return
        first, bs = self.n_staging_pages, self.block_size
        column = torch.arange(max(before), device=self.device)
        counts = host_to_device(after, self.device)[:, None]
        occupied = self.page_block[place_rows, first : first + column.shape[0]] >= 0
        above, holes = occupied & (column >= counts), ~occupied & (column < counts)
        source = torch.argsort((~above).to(torch.int8), dim=1, stable=True)[:, :width]
        target = torch.argsort((~holes).to(torch.int8), dim=1, stable=True)[:, :width]
        moving = above.gather(1, source)  # as many holes as blocks above: the j-th of each pair up
        source = torch.where(moving, source + first, self.scratch_page)
        target = torch.where(moving, target + first, self.scratch_page)
        rows = place_rows[:, None]
        pages = self._pages("kv")  # [2, rows, Hkv, pages, block, d]
        pages[:, rows, :, target] = pages[:, rows, :, source]
        slot_pos = self._pages("slot_pos")  # [rows, pages, block]
        slot_pos[rows, target] = slot_pos[rows, source]
        slot_pos[rows, source] = -1
        blocks = self.page_block[rows, source]  # -1 for the scratch page
        self.page_block[rows, target] = blocks
        self.page_block[rows, source] = -1
        shift = torch.where(moving, target - source, 0)
        self.block_page.index_put_((rows.expand_as(blocks), blocks.clamp_min(0)), shift, accumulate=True)
        next_slot = self.next_slot[place_rows]  # the row's current block may have moved: its next slot with it
        hit = moving & (source == _block_of(next_slot, bs)[:, None])
        self.next_slot[place_rows] = next_slot + (hit * shift).sum(1) * bs

    def _promote(self, row: int, state: RowState, promoted: torch.Tensor, n: int, first_page: int) -> None:
        """Move `n` promoted blocks of `row` from its staging pages into main pages `first_page`, ... (the pages
        after its resident blocks)."""
        block_ids = _first_true(promoted, n)
        staged = (state.recalled_ids[None, :] == block_ids[:, None]).to(torch.int8).argmax(1)  # staging order
        source = self._page_slots(self.n_staging_pages - self.staged_pages + staged)
        pages = torch.arange(first_page, first_page + n, device=self.device)
        target = self._page_slots(pages)
        self.kv[:, row].index_copy_(2, target, self.kv[:, row].index_select(2, source))
        self.slot_pos[row].index_copy_(0, target, self.slot_pos[row].index_select(0, source))
        self.page_block[row, pages] = block_ids
        self.block_page[row, block_ids] = pages

    def _quant_errors(self, rows: list[int], moves: dict) -> dict:
        """Where each row's blocks offloaded this step sit in the quantized tier's per-block errors (deferred):
        row id -> (errors, first, count)."""
        pop = getattr(self.ddr, "pop_block_errors", None)
        errors = None if pop is None else pop()
        if errors is None:
            return {}
        host = self.copies.add(errors, lambda a: a.astype(np.float64).reshape(-1, 2))
        out, start = {}, 0
        block_bytes = self.ddr.block_bytes()
        for row in rows:  # _offload stored the rows' blocks in this order
            if row not in moves or not moves[row][2]:
                continue
            n = moves[row][2] // block_bytes
            out[row] = (host, start, n)
            start += n
        return out

    # -- one row's view ----------------------------------------------------------------------------------
    def final_tiers(self, row: int) -> torch.Tensor:
        state = self.rows[row]
        return self.block_tier[row, : state.blocks()].repeat_interleave(self.block_size)[: state.logical_len]


def _after_attention_of_layers(entries: list[tuple]) -> None:
    """A decode step's scoring, importance and block masses for every layer at once, after its last layer has
    attended (`PagedLayer._layers_alike`): the layers' attention weights ([rows, Hq, 1, n] each, one n under the
    policies this runs for) stacked on a layer axis, reduced over the heads and added into the layers' tables (`_LayerTables`,
    [layers x rows, positions] views) and the step's mass tensor ([layers x batch entries, blocks + 1]) with one
    kernel each, not one per layer; then each layer places and records, in order. The same numbers as each
    layer's own `_after_attention`: a layer's scores, importance and masses are the sums of its own weights
    either way, and its placement (after its scoring) changes only its own next step. On the micro model at
    B = 1 this was ~4 % of a traced step; on a 28-layer model it removes ~6 of ~75 kernels per layer and step."""
    first, rows, states = entries[0][:3]
    layer_ids = [entry[0].recalled_ids for entry in entries if entry[0].staged_pages]  # (the layers that recalled)
    if layer_ids:  # every layer's recalled ids in one copy: [layers x recalled]
        ids = torch.cat([part.ids for part in layer_ids])
        deferred, base = first.copies.add(ids, _as_int64), 0
        for part in layer_ids:
            part.deferred, part.base = deferred, base
            base += part.ids.shape[0]
    if len(entries) != first.tables.n_layers or len({entry[8].shape[1] for entry in entries}) != 1:
        for layer, *args in entries:  # (layers that attended unlike: each its own)
            args[3:5] = head_mean_max(args[3])
            layer._after_attention(*args)
        return
    per_head, slot_pos = torch.stack([entry[4] for entry in entries]), torch.stack([entry[8] for entry in entries])
    weights_mean, weights_max = head_mean_max(per_head)  # [layers, rows, 1, n] each
    # An empty slot (weight exactly 0) points at position 0, not at its row's scratch position: the scorers run
    # here only add weights (`_layers_alike`), and so do importance and masses, and adding 0 changes nothing.
    positions = slot_pos.clamp_min(0).flatten(0, 1)  # [layers x rows, n]
    weights_mean, weights_max = weights_mean.flatten(0, 1), weights_max.flatten(0, 1)
    active, _ = first._scoring(states)
    token_scores, importance, importance_max = (tensor.flatten(0, 1) for tensor in first.tables.tensors)
    if active:  # one scorer that adds the weights: in place
        scorer = states[active[0]].settings.scorer
        observation = Observation(None, first._step(states[active[0]]), token_scores.shape[1], positions,
                                  weights_mean, weights_max, None)
        scores = scorer.score(observation, token_scores)
        if scores is not token_scores:
            token_scores.copy_(scores[:, : token_scores.shape[1]])
    placing, decoding, recording, host, mass_key = first._plan(
        "after", 1, lambda: first._after_plan(rows, states, 1), reads_recall=True)
    if len(decoding) == len(rows):
        importance.scatter_add_(1, positions, weights_mean[:, -1])
        importance_max.scatter_add_(1, positions, weights_max[:, -1])
    elif decoding:
        for index, (layer, layer_rows, _, rows_t, *_) in enumerate(entries):
            part = slice(index * len(rows), (index + 1) * len(rows))
            layer._add_importance(layer_rows, rows_t, decoding, positions[part], weights_mean[part], weights_max[part])
    masses = None
    if recording:
        _, masses = first.step_masses.layer(first.copies, *mass_key, 0, first.device)
        first.step_masses.tensor.flatten(0, 1).scatter_add_(1, _block_of(positions, first.block_size), weights_mean[:, -1])
    for layer, layer_rows, layer_states, *_ in entries:
        layer._place_and_record(layer_rows, layer_states, placing, recording, host, masses, 1)


def _as_int64(array: np.ndarray) -> np.ndarray:
    return array.astype(np.int64)


class _LayerIds:
    """One layer's recalled ids (`ids`, on the device) as part of the one copy of every layer's that
    `_after_attention_of_layers` adds (`deferred`, from `base` on): a `Deferred` of this layer's part, so that
    the rows that recalled need not be visited again."""

    __slots__ = ("ids", "deferred", "base")

    def __init__(self, ids: torch.Tensor):
        self.ids, self.deferred, self.base = ids, None, 0

    def value(self) -> np.ndarray:
        return self.deferred.value()[self.base : self.base + self.ids.shape[0]]


class _StepMasses:
    """A step's block masses for every layer of a cache: one zeroed [layers, batch entries, blocks + 1] float32
    tensor, added to the step's copy once, into whose slice each recording layer scatters its attention (not a
    tensor and a copy per layer). A new one per forward: `key` (the rows and their lengths) changes with every
    forward, as each appends; `width` (blocks + 1) follows from the lengths."""

    def __init__(self, n_layers: int):
        self.n_layers, self.key, self.tensor, self.deferred = n_layers, None, None, None

    def layer(self, copies: DeferredCopies, key: tuple, width: int, layer_idx: int, device
              ) -> tuple[torch.Tensor, Deferred]:
        if key != self.key or copies.fetched_since(self.deferred):
            shape = (self.n_layers, len(key[0]), width)  # [layers, batch entries, blocks + 1]
            self.tensor = torch.zeros(shape, dtype=torch.float32, device=device)
            self.deferred = copies.add(self.tensor, lambda a, shape=shape: a.reshape(shape))
            self.key = key
        return self.tensor[layer_idx], self.deferred


class _LayerTables:
    """Every layer's token scores, importance and max importance, one [layers, rows, positions] float32 tensor each
    (a layer's `token_scores` etc. are its views, rebound when the tables grow), so that a decode step adds every
    layer's attention with one kernel each (`_after_attention_of_layers`); and that step's per-layer
    attention results (`pending`), held until the last layer has attended."""

    NAMES = ("token_scores", "importance", "importance_max")

    def __init__(self, n_layers: int):
        self.n_layers, self.layers, self.tensors, self.pending = n_layers, [], None, []

    def run_pending(self) -> None:
        """Score, record and place the layers that attended and wait (`_after_attention_of_layers`)."""
        if self.pending:
            entries, self.pending = self.pending, []
            _after_attention_of_layers(entries)

    def reserve(self, rows: int, width: int, device) -> None:
        if self.tensors is not None and rows <= self.tensors[0].shape[1] and width <= self.tensors[0].shape[2]:
            return
        old = self.tensors
        if old is not None:
            rows, width = max(rows, old[0].shape[1]), max(width, old[0].shape[2])
        self.tensors = [torch.zeros((self.n_layers, rows, width), dtype=torch.float32, device=device)
                        for _ in self.NAMES]
        for new, previous in zip(self.tensors, old or (), strict=False):
            new[:, : previous.shape[1], : previous.shape[2]] = previous
        for layer in self.layers:
            for name, tensor in zip(self.NAMES, self.tensors, strict=True):
                setattr(layer, name, tensor[layer.layer_idx])


class _TargetsByLength(dict):
    """length -> `_targets(spec, length)` for one placement policy (`spec`; cleared when it changes)."""

    spec: PolicySpec | None = None


def _targets(spec: PolicySpec, length: int) -> tuple[int, int, int | None, int] | None:
    """(sink blocks, movable end, room, eviction target) at this length, or None when nothing can move: the
    policy contract's targets (traces/policy.py), which depend on the length alone (a cache's layers keep them
    by length, `_TargetsByLength`: every row of every layer asks at every step)."""
    evict_target = evict_target_blocks(spec, length)
    if hbm_target_tokens(spec, length) is None and evict_target == 0:
        return None
    sink_blocks, movable_end = movable_range(spec, length)
    if movable_end <= sink_blocks:
        return None
    return sink_blocks, movable_end, room_blocks(spec, length), evict_target


@functools.lru_cache(maxsize=4096)
def _staging_pages(counts: tuple[int, ...], width: int, first_page: int, device: str) -> torch.Tensor:
    """The staging page of each recalled block (`_flat_selection`'s order): `first_page` + its index within its
    row, on the device (cached: the same recall counts recur step after step)."""
    return host_to_device(_flat_selection(counts, width)[1] + first_page, device)


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `counts[i]` entries each, laid end to end: each entry's row and its index within the row."""
    total = int(counts.sum())
    return np.repeat(np.arange(len(counts)), counts), np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


@functools.lru_cache(maxsize=4096)
def _flat_selection(counts: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `width` entries of which the first `counts[i]` are wanted: their flat indices, and each
    one's index within its row (built on the host from host-known counts: nothing is read back; cached, as
    the same counts recur step after step). Read-only arrays."""
    within = np.arange(width)
    wanted = within[None, :] < np.asarray(counts)[:, None]
    flat = (np.arange(len(counts))[:, None] * width + within)[wanted]
    return flat, np.broadcast_to(within, wanted.shape)[wanted]


def _ranks(values: torch.Tensor, descending: bool) -> torch.Tensor:
    """Each entry's rank within its row [m, n] (0 = first), ties by position: a per-row top-k whose k differs
    by row is `rank < k`."""
    order = torch.argsort(values, dim=1, descending=descending, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(values.shape[1], device=values.device).expand_as(order))
    return ranks


class TieredLayer(DynamicLayer):
    """One row of one `PagedLayer`, shaped like a batch-1 cache layer: what HF, the tokens table, the
    gradient scorer and tests read for one sequence (`TieredCache.layers` at batch 1 are row 0's)."""

    def __init__(self, paged: PagedLayer, row: int):
        super().__init__()
        self.paged, self.row = paged, row
        self.layer_idx = paged.layer_idx
        self.is_initialized = True

    @property
    def state(self) -> RowState:
        return self.paged.rows[self.row]

    def __getattr__(self, name):  # the row's host state (logical_len, n_ddr_blocks, step, defer_placement, ...)
        if name in ("paged", "row", "state") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.paged.rows[self.row], name)

    def __setattr__(self, name, value):
        if name in ("defer_placement",):
            setattr(self.paged.rows[self.row], name, value)
        else:
            super().__setattr__(name, value)

    @property
    def n_hbm(self) -> int:
        state = self.state
        return state.logical_len - (state.n_ddr_blocks + state.n_evicted_blocks) * self.paged.block_size

    @property
    def hbm_blocks(self) -> int:
        return self.state.hbm_blocks()

    @property
    def n_pages(self) -> int:
        return self.paged.n_pages

    @property
    def main_slots(self) -> slice:
        return self.paged.main_slots

    keys_buf = property(lambda self: self.paged.keys[self.row : self.row + 1])
    values_buf = property(lambda self: self.paged.values[self.row : self.row + 1])
    slot_pos = property(lambda self: self.paged.slot_pos[self.row])
    page_block = property(lambda self: self.paged.page_block[self.row])
    block_page = property(lambda self: self.paged.block_page[self.row])
    block_tier = property(lambda self: self.paged.block_tier[self.row])
    token_scores = property(lambda self: self.paged.token_scores[self.row])
    importance = property(lambda self: self.paged.importance[self.row])
    importance_max = property(lambda self: self.paged.importance_max[self.row])
    ddr = property(lambda self: RowStore(self.paged.ddr, self.row))

    @property
    def ddr_ids(self) -> torch.Tensor:
        """Sorted ids of the blocks whose home is DDR (reads the device: for tests and tools, not the step)."""
        return (self.block_tier[: self.state.blocks()] == TIER_DDR).nonzero().squeeze(1)

    @property
    def hidden_keys(self) -> torch.Tensor | None:
        """The per-head rule's mask for this step's staged slots [Hkv, recalled slots] (True: not attended)."""
        picks = self.state.head_picks
        return None if picks is None else ~picks.t().repeat_interleave(self.paged.block_size, dim=1)

    def get_seq_length(self) -> int:
        return self.n_hbm if self.paged.initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("the tiered cache cannot be cropped (no assisted/speculative decoding)")

    def resident_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [1, H, n, d], values, positions [n]) of the HBM-resident entries (reads the device: for the
        gradient scorer's backward pass, not the step)."""
        main = self.paged.main_slots
        slot_pos = self.slot_pos[main]
        stored = slot_pos >= 0
        return self.keys_buf[:, :, main][:, :, stored], self.values_buf[:, :, main][:, :, stored], slot_pos[stored]

    def final_tiers(self) -> torch.Tensor:
        """TIER_* code of every logical position."""
        return self.paged.final_tiers(self.row)


@dataclass
class RowStore:
    """One row of a layer's DDR store, for reading what it holds (tests, tools)."""

    store: object
    row: int

    @property
    def keys(self) -> torch.Tensor:
        return self.store.keys[self.row]

    @property
    def values(self) -> torch.Tensor:
        return self.store.values[self.row]

    @property
    def host(self) -> dict[str, torch.Tensor]:
        return {name: tensor[self.row] for name, tensor in self.store.host.items()}

    def block_bytes(self) -> int:
        return self.store.block_bytes()


def _block_of(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block holding each (non-negative) position: a shift for a power-of-two block size (integer division is
    ~4-10x slower on a CPU: 7.6 against 2.1 us for [24, 80] int64, 48 against 5 for [24, 700])."""
    if block_size & (block_size - 1) == 0:
        return positions >> (block_size.bit_length() - 1)
    return positions // block_size


def _first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first `n` True entries of a 1-D mask, ascending: `mask.nonzero()` when the count is
    already known on the host, without the device->host read nonzero needs to size its result."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


# dtypes a recorded value travels in as its own bytes (the others are converted to float32 first)
_HOST_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
                torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}


class DeferredCopies:
    """Recorded device values, copied to the host together: each `add` returns a `Deferred` whose value is
    fetched (one `torch.cat` + one device->host copy for everything added since the last fetch) when the
    recorder resolves its rows at step end. One per `TieredCache`, shared by its layers and rows, so a decode
    step's recording costs one copy, whatever the layers and batch. Values travel as their own bytes (a view,
    no conversion kernel) and come back, as NumPy arrays of their dtype, through the `transform` given."""

    def __init__(self):
        self._batch = _CopyBatch()

    def fetched_since(self, deferred: Deferred | None) -> bool:
        """Whether the copy `deferred` was added to has reached the host (a value added now would be in the next)."""
        return deferred is None or deferred.source is not self._batch or self._batch.fetched

    def add(self, tensor: torch.Tensor, transform) -> Deferred:
        if self._batch.fetched:  # the previous batch reached the host: start a new one
            self._batch = _CopyBatch()
        batch = self._batch
        dtype = _HOST_DTYPES.get(tensor.dtype)
        if dtype is not None and tensor.is_contiguous() and not tensor.requires_grad:  # bytes by two views
            raw = tensor.view(-1).view(torch.uint8)
        else:
            flat = tensor.detach().reshape(-1)
            if dtype is None:  # e.g. bfloat16, which NumPy has not
                flat, dtype = flat.float(), np.float32
            raw = flat.contiguous().view(torch.uint8)  # (a reshape(-1) of a strided tensor may be a strided view)
        batch.tensors.append(raw)
        batch.dtypes.append(dtype)
        batch.offsets.append(batch.offsets[-1] + raw.shape[0])
        index = len(batch.tensors) - 1
        return Deferred(lambda: transform(batch.host(index)), source=batch)


class _CopyBatch:
    def __init__(self):
        self.tensors: list[torch.Tensor] = []  # bytes
        self.dtypes: list = []
        self.offsets: list[int] = [0]  # where each value starts in the fetched bytes
        self._host: np.ndarray | None = None

    @property
    def fetched(self) -> bool:
        return self._host is not None

    def host(self, index: int) -> np.ndarray:
        if self._host is None:
            self._host = torch.cat(self.tensors).cpu().numpy()
            self.tensors = []
        return self._host[self.offsets[index] : self.offsets[index + 1]].view(self.dtypes[index])


class TieredCache(Cache):
    """A transformers Cache of `PagedLayer`s (one per decoder layer, holding every row); works with a manual
    loop, with `model.generate(cache=...)` (batch 1: row 0) and with the batched decode loop (tracer/decode.py).

    Batching: row r holds one sequence (its own `TierSettings`, scorer state and recorder: each sample is
    placed exactly as it would be alone). `set_active(rows)` says which rows the next forward's batch entries
    are (entry i -> row rows[i]); every row's append, recall, attention, scoring and placement run as one set
    of batched kernels per layer, each row on its own slice, so a sample's logits do not depend on its
    neighbours. A freed row is reused for the next sample with `reset_row` (continuous refill). HF sees row 0's
    views as `self.layers` (its length and mask queries; the tiered attention needs no HF mask).
    """

    def __init__(self, n_layers: int, settings: TierSettings, recorder=None):
        self.copies, self.recording, step_masses = DeferredCopies(), StepRecording(), _StepMasses(n_layers)
        positions = [None, None, None]  # one per cache: its layers share each decode step's position tensors
        targets = _TargetsByLength()  # and the policy's targets by length
        self.step_plans: dict = {}  # and each forward's host plans (cleared as a forward begins)
        self.last_layer = n_layers  # the layer that appended last
        tables = _LayerTables(n_layers)  # and their score tables
        self.paged = [PagedLayer(i, self.copies, positions, targets, self.recording, step_masses, self.step_plans,
                                 tables) for i in range(n_layers)]
        for layer in self.paged:
            layer.reset_row(0, settings, recorder)
        super().__init__(layers=[TieredLayer(layer, 0) for layer in self.paged])
        self.settings, self.n_layers = settings, n_layers
        self.rows: list[list[TieredLayer]] = [self.layers]
        self.row_settings: list[TierSettings] = [settings]
        self.active: list[int] = [0]
        self.new_tokens: list[int] | None = None
        self.length_hint = (0, 0)  # (`reserve_length`)

    def reset_row(self, row: int, settings: TierSettings, recorder=None) -> None:
        """A fresh, empty `row` (a new sample), growing the rows when needed."""
        for layer in self.paged:
            layer.reset_row(row, settings, recorder)
        while len(self.rows) <= row:
            self.rows.append([TieredLayer(layer, len(self.rows)) for layer in self.paged])
            self.row_settings.append(settings)
        self.row_settings[row] = settings
        if row == 0:
            self.settings = settings

    def set_active(self, rows: list[int], new_tokens: list[int] | None = None) -> None:
        """The rows the next forward's batch entries are; `new_tokens`: for a prefill of several fresh rows,
        left-padded to one length, each row's real token count (the batch entry's last ones)."""
        if rows != self.active:  # (the same rows keep their list: the layers recognise it by identity)
            self.active = list(rows)
        self.new_tokens = None if new_tokens is None else list(new_tokens)

    def reserve_rows(self, n_rows: int) -> None:
        """Allocate the shared tensors for `n_rows` rows at once (the batch size), not by doubling, so that a
        batch of 5 holds 5 rows of pools, as `tracer.run.kv_buffer_bytes` sized them."""
        for layer in self.paged:
            layer.rows_hint = n_rows

    def reserve_length(self, max_prompt: int, max_len: int) -> None:
        """Pages for prompts of up to `max_prompt` tokens decoded to `max_len` at once (`PagedLayer.reserve_length`);
        the decode loops name them as they admit a sample (a no-op unless it is the longest so far)."""
        if max_prompt > self.length_hint[0] or max_len > self.length_hint[1]:
            self.length_hint = (max(max_prompt, self.length_hint[0]), max(max_len, self.length_hint[1]))
            for layer in self.paged:
                layer.reserve_length(*self.length_hint)

    def row_view(self, row: int) -> TieredRow:
        return TieredRow(self.rows[row], self.row_settings[row])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.active):
            raise UnsupportedBatch(
                f"a batch of {key_states.shape[0]} for {len(self.active)} active rows: the tiered cache decodes batch "
                "size 1 unless TieredCache.set_active(rows) names a row per batch entry (tracer.decode.decode_batch)"
            )
        if layer_idx <= self.last_layer:  # a forward begins (its layers append in order)
            # (layers of the last forward still to be placed: it raised before its last layer attended; each
            # is placed on its own, as not every layer attended)
            self.paged[0].tables.run_pending()
            self.step_plans.clear()
        self.last_layer = layer_idx
        layer = self.paged[layer_idx]
        layer.update(self.active, key_states, value_states, self.new_tokens)
        set_pending((layer, self.active))  # the attention function recalls, attends and places for these rows
        return key_states, value_states

    @property
    def logical_len(self) -> int:
        return self.layers[0].logical_len


@dataclass
class TieredRow:
    """One row of a batched `TieredCache`, shaped like a batch-1 cache (`layers`, `settings`) for code that
    reads a single sequence's cache (the gradient scorer's backward pass, the tokens table)."""

    layers: list[TieredLayer]
    settings: TierSettings
