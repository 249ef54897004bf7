"""The tiered KV cache: per layer, blocks of `block_size` logical positions live in HBM (pages of a pool on the
compute device), DDR (`tracer.transfer.PinnedBlockStore`, host memory) or are evicted (only their ids are kept).

Paged layout (the way vLLM's PagedAttention holds KV): each layer's HBM tier is a pool of pages, one block of
`block_size` slots each, then the recall staging pages, then one scratch page (a target for writes that must
go nowhere); `block_page` maps a block to its page (-1 when it is not resident), `page_block` a page to its
block (-1 when free), `slot_pos` each slot to the logical position it holds (-1 when empty). A new block takes
a free page; a block that leaves HBM frees its page, which the next new block reuses. Moving a block is one
block copy; nothing is compacted. Attention runs over the pages with the empty slots masked out (weight 0), so
the slots' order does not matter (softmax over a set).

Sync-free steps: every decision inside a decode step is a device tensor (which blocks move, which DDR blocks a
query recalls, the new token's slot), and the host sizes every buffer and every move from counts it knows
without reading the device: the policy's targets depend only on the logical length, and under the default
hierarchy (no eviction, no promote) and the evict policy the number of blocks each tier holds follows from
them exactly. The block ids that moved reach the trace through the step's one deferred copy. Where a count is
data-dependent, the layer reads it back, once per layer that places or recalls: `--evict-ratio > 0` with a DDR
tier (eviction may take a DDR or an HBM block), `--promote`, and the per-head rule (its union's size).

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
  of its attention logit (kmin/kmax: elementwise key bounds of the block, kept on the device); the top blocks
  are copied to HBM staging pages and every head attends them.
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

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from thoughtkv_base import UserError
from tracer.attention import set_pending
from tracer.quant import make_block_store
from tracer.recorder import Deferred
from tracer.scorers import Observation, Scorer
from traces.policy import (
    PolicySpec,
    evict_target_blocks,
    hbm_target_tokens,
    movable_range,
    n_blocks,
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


class TieredLayer(DynamicLayer):
    def __init__(self, layer_idx: int, settings: TierSettings, recorder=None):
        super().__init__()
        self.layer_idx, self.settings, self.recorder = layer_idx, settings, recorder
        self.spec = settings.spec
        self.block_size = settings.spec.block_size
        self.exact_counts = counts_are_exact(self.spec)
        self.logical_len = 0
        self.query_start = 0  # the first new position of this step
        # Host-side counts, exact (see the module doc): blocks in DDR, evicted, and opened (HBM = the rest).
        self.n_ddr_blocks = self.n_evicted_blocks = 0
        self.n_recalled = 0  # staging slots filled this step
        self.n_pages = self.n_staging_pages = 0
        self.placed_key: tuple | None = None  # the targets the last placement met
        # Chunked prefill (tracer.decode): every chunk but the last only appends and scores; placement and the
        # step's record wait for the last chunk, so the prompt is placed (and recorded as one prefill step of
        # all its tokens) exactly as one unchunked prefill would be.
        self.defer_placement = False
        self.deferred_query_tokens = 0
        self.recalled_ids = self.hidden_keys = None
        self.copies = DeferredCopies()  # a TieredCache shares one among all its layers and rows
        self.step = 0

    # -- storage -----------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, n_kv_heads, _, head_dim = key_states.shape
        if batch != 1:
            raise UnsupportedBatch(f"the tiered cache supports batch size 1 only (got {batch}); decode one sample at a time")
        self.device, self.dtype = key_states.device, key_states.dtype
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.keys_buf = torch.zeros((1, n_kv_heads, self.block_size, head_dim), dtype=self.dtype, device=self.device)
        self.values_buf = torch.zeros_like(self.keys_buf)
        self.slot_pos = torch.full((self.block_size,), -1, dtype=torch.long, device=self.device)
        self.page_block = torch.full((1,), -1, dtype=torch.long, device=self.device)
        self.block_page = torch.full((0,), -1, dtype=torch.long, device=self.device)
        self.block_tier = torch.zeros(0, dtype=torch.int8, device=self.device)
        self.token_scores = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.importance = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.importance_max = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.offsets = torch.arange(self.block_size, device=self.device)
        self.ddr = make_block_store(self.spec.ddr_dtype, n_kv_heads, self.block_size, head_dim, self.dtype, self.device)
        self.token_bytes = 2 * n_kv_heads * head_dim * self.keys_buf.element_size()  # K+V of one token
        self.is_initialized = True

    @property
    def n_hbm(self) -> int:
        """Tokens stored in HBM pages (every position is in exactly one tier)."""
        return self.logical_len - (self.n_ddr_blocks + self.n_evicted_blocks) * self.block_size

    @property
    def hbm_blocks(self) -> int:
        return n_blocks(self.spec, self.logical_len) - self.n_ddr_blocks - self.n_evicted_blocks

    @property
    def scratch_page(self) -> int:
        return self.n_pages + self.n_staging_pages

    @property
    def ddr_ids(self) -> torch.Tensor:
        """Sorted ids of the blocks whose home is DDR (reads the device: for tests and tools, not the step)."""
        blocks = n_blocks(self.spec, self.logical_len)
        return (self.block_tier[:blocks] == TIER_DDR).nonzero().squeeze(1)

    def _resize_pool(self, pages: int, staging_pages: int) -> None:
        """At least `pages` main pages and `staging_pages` staging pages; what the pages hold is kept (the
        staging pages too: a placement may promote from them after a resize)."""
        if pages <= self.n_pages and staging_pages <= self.n_staging_pages:
            return
        # An eighth of slack amortises the growth; attention reads every page, so a doubling would cost more.
        pages = pages + max(2, pages // 8) if pages > self.n_pages else self.n_pages
        staging_pages = max(staging_pages, self.n_staging_pages)
        bs, old_main, old_staging = self.block_size, self.n_pages * self.block_size, self.n_staging_pages * self.block_size
        total = (pages + staging_pages + 1) * bs
        moved = [(slice(0, old_main), slice(0, old_main)),
                 (slice(old_main, old_main + old_staging), slice(pages * bs, pages * bs + old_staging))]
        for name in ("keys_buf", "values_buf"):
            old, grown = getattr(self, name), torch.zeros((1, self.n_kv_heads, total, self.head_dim), dtype=self.dtype,
                                                         device=self.device)
            for source, target in moved:
                grown[:, :, target] = old[:, :, source]
            setattr(self, name, grown)
        slot_pos = torch.full((total,), -1, dtype=torch.long, device=self.device)
        for source, target in moved:
            slot_pos[target] = self.slot_pos[source]
        page_block = torch.full((pages + staging_pages + 1,), -1, dtype=torch.long, device=self.device)
        page_block[: self.n_pages] = self.page_block[: self.n_pages]
        self.slot_pos, self.page_block = slot_pos, page_block
        self.n_pages, self.n_staging_pages = pages, staging_pages
        self.keys, self.values = self.keys_buf[:, :, : pages * bs], self.values_buf[:, :, : pages * bs]

    def _ensure_blocks(self, positions: int) -> None:
        blocks = math.ceil((positions + 1) / self.block_size)  # + the scratch position scorers may write
        if blocks > self.block_tier.shape[0]:
            capacity = max(blocks, 2 * self.block_tier.shape[0], 64)
            tier = torch.full((capacity,), TIER_HBM, dtype=torch.int8, device=self.device)
            tier[: self.block_tier.shape[0]] = self.block_tier
            self.block_tier = tier
            page = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
            page[: self.block_page.shape[0]] = self.block_page
            self.block_page = page
            for name in ("importance", "importance_max"):
                grown = torch.zeros(capacity * self.block_size, dtype=torch.float32, device=self.device)
                old = getattr(self, name)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise UnsupportedBatch("the tiered cache supports batch size 1 only; decode one sample at a time")
        n_new, bs, start = key_states.shape[-2], self.block_size, self.logical_len
        end = start + n_new
        opened_from, opened_to = n_blocks(self.spec, start), n_blocks(self.spec, end)
        self._ensure_blocks(end)
        self._resize_pool(self.hbm_blocks + opened_to - opened_from, self.n_staging_pages)
        if opened_to > opened_from:  # new blocks take free pages (there are enough: pages >= HBM blocks)
            pages = _first_true(self.page_block[: self.n_pages] < 0, opened_to - opened_from)
            self.page_block[pages] = torch.arange(opened_from, opened_to, device=self.device)
            self.block_page[opened_from:opened_to] = pages
        positions = torch.arange(start, end, device=self.device)
        slots = self.block_page[positions // bs] * bs + positions % bs
        self.keys_buf[0].index_copy_(1, slots, key_states[0])
        self.values_buf[0].index_copy_(1, slots, value_states[0])
        self.slot_pos.index_copy_(0, slots, positions)
        self.query_start, self.logical_len, self.n_recalled = start, end, 0
        hbm_end = self.n_pages * bs
        self.keys, self.values = self.keys_buf[:, :, :hbm_end], self.values_buf[:, :, :hbm_end]
        set_pending(self)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n_hbm if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("the tiered cache cannot be cropped (no assisted/speculative decoding)")

    def resident_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys [1, H, n, d], values, positions [n]) of the HBM-resident entries (reads the device: for the
        gradient scorer's backward pass, not the step)."""
        hbm_end = self.n_pages * self.block_size
        stored = self.slot_pos[:hbm_end] >= 0
        return self.keys_buf[:, :, :hbm_end][:, :, stored], self.values_buf[:, :, :hbm_end][:, :, stored], \
            self.slot_pos[:hbm_end][stored]

    # -- recall (before attention) ---------------------------------------------------------------------------
    def recall(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy this step's DDR blocks for this query into staging pages; return the K/V slots to attend."""
        self.recalled_ids = None
        self.hidden_keys = None  # quest-per-head: [Hkv, n_keys] True where a head must not attend
        self.bytes_h2d = 0
        bs, hbm_end = self.block_size, self.n_pages * self.block_size
        k = recall_blocks(self.spec, self.logical_len)
        if k > 0 and self.n_ddr_blocks > 0 and query.shape[-2] == 1:
            ddr_ids, head_picks = self._choose_recall(query, k)
            n_blocks_recalled = ddr_ids.shape[0]  # host-known: min(k, DDR blocks), or the per-head union
            self._resize_pool(self.n_pages, n_blocks_recalled)
            keys, values, self.bytes_h2d = self.ddr.get(ddr_ids)
            n = n_blocks_recalled * bs
            start, end = hbm_end, hbm_end + n
            self.keys_buf[0, :, start:end] = keys.transpose(0, 1).reshape(self.n_kv_heads, n, self.head_dim)
            self.values_buf[0, :, start:end] = values.transpose(0, 1).reshape(self.n_kv_heads, n, self.head_dim)
            self.slot_pos[start:end] = (ddr_ids[:, None] * bs + self.offsets).reshape(-1)
            self.recalled_ids, self.n_recalled = ddr_ids, n
            if head_picks is not None:
                hidden = torch.zeros(self.n_kv_heads, end, dtype=torch.bool, device=self.device)
                hidden[:, start:end] = ~head_picks.t().repeat_interleave(bs, dim=1)
                self.hidden_keys = hidden
        end = hbm_end + self.n_recalled
        return self.keys_buf[:, :, :end], self.values_buf[:, :, :end]

    def _choose_recall(self, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sorted block ids to copy, per-head picks [n, Hkv] bool or None when every head attends them all).
        Every block is ranked with the non-DDR ones masked out, so no DDR id list is needed on the host."""
        blocks = n_blocks(self.spec, self.logical_len)
        self.ddr.reserve(blocks)
        in_ddr = self.block_tier[:blocks] == TIER_DDR
        bounds = self._logit_upper_bounds(query, blocks)  # [blocks, Hkv, group]
        n_ddr = self.n_ddr_blocks
        if self.spec.recall_rule == "quest":
            if n_ddr <= k:
                return _first_true(in_ddr, n_ddr), None
            best = bounds.flatten(1).amax(1).masked_fill(~in_ddr, float("-inf"))
            return best.topk(k).indices.sort().values, None
        per_head = bounds.amax(2).masked_fill(~in_ddr[:, None], float("-inf"))  # [blocks, Hkv]
        picks = in_ddr[:, None].expand_as(per_head).clone()
        if n_ddr > k:
            picks.zero_()
            picks.scatter_(0, per_head.topk(k, dim=0).indices, True)
        union = picks.any(1)
        # The union's size is data-dependent: the per-head rule reads it back (one sync per recalling layer).
        ids = _first_true(union, int(union.sum()))
        return ids, picks[ids]

    def _logit_upper_bounds(self, query: torch.Tensor, blocks: int) -> torch.Tensor:
        """Quest bound of every block's logit per (KV head, query head of its group): [blocks, Hkv, group]."""
        group = query.shape[1] // self.n_kv_heads
        q = query[0, :, 0, :].reshape(1, self.n_kv_heads, group, self.head_dim)
        key_min = self.ddr.key_min[:blocks].unsqueeze(2)  # [blocks, Hkv, 1, d]
        key_max = self.ddr.key_max[:blocks].unsqueeze(2)
        return torch.maximum(q * key_min, q * key_max).sum(-1)

    # -- after attention: score, record, place ---------------------------------------------------------------
    def after_attention(self, weights_mean: torch.Tensor, weights_max: torch.Tensor) -> None:
        n_attended = weights_mean.shape[-1]
        length = self.logical_len
        slot_pos = self.slot_pos[:n_attended]
        # Empty slots (weight 0) point at a scratch position one past the last token, reset after scoring.
        positions = torch.where(slot_pos >= 0, slot_pos, length)
        settings = self.settings
        step = self.recorder.step if self.recorder is not None else self.step
        # AlsoScore (tracer/scorers/) scores under the full policy too, for its recorded extras.
        if settings.scorer is not None and (
            self.spec.policy != "full" or getattr(settings.scorer, "score_under_full", False)
        ):
            observation = Observation(
                self.layer_idx, step, length + 1, positions, weights_mean, weights_max,
                self.keys_buf[0, :, :n_attended], values=self.values_buf[0, :, :n_attended], valid=slot_pos >= 0,
            )
            self.token_scores = settings.scorer.score(observation, self.token_scores)
            if self.token_scores.shape[0] > length:
                self.token_scores[length] = 0.0  # the scratch position
        if self.defer_placement:  # a prefill chunk before the last: scored, not placed nor recorded
            self.deferred_query_tokens += weights_mean.shape[0]
            return
        is_decode = weights_mean.shape[0] == 1 and step > 0
        if settings.track_importance and is_decode:
            self.importance.index_add_(0, positions, weights_mean[-1])
            self.importance_max.index_add_(0, positions, weights_max[-1])
        if self.recorder is not None:
            before = self._occupancy(weights_mean[-1], positions)
        moves = self._place()
        if self.n_recalled:  # the staging pages are refilled at the next recall
            hbm_end = self.n_pages * self.block_size
            self.slot_pos[hbm_end : hbm_end + self.n_recalled] = -1
        if self.recorder is not None:
            recalled = [] if self.recalled_ids is None else self.copies.add(self.recalled_ids, _as_ids)
            promoted, offloaded, evicted, bytes_d2h = moves
            self.recorder.add_layer_row(
                layer=self.layer_idx, query_tokens=weights_mean.shape[0] + self.deferred_query_tokens,
                logical_len=self.logical_len,
                recalled_block_ids=recalled,
                promoted_block_ids=promoted, offloaded_block_ids=offloaded, evicted_block_ids=evicted,
                bytes_h2d=self.bytes_h2d, bytes_d2h=bytes_d2h, **before, **self._quant_error(),
            )
        self.deferred_query_tokens = 0
        self.step = step + 1

    def _quant_error(self) -> dict:
        pop = getattr(self.ddr, "pop_quant_error_tensors", None)
        errors = None if pop is None else pop()
        if errors is None:
            return {}
        host = self.copies.add(errors, lambda a: a.astype(np.float64))
        return {"quant_max_rel_err": host.then(lambda a: float(a[0])),
                "quant_rms_rel_err": host.then(lambda a: float(a[1]))}

    def _occupancy(self, last_weights: torch.Tensor, positions: torch.Tensor) -> dict:
        """Tier sizes and attention masses at attention time (after recall, before placement)."""
        blocks = n_blocks(self.spec, self.logical_len)
        # Block masses, then (if any recall) the DDR mass; they reach the host with the step's other recorded
        # device values in one copy at step end (`DeferredCopies`), not one copy per layer. Empty slots carry
        # weight 0, so where their scratch position lands adds nothing.
        block_mass = torch.zeros(blocks + 1, dtype=torch.float32, device=self.device)
        block_mass.index_add_(0, positions // self.block_size, last_weights)
        if self.n_recalled:
            hbm_end = self.n_pages * self.block_size
            block_mass[blocks] = last_weights[hbm_end:].sum()
        else:
            block_mass[blocks] = 0.0
        host = self.copies.add(block_mass, lambda a: a.astype(np.float32))
        mass_ddr = host.then(lambda a: float(a[blocks]))
        mass_hbm = host.then(lambda a: float(a[:blocks].sum()) - float(a[blocks]))  # HBM + recalled mass is 1
        ddr_tokens = self.n_ddr_blocks * self.block_size
        return dict(
            hbm_tokens=self.n_hbm, ddr_tokens=ddr_tokens,
            evicted_tokens=self.n_evicted_blocks * self.block_size, recalled_tokens=self.n_recalled,
            hbm_blocks=self.hbm_blocks, ddr_blocks=self.n_ddr_blocks, evicted_blocks=self.n_evicted_blocks,
            hbm_kv_bytes=(self.n_hbm + self.n_recalled) * self.token_bytes,
            ddr_kv_bytes=self.n_ddr_blocks * self.ddr.block_bytes(),
            mass_hbm=mass_hbm, mass_ddr=mass_ddr, block_mass=host.then(lambda a: a[:blocks]),
        )

    def _place(self) -> tuple:
        """Apply the policy's targets; returns (promoted, offloaded, evicted) block ids (lists, or `Deferred`
        lists fetched at step end) and bytes copied D2H."""
        spec, length, bs = self.spec, self.logical_len, self.block_size
        nothing = ([], [], [], 0)
        evict_target = evict_target_blocks(spec, length)
        if hbm_target_tokens(spec, length) is None and evict_target == 0:
            return nothing
        sink_blocks, movable_end = movable_range(spec, length)
        if movable_end <= sink_blocks:
            return nothing
        room = room_blocks(spec, length)
        has_recalled = self.n_recalled > 0 and spec.promote
        key = (sink_blocks, movable_end, room, evict_target)
        if key == self.placed_key and not has_recalled:
            return nothing  # the targets have not moved since the last placement met them
        self.placed_key = key

        n_movable = movable_end - sink_blocks
        need_evict = max(0, evict_target - self.n_evicted_blocks)
        block_scores = self.token_scores[: movable_end * bs].view(-1, bs).sum(1)[sink_blocks:]
        tier = self.block_tier[sink_blocks:movable_end].clone()
        was_hbm = tier == TIER_HBM
        recalled = torch.zeros_like(was_hbm)
        if self.recalled_ids is not None:
            recalled[self.recalled_ids - sink_blocks] = True
        evict_now = torch.zeros_like(was_hbm)
        # Every evicted block lies in the movable range (it was movable when evicted, and the range only
        # grows), so the alive count is known here without reading the device.
        n_victims = min(need_evict, n_movable - self.n_evicted_blocks)
        if n_victims > 0:
            alive = tier != TIER_EVICTED
            victims = block_scores.masked_fill(~alive, float("inf")).topk(n_victims, largest=False).indices
            evict_now[victims] = True
            tier[victims] = TIER_EVICTED
        candidates = tier == TIER_HBM
        if spec.promote:
            candidates |= recalled & (tier == TIER_DDR)
        if room is not None and room < n_movable:
            # The top `room` candidates; when there are fewer, all of them (the rest of the top-k is masked out):
            # the same blocks as "top-room if candidates > room else all", with no count read back.
            keep = torch.zeros_like(candidates)
            keep[block_scores.masked_fill(~candidates, float("-inf")).topk(room).indices] = True
            keep &= candidates
        else:
            keep = candidates.clone()
        demoted = candidates & ~keep & was_hbm
        promoted = keep & (tier == TIER_DDR)
        # torch.where, not mask assignment: `t[mask] = x` sizes its index on the host (a device read).
        tier = torch.where(promoted, TIER_HBM, tier)
        tier = torch.where(demoted, TIER_DDR if spec.uses_ddr else TIER_EVICTED, tier).to(torch.int8)
        if not spec.uses_ddr:
            evict_now |= demoted
        offloaded = demoted if spec.uses_ddr else torch.zeros_like(demoted)
        evicted_from_hbm, evicted_from_ddr = evict_now & was_hbm, evict_now & ~was_hbm

        if self.exact_counts:  # no victims, no promotion: min(room, candidates) stay, the rest leave
            hbm_movable = n_movable - self.n_ddr_blocks - self.n_evicted_blocks
            kept = hbm_movable if room is None or room >= n_movable else min(room, hbm_movable)
            n_off, n_promoted, n_ev_hbm, n_ev_ddr = (hbm_movable - kept, 0, 0, 0) if spec.uses_ddr else \
                (0, 0, hbm_movable - kept, 0)
        else:  # data-dependent counts: one read-back for this layer's placement
            counts = torch.stack([offloaded.sum(), promoted.sum(), evicted_from_hbm.sum(), evicted_from_ddr.sum()])
            n_off, n_promoted, n_ev_hbm, n_ev_ddr = counts.tolist()

        bytes_d2h = self._offload(offloaded, sink_blocks, n_off, movable_end) if n_off else 0
        self._free_pages(was_hbm & (tier != TIER_HBM), sink_blocks, movable_end)
        if n_promoted:  # promotion can grow HBM (when it was under its room): pages for what stays first
            self._resize_pool(self.hbm_blocks - n_off - n_ev_hbm + n_promoted, self.n_staging_pages)
            self._promote(promoted, sink_blocks, n_promoted)
        self.block_tier[sink_blocks:movable_end] = tier
        self.n_ddr_blocks += n_off - n_promoted - n_ev_ddr
        self.n_evicted_blocks += n_ev_hbm + n_ev_ddr

        # What happened to each movable block, recorded through the step's one deferred copy.
        moves = (offloaded.to(torch.int8) + 2 * promoted.to(torch.int8) + 3 * evicted_from_hbm.to(torch.int8)
                 + 4 * evicted_from_ddr.to(torch.int8))
        host = self.copies.add(moves, lambda a: a.astype(np.int8))
        return (host.then(lambda a: _as_ids(np.flatnonzero(a == 2) + sink_blocks)),
                host.then(lambda a: _as_ids(np.flatnonzero(a == 1) + sink_blocks)),
                host.then(lambda a: _as_ids(np.flatnonzero(a >= 3) + sink_blocks)), bytes_d2h)

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.block_size + self.offsets).reshape(-1)

    def _offload(self, offloaded: torch.Tensor, first: int, n: int, movable_end: int) -> int:
        """Copy the `n` offloaded blocks (mask over the movable range from block `first`) from their pages to DDR."""
        block_ids = _first_true(offloaded, n) + first  # ascending
        slots = self._page_slots(self.block_page[block_ids])  # block by block, positions in order
        shape = (self.n_kv_heads, n, self.block_size, self.head_dim)
        keys = self.keys_buf[0].index_select(1, slots).view(shape).transpose(0, 1)
        values = self.values_buf[0].index_select(1, slots).view(shape).transpose(0, 1)
        self.ddr.reserve(movable_end)
        return self.ddr.put(block_ids, keys.contiguous(), values.contiguous())

    def _free_pages(self, left: torch.Tensor, first: int, end: int) -> None:
        """Free the pages of the blocks that left HBM (mask over blocks [first, end)); the others write to the
        scratch page, so the count never reaches the host."""
        pages = self.block_page[first:end]
        freed = torch.where(left, pages, self.scratch_page)
        self.page_block.index_fill_(0, freed, -1)
        self.slot_pos.index_fill_(0, self._page_slots(freed), -1)
        self.block_page[first:end] = torch.where(left, -1, pages)

    def _promote(self, promoted: torch.Tensor, first: int, n: int) -> None:
        """Move `n` promoted blocks from their staging pages into free main pages."""
        block_ids = _first_true(promoted, n) + first
        staging_index = torch.searchsorted(self.recalled_ids, block_ids)
        source = self._page_slots(self.n_pages + staging_index)
        pages = _first_true(self.page_block[: self.n_pages] < 0, n)
        target = self._page_slots(pages)
        for buffer in (self.keys_buf, self.values_buf):
            buffer[0].index_copy_(1, target, buffer[0].index_select(1, source))
        self.slot_pos.index_copy_(0, target, self.slot_pos.index_select(0, source))
        self.page_block[pages] = block_ids
        self.block_page[block_ids] = pages

    # -- end of sample -------------------------------------------------------------------------------------
    def final_tiers(self) -> torch.Tensor:
        """TIER_* code of every logical position."""
        blocks = n_blocks(self.spec, self.logical_len)
        return self.block_tier[:blocks].repeat_interleave(self.block_size)[: self.logical_len]


def _first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the first `n` True entries of a 1-D mask, ascending: `mask.nonzero()` when the count is
    already known on the host, without the device->host read nonzero needs to size its result."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


def _as_ids(values: np.ndarray) -> list[int]:
    return values.astype(np.int64).tolist()


class DeferredCopies:
    """Recorded device values, copied to the host together: each `add` returns a `Deferred` whose value is
    fetched (one `torch.cat` + one device->host copy for everything added since the last fetch) when the
    recorder resolves its rows at step end. One per `TieredCache`, shared by its layers and rows, so a decode
    step's recording costs one copy, whatever the layers and batch. Values travel as float64 (block ids and
    float32 masses are exact in it) and come back through the `transform` given."""

    def __init__(self):
        self._batch = _CopyBatch()

    def add(self, tensor: torch.Tensor, transform) -> Deferred:
        if self._batch.fetched:  # the previous batch reached the host: start a new one
            self._batch = _CopyBatch()
        batch = self._batch
        batch.tensors.append(tensor.detach().reshape(-1).to(torch.float64))
        index = len(batch.tensors) - 1
        return Deferred(lambda: transform(batch.host(index)))


class _CopyBatch:
    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._host: list[np.ndarray] | None = None

    @property
    def fetched(self) -> bool:
        return self._host is not None

    def host(self, index: int) -> np.ndarray:
        if self._host is None:
            flat = torch.cat(self.tensors).cpu().numpy()
            offsets = np.cumsum([0, *(t.numel() for t in self.tensors)])
            self._host = [flat[offsets[i] : offsets[i + 1]] for i in range(len(self.tensors))]
            self.tensors = []
        return self._host[index]


class TieredCache(Cache):
    """A transformers Cache of `TieredLayer`s, one set per batch *row*; works with a manual loop, with
    `model.generate(cache=...)` (batch 1: row 0) and with the batched decode loop (tracer/decode.py).

    Batching: row r holds one sequence (its own `TierSettings`, scorer state and recorder: each sample is
    placed exactly as it would be alone). `set_active(rows)` says which rows the next forward's batch entries
    are (entry i -> row rows[i]); the model's dense work (projections, MLP) runs batched, and each row's
    attention, recall and placement run on that row's layers, so a sample's logits do not depend on its
    neighbours. A freed row is reused for the next sample with `reset_row` (continuous refill). HF sees row 0's
    layers as `self.layers` (its length and mask queries; the tiered attention needs no HF mask).
    """

    def __init__(self, n_layers: int, settings: TierSettings, recorder=None):
        super().__init__(layers=[TieredLayer(i, settings, recorder) for i in range(n_layers)])
        self.settings, self.n_layers = settings, n_layers
        self.copies = DeferredCopies()
        for layer in self.layers:
            layer.copies = self.copies
        self.rows: list[list[TieredLayer]] = [self.layers]
        self.row_settings: list[TierSettings] = [settings]
        self.active: list[int] = [0]

    def reset_row(self, row: int, settings: TierSettings, recorder=None) -> None:
        """Fresh, empty layers for `row` (a new sample), growing the row list when needed."""
        layers = [TieredLayer(i, settings, recorder) for i in range(self.n_layers)]
        for layer in layers:
            layer.copies = self.copies
        while len(self.rows) <= row:
            self.rows.append([])
            self.row_settings.append(settings)
        self.rows[row], self.row_settings[row] = layers, settings
        if row == 0:
            self.layers = layers
            self.settings = settings

    def set_active(self, rows: list[int]) -> None:
        self.active = list(rows)

    def row_view(self, row: int) -> TieredRow:
        return TieredRow(self.rows[row], self.row_settings[row])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] == 1 and len(self.active) == 1:
            return self.rows[self.active[0]][layer_idx].update(key_states, value_states)
        if key_states.shape[0] != len(self.active):
            raise UnsupportedBatch(
                f"a batch of {key_states.shape[0]} for {len(self.active)} active rows: the tiered cache decodes batch "
                "size 1 unless TieredCache.set_active(rows) names a row per batch entry (tracer.decode.decode_batch)"
            )
        layers = [self.rows[row][layer_idx] for row in self.active]
        for index, layer in enumerate(layers):
            layer.update(key_states[index : index + 1], value_states[index : index + 1])
        set_pending(layers)  # the attention function runs each row's recall/attend/placement in turn
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
