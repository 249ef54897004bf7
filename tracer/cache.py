"""The tiered KV cache: per layer, blocks of `block_size` logical positions live in HBM (tensors on the compute
device), DDR (tensors on the host, `tracer.transfer.PinnedBlockStore`) or are evicted (only their ids are kept).

Correct by construction:
- `update` appends the new K/V to HBM and returns all HBM K/V; the attention function (tracer/attention.py)
  adds the recalled DDR blocks, attends, and only then does the layer score and move blocks. Nothing is
  pruned before the step that produced it has attended to it.
- Positions are logical: `logical_len` counts every entry ever appended, `get_seq_length()` the ones stored in
  HBM. Callers pass true `position_ids` (the decode loop does; `generate` derives them from its attention
  mask), so RoPE never sees the shrunken stored length.

Recall rules (`PolicySpec.recall_rule`, traces/policy.py), at each decode step, per layer, for the *current*
query; the number of blocks is `recall_blocks(spec, logical_len)` (`recall_k`, or `--recall-budget`):
- "quest": every DDR block gets the upper bound `max over query heads of sum_d max(q_d * kmin_d, q_d * kmax_d)`
  of its attention logit (kmin/kmax: elementwise key bounds of the block, kept on the device); the top blocks
  are copied to HBM staging slots and every head attends them.
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
(hierarchy) or drop them (evict).
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
    protected_tokens,
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


class TieredLayer(DynamicLayer):
    def __init__(self, layer_idx: int, settings: TierSettings, recorder=None):
        super().__init__()
        self.layer_idx, self.settings, self.recorder = layer_idx, settings, recorder
        self.spec = settings.spec
        self.block_size = settings.spec.block_size
        self.logical_len = 0
        self.n_hbm = 0  # stored HBM entries: slots [0, n_hbm) of the buffers
        self.n_recalled = 0  # staging slots [n_hbm, n_hbm + n_recalled) filled this step
        self.new_start = 0
        self.n_ddr_blocks = self.n_evicted_blocks = 0
        # Chunked prefill (tracer.decode): every chunk but the last only appends and scores; placement and the
        # step's record wait for the last chunk, so the prompt is placed (and recorded as one prefill step of
        # all its tokens) exactly as one unchunked prefill would be.
        self.defer_placement = False
        self.deferred_query_tokens = 0
        self.ddr_ids = torch.zeros(0, dtype=torch.long)  # sorted ids of the blocks whose home is DDR
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
        self.keys_buf = torch.empty((1, n_kv_heads, 0, head_dim), dtype=self.dtype, device=self.device)
        self.values_buf = torch.empty_like(self.keys_buf)
        self.slot_pos = torch.empty(0, dtype=torch.long, device=self.device)
        self.block_tier = torch.zeros(0, dtype=torch.int8, device=self.device)
        self.token_scores = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.importance = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.importance_max = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.ddr = make_block_store(self.spec.ddr_dtype, n_kv_heads, self.block_size, head_dim, self.dtype, self.device)
        self.token_bytes = 2 * n_kv_heads * head_dim * self.keys_buf.element_size()  # K+V of one token
        self.is_initialized = True

    def _ensure_capacity(self, slots: int, positions: int) -> None:
        if slots > self.keys_buf.shape[2]:
            capacity = max(slots, 2 * self.keys_buf.shape[2], 256)
            for name in ("keys_buf", "values_buf"):
                old = getattr(self, name)
                new = torch.empty((1, self.n_kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device)
                new[:, :, : self.n_hbm] = old[:, :, : self.n_hbm]
                setattr(self, name, new)
            slot_pos = torch.empty(capacity, dtype=torch.long, device=self.device)
            slot_pos[: self.n_hbm] = self.slot_pos[: self.n_hbm]
            self.slot_pos = slot_pos
        blocks = math.ceil(positions / self.block_size)
        if blocks > self.block_tier.shape[0]:
            capacity = max(blocks, 2 * self.block_tier.shape[0], 64)
            tier = torch.full((capacity,), TIER_HBM, dtype=torch.int8, device=self.device)
            tier[: self.block_tier.shape[0]] = self.block_tier
            self.block_tier = tier
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
        n_new = key_states.shape[-2]
        self._ensure_capacity(self.n_hbm + n_new + self._staging_slots(self.logical_len + n_new), self.logical_len + n_new)
        start, end = self.n_hbm, self.n_hbm + n_new
        self.keys_buf[:, :, start:end] = key_states
        self.values_buf[:, :, start:end] = value_states
        if n_new == 1:
            self.slot_pos[start] = self.logical_len
        else:
            self.slot_pos[start:end] = torch.arange(self.logical_len, self.logical_len + n_new, device=self.device)
        self.new_start, self.n_hbm, self.n_recalled = start, end, 0
        self.logical_len += n_new
        self.keys, self.values = self.keys_buf[:, :, :end], self.values_buf[:, :, :end]
        set_pending(self)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n_hbm if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("the tiered cache cannot be cropped (no assisted/speculative decoding)")

    # -- recall (before attention) ---------------------------------------------------------------------------
    def _staging_slots(self, logical_len: int) -> int:
        """Staging slots one decode step can fill: the recall count (times the KV heads for the per-head rule,
        whose union can reach that), never more than the blocks there are."""
        per_step = recall_blocks(self.spec, logical_len)
        if self.spec.recall_rule == "quest-per-head":
            per_step *= self.n_kv_heads
        return min(per_step, n_blocks(self.spec, logical_len)) * self.block_size

    def recall(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy this step's DDR blocks for this query into staging slots; return K/V to attend."""
        self.recalled_ids = None
        self.hidden_keys = None  # quest-per-head: [Hkv, n_keys] True where a head must not attend
        self.bytes_h2d = 0
        k = recall_blocks(self.spec, self.logical_len)
        if k > 0 and self.n_ddr_blocks > 0 and query.shape[-2] == 1:
            ddr_ids, head_picks = self._choose_recall(query, k)
            keys, values, self.bytes_h2d = self.ddr.get(ddr_ids)
            n = ddr_ids.numel() * self.block_size
            start, end = self.n_hbm, self.n_hbm + n
            self.keys_buf[0, :, start:end] = keys.transpose(0, 1).reshape(self.n_kv_heads, n, self.head_dim)
            self.values_buf[0, :, start:end] = values.transpose(0, 1).reshape(self.n_kv_heads, n, self.head_dim)
            offsets = torch.arange(self.block_size, device=self.device)
            self.slot_pos[start:end] = (ddr_ids[:, None] * self.block_size + offsets).reshape(-1)
            self.recalled_ids, self.n_recalled = ddr_ids, n
            if head_picks is not None:
                hidden = torch.zeros(self.n_kv_heads, end, dtype=torch.bool, device=self.device)
                hidden[:, start:end] = ~head_picks.t().repeat_interleave(self.block_size, dim=1)
                self.hidden_keys = hidden
        end = self.n_hbm + self.n_recalled
        return self.keys_buf[:, :, :end], self.values_buf[:, :, :end]

    def _choose_recall(self, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sorted block ids to copy, per-head picks [n, Hkv] bool or None when every head attends them all)."""
        ddr_ids = self.ddr_ids
        bounds = self._logit_upper_bounds(query, ddr_ids)  # [m, Hkv, group]
        if self.spec.recall_rule == "quest":
            if ddr_ids.numel() > k:
                ddr_ids = ddr_ids[bounds.flatten(1).amax(1).topk(k).indices].sort().values
            return ddr_ids, None
        per_head = bounds.amax(2)  # [m, Hkv]: each KV head's bound over its own query group
        picks = torch.ones_like(per_head, dtype=torch.bool)
        if ddr_ids.numel() > k:
            picks.zero_()
            picks.scatter_(0, per_head.topk(k, dim=0).indices, True)
        union = picks.any(1)
        return ddr_ids[union], picks[union]  # ddr_ids is sorted, so the union stays sorted

    def _logit_upper_bounds(self, query: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Quest bound of every block's logit per (KV head, query head of its group): [m, Hkv, group]."""
        group = query.shape[1] // self.n_kv_heads
        q = query[0, :, 0, :].reshape(1, self.n_kv_heads, group, self.head_dim)
        key_min = self.ddr.key_min[block_ids].unsqueeze(2)  # [m, Hkv, 1, d]
        key_max = self.ddr.key_max[block_ids].unsqueeze(2)
        return torch.maximum(q * key_min, q * key_max).sum(-1)

    # -- after attention: score, record, place ---------------------------------------------------------------
    def after_attention(self, weights_mean: torch.Tensor, weights_max: torch.Tensor) -> None:
        n_attended = self.n_hbm + self.n_recalled
        positions = self.slot_pos[:n_attended]
        settings = self.settings
        step = self.recorder.step if self.recorder is not None else self.step
        # AlsoScore (tracer/scorers/) scores under the full policy too, for its recorded extras.
        if settings.scorer is not None and (
            self.spec.policy != "full" or getattr(settings.scorer, "score_under_full", False)
        ):
            observation = Observation(
                self.layer_idx, step, self.logical_len, positions, weights_mean, weights_max,
                self.keys_buf[0, :, :n_attended], values=self.values_buf[0, :, :n_attended],
            )
            self.token_scores = settings.scorer.score(observation, self.token_scores)
        if self.defer_placement:  # a prefill chunk before the last: scored, not placed nor recorded
            self.deferred_query_tokens += weights_mean.shape[0]
            return
        is_decode = weights_mean.shape[0] == 1 and step > 0
        if settings.track_importance and is_decode:
            self.importance.index_add_(0, positions, weights_mean[-1])
            self.importance_max.index_add_(0, positions, weights_max[-1])
        if self.recorder is not None:
            before = self._occupancy(weights_mean[-1], positions)
        promoted, offloaded, evicted, bytes_d2h = self._place()
        if self.recorder is not None:
            recalled = [] if self.recalled_ids is None else self.copies.add(self.recalled_ids, _as_ids)
            self.recorder.add_layer_row(
                layer=self.layer_idx, query_tokens=weights_mean.shape[0] + self.deferred_query_tokens,
                logical_len=self.logical_len,
                recalled_block_ids=recalled,
                promoted_block_ids=promoted, offloaded_block_ids=offloaded, evicted_block_ids=evicted,
                bytes_h2d=self.bytes_h2d, bytes_d2h=bytes_d2h, **before,
                **(self.ddr.pop_quant_error() if hasattr(self.ddr, "pop_quant_error") else {}),
            )
        self.deferred_query_tokens = 0
        self.step = step + 1

    def _occupancy(self, last_weights: torch.Tensor, positions: torch.Tensor) -> dict:
        """Tier sizes and attention masses at attention time (after recall, before placement)."""
        blocks = n_blocks(self.spec, self.logical_len)
        # Block masses, then (if any recall) the DDR mass; they reach the host with the step's other recorded
        # device values in one copy at step end (`DeferredCopies`), not one copy per layer.
        block_mass = torch.zeros(blocks + 1, dtype=torch.float32, device=self.device)
        block_mass.index_add_(0, positions // self.block_size, last_weights)
        if self.n_recalled:
            block_mass[blocks] = last_weights[self.n_hbm :].sum()
        host = self.copies.add(block_mass, lambda a: a.astype(np.float32))
        mass_ddr = host.then(lambda a: float(a[blocks]))
        mass_hbm = host.then(lambda a: float(a[:blocks].sum()) - float(a[blocks]))  # HBM + recalled mass is 1
        ddr_tokens = self.n_ddr_blocks * self.block_size
        return dict(
            hbm_tokens=self.n_hbm, ddr_tokens=ddr_tokens,
            evicted_tokens=self.n_evicted_blocks * self.block_size, recalled_tokens=self.n_recalled,
            hbm_blocks=blocks - self.n_ddr_blocks - self.n_evicted_blocks, ddr_blocks=self.n_ddr_blocks,
            evicted_blocks=self.n_evicted_blocks,
            hbm_kv_bytes=(self.n_hbm + self.n_recalled) * self.token_bytes,
            ddr_kv_bytes=self.n_ddr_blocks * self.ddr.block_bytes(),
            mass_hbm=mass_hbm, mass_ddr=mass_ddr, block_mass=host.then(lambda a: a[:blocks]),
        )

    def _place(self) -> tuple[list[int], list[int], list[int], int]:
        """Apply the policy's targets; returns (promoted, offloaded, evicted) block ids and bytes copied D2H."""
        spec, length, bs = self.spec, self.logical_len, self.block_size
        evict_target = evict_target_blocks(spec, length)
        if hbm_target_tokens(spec, length) is None and evict_target == 0:
            return [], [], [], 0
        sink_blocks, movable_end = movable_range(spec, length)
        if movable_end <= sink_blocks:
            return [], [], [], 0
        movable_hbm_blocks = (self.n_hbm - protected_tokens(spec, length)) // bs
        need_evict = max(0, evict_target - self.n_evicted_blocks)
        room = room_blocks(spec, length)
        has_recalled = self.n_recalled > 0 and spec.promote
        if need_evict == 0 and (room is None or movable_hbm_blocks <= room) and not has_recalled:
            return [], [], [], 0

        block_scores = self.token_scores[: movable_end * bs].view(-1, bs).sum(1)[sink_blocks:]
        n_movable = movable_end - sink_blocks
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

        # The placement's one device->host read: what happened to each movable block (the counts size the
        # buffers below, the ids are recorded); everything else stays on the device.
        moves = (offloaded.to(torch.int8) + 2 * promoted.to(torch.int8) + 3 * (evict_now & was_hbm).to(torch.int8)
                 + 4 * (evict_now & ~was_hbm).to(torch.int8))
        host_moves = moves.cpu().numpy()
        offloaded_ids, promoted_ids = np.flatnonzero(host_moves == 1) + sink_blocks, np.flatnonzero(host_moves == 2) + sink_blocks
        evicted_ids = np.flatnonzero(host_moves >= 3) + sink_blocks
        n_evicted_from_ddr = int((host_moves == 4).sum())
        bytes_d2h = self._offload(offloaded, sink_blocks, offloaded_ids) if len(offloaded_ids) else 0
        self.n_ddr_blocks += len(offloaded_ids) - len(promoted_ids) - n_evicted_from_ddr
        self.n_evicted_blocks += len(evicted_ids)
        self.block_tier[sink_blocks:movable_end] = tier
        self.ddr_ids = _first_true(self.block_tier[:movable_end] == TIER_DDR, self.n_ddr_blocks)
        left_hbm = len(offloaded_ids) + len(evicted_ids) - n_evicted_from_ddr
        self._compact(self.n_hbm + (len(promoted_ids) - left_hbm) * bs)
        return promoted_ids.tolist(), offloaded_ids.tolist(), evicted_ids.tolist(), bytes_d2h

    def _offload(self, offloaded: torch.Tensor, first: int, host_ids: np.ndarray) -> int:
        """Copy the offloaded blocks (mask over the movable range from block `first`) to DDR."""
        bs, n = self.block_size, len(host_ids)
        block_ids = _first_true(offloaded, n) + first  # ascending, as host_ids
        in_block = torch.isin(self.slot_pos[: self.n_hbm] // bs, block_ids)
        slots = _first_true(in_block, n * bs)
        slots = slots[self.slot_pos[slots].argsort()]  # block by block, positions in order
        shape = (self.n_kv_heads, n, bs, self.head_dim)
        keys = self.keys_buf[0, :, slots].view(shape).transpose(0, 1)
        values = self.values_buf[0, :, slots].view(shape).transpose(0, 1)
        return self.ddr.put(block_ids, keys.contiguous(), values.contiguous(), host_ids=host_ids)

    def _compact(self, n_kept: int) -> None:
        """Keep only the slots whose block is in HBM (drops offloaded/evicted ones and unpromoted recalls);
        `n_kept` (known from the placement's counts) says how many there are."""
        n_slots = self.n_hbm + self.n_recalled
        keep = self.block_tier[self.slot_pos[:n_slots] // self.block_size] == TIER_HBM
        kept = _first_true(keep, n_kept)
        self.keys_buf[:, :, :n_kept] = self.keys_buf[:, :, kept]
        self.values_buf[:, :, :n_kept] = self.values_buf[:, :, kept]
        self.slot_pos[:n_kept] = self.slot_pos[kept]
        self.n_hbm, self.n_recalled = n_kept, 0
        self.keys, self.values = self.keys_buf[:, :, :n_kept], self.values_buf[:, :, :n_kept]

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
