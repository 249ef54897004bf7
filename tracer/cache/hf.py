"""The tiered cache as transformers sees it: `TieredCache` (a `Cache` of `PagedLayer`s) and its row views.

transformers 5 takes a cache through `cache=`: the model calls `cache.update(k, v, layer_idx)` and then the
attention function registered as "thoughtkv" (tracer/attention.py), which finds the layer `update` left
pending and asks it to attend. `TieredCache.set_active(rows)` says which rows the next forward's batch entries
are (the batched decode loop, tracer/decode.py; `generate` and a manual loop use row 0). `TieredLayer` and
`TieredRow` present one row as a batch-1 cache (HF's length and mask queries, the tokens table, the gradient
scorer, tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from thoughtkv_base import UserError
from tracer.attention import set_pending
from tracer.cache.layer import PagedLayer, counts_alike
from tracer.cache.pool import LengthHint
from tracer.cache.recall_rules import RECALL_RULES
from tracer.cache.rows import RowState, TierSettings, UnsupportedBatch
from tracer.cache.step import StepShared
from traces.schema import TIER_DDR


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
        """The row's host state (`RowState`)."""
        return self.paged.rows[self.row]

    # The row's counts, read from its state.
    logical_len = property(lambda self: self.state.logical_len)
    n_ddr_blocks = property(lambda self: self.state.n_ddr_blocks)
    n_evicted_blocks = property(lambda self: self.state.n_evicted_blocks)
    recalled_ids = property(lambda self: self.state.recalled_ids)
    step = property(lambda self: self.state.step)

    @property
    def defer_placement(self) -> bool:
        """Whether the row's next forward is a prefill chunk before the last (scored, not placed nor recorded)."""
        return self.state.defer_placement

    @defer_placement.setter
    def defer_placement(self, value: bool) -> None:
        self.state.defer_placement = value

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
        # What the layers share: the step's copy, recording, masses, score tables, host plans, positions, targets.
        self.shared = StepShared(n_layers)
        self.copies, self.recording = self.shared.copies, self.shared.recording
        self.last_layer = n_layers  # the layer that appended last
        self.paged = [PagedLayer(i, self.shared) for i in range(n_layers)]
        for layer in self.paged:
            layer.reset_row(0, settings, recorder)
        super().__init__(layers=[TieredLayer(layer, 0) for layer in self.paged])
        self.settings, self.n_layers = settings, n_layers
        self.rows: list[list[TieredLayer]] = [self.layers]
        self.row_settings: list[TierSettings] = [settings]
        self.active: list[int] = [0]
        self.new_tokens: list[int] | None = None
        self.length_hint = LengthHint()  # (`reserve_length`)

    @property
    def layer_timer(self):
        """The decode loop's layer timer (`tracer.decode.LayerTimer`), which times the deferred work of a step's
        layers apart (`tracer.cache.step.LayerTables.run_pending`); None: untimed."""
        return self.shared.tables.timer

    @layer_timer.setter
    def layer_timer(self, timer) -> None:
        self.shared.tables.timer = timer

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
        if max_prompt > self.length_hint.max_prompt or max_len > self.length_hint.max_len:
            self.length_hint = LengthHint(max(max_prompt, self.length_hint.max_prompt),
                                          max(max_len, self.length_hint.max_len))
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
            self.shared.tables.run_pending()
            self.shared.plans.clear()
            if self.paged[0].sharing.checked:  # (data-dependent counts: the layers share plans while they are alike)
                self.shared.counts_alike = counts_alike(self.paged, self.active)
        self.last_layer = layer_idx
        layer = self.paged[layer_idx]
        layer.update(self.active, key_states, value_states, self.new_tokens)
        set_pending((layer, self.active))  # the attention function recalls, attends and places for these rows
        return key_states, value_states

    @property
    def logical_len(self) -> int:
        return self.layers[0].logical_len

    @property
    def reads_layer_inputs(self) -> bool:
        """Whether the recall rule speculates from each decoder layer's input (the decode loop then catches them:
        `tracer.cache.speculation.watch_layer_inputs`)."""
        spec = self.settings.spec
        return spec.uses_ddr and RECALL_RULES[spec.recall_rule].reads_layer_inputs


@dataclass
class TieredRow:
    """One row of a batched `TieredCache`, shaped like a batch-1 cache (`layers`, `settings`) for code that
    reads a single sequence's cache (the gradient scorer's backward pass, the tokens table)."""

    layers: list[TieredLayer]
    settings: TierSettings
