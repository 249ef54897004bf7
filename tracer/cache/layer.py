"""`PagedLayer`: one decoder layer's tiered KV for every row of a batch, and the order of a step's work on it.

A forward reaches each layer twice: `update` (the model's `cache.update`) appends the new K/V
(`tracer.cache.append`); `attend` (the attention function, tracer/attention.py) recalls DDR blocks for the
rows' current queries (`tracer.cache.recall`), attends the pages in use plus the recalled blocks, and only then
scores (`tracer.cache.scoring`), places (`tracer.cache.placement`) and records: nothing is moved before the
step that produced it has attended to it. Every row's work is one set of kernels, each row on its own slice
of the `[rows, ...]` tensors (`tracer.cache.pool`), with its counts on the host (`RowState`). A decode step
of layers alike is scored, recorded and placed for every layer at once after the last one has attended
(`tracer.cache.step`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tracer.attention import attend
from tracer.cache.append import append
from tracer.cache.indexing import RowIndex
from tracer.cache.placement import place, quant_errors
from tracer.cache.placements import counts_are_exact
from tracer.cache.pool import PagePool
from tracer.cache.recall import FlatRows, recall
from tracer.cache.recall_rules import RECALL_RULES
from tracer.cache.rows import RowState, TierSettings, UnsupportedBatch
from tracer.cache.scoring import ScorePlan, add_importance, occupancy, score, score_plan
from tracer.cache.step import Attended, MassShape, StepShared
from tracer.recorder import LayerEntry, repeated
from traces.policy import n_blocks


class PlanSharing(NamedTuple):
    """Whether a decode step's layers share their host plans (`PagedLayer.plan`): asked ~6 times per layer and step."""

    recall: bool  # plans that read this step's recall too (a rule whose recall counts are known)
    checked: bool  # data-dependent counts (`counts_are_exact` false): alike only where `StepShared.counts_alike`


def counts_alike(layers: list[PagedLayer], rows: list[int]) -> bool:
    """Whether every layer holds the same tier counts for `rows`: the host counts that a placement whose counts
    are data-dependent (eviction into a DDR tier, promotion) can leave different in each layer. Every other count
    a plan reads (lengths, steps, the targets met, a known rule's recall count) is the same in every layer."""
    first = layers[0].rows
    reference = [(first[r].n_ddr_blocks, first[r].n_evicted_blocks) for r in rows]
    return all([(layer.rows[r].n_ddr_blocks, layer.rows[r].n_evicted_blocks) for r in rows] == reference
               for layer in layers[1:])


class RecordingRows(NamedTuple):
    """The recording rows of a step, with their host counts at attention time (after recall, before placement)."""

    row_ids: tuple[int, ...]
    host: list[tuple]  # per row: `tracer.recorder.HOST_FIELDS`


class AfterPlan(NamedTuple):
    """What a step does after attention, by batch entry (`PagedLayer.after_plan`)."""

    placing: list[int]  # place (a prefill chunk before the last does not)
    decoding: tuple[int, ...]  # add this step's attention to their importance
    recording: list[int]  # record
    rows: RecordingRows | None  # None when no row records
    mass_shape: MassShape | None  # the step's mass tensor (`tracer.cache.step.StepMasses`)


class EntryConstants(NamedTuple):
    store: object  # the DDR store they were read from (a refilled row may bring another)
    constants: tuple[int, int, int, int]  # `LayerEntry.constants`


class PagedLayer(PagePool):
    """One decoder layer's tiered KV for every row of a batch: `[rows, ...]` tensors, so that one set of
    kernels appends, recalls, attends, scores and places for the whole batch (a batch of one row is the same
    code). Rows differ in length: each row's pages, staging and scores sit in its own slice of the shared
    tensors, padded to the longest row (the empty slots are masked), and the host keeps each row's counts."""

    def __init__(self, layer_idx: int, shared: StepShared | None = None):
        shared = shared if shared is not None else StepShared(layer_idx + 1)
        super().__init__(shared.tables)
        self.layer_idx, self.shared = layer_idx, shared
        # (the shared state this layer reads at every step, as attributes)
        self.copies, self.recording, self.step_masses = shared.copies, shared.recording, shared.masses
        self.positions, self.targets, self.step_plans = shared.positions, shared.targets, shared.plans
        self.rows: list[RowState | None] = []
        self.flat_rows = FlatRows()
        self.last_score_plan = ScorePlan([], [], False)
        self.entry_constants = EntryConstants(None, None)
        self.staged_pages = 0  # staging pages this step's recall filled (the last ones before the main pages)
        self.pads = None  # a left-padded prefill of several rows: each row's pad count (else None)
        self.recalled_ids = None  # this step's recalled ids, when placed with the other layers (`copies.LayerIds`)
        self.last_query = None  # [rows, Hq, d]: each row's last query, under a rule that keeps it (`keep_query`)
        self.recall_region = None  # a recall buffer's blocks in HBM (`tracer.cache.recall.buffer_region`)
        self.hits_from_hbm: bool | None = None  # read a buffer's hits from that region (None: on a GPU)

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
        # (a recall buffer makes each layer's copied bytes its own: hits differ by layer)
        self.sharing = PlanSharing(RECALL_RULES[self.spec.recall_rule].counts_known and not self.spec.recall_buffer_blocks,
                                   not counts_are_exact(self.spec))
        self.keeps_query = self.spec.uses_ddr and RECALL_RULES[self.spec.recall_rule].keeps_query
        if self.initialized:
            self.grow_rows(len(self.rows))
            self.clear_row(row)

    def row_index(self, rows: list[int]) -> RowIndex:
        """`rows` as indices into the shared tensors (made once per set of rows, for every layer)."""
        return self.shared.rows.index_of(rows, self.device)

    # -- the step's host plans ---------------------------------------------------------------------------------
    def plan(self, name: str, n_new: int, make, reads_recall: bool = False):
        """What the host derives from its rows' counts for `name` this forward: made by the forward's first layer
        and reused by the others (`step_plans`, which the cache clears as each forward begins), where every
        layer's rows hold the same counts: a decode step (one token per row) under a policy whose counts follow
        from the lengths (`counts_are_exact`: each layer then places alike) or, where a placement's counts are
        data-dependent, a step that begins with every layer's counts alike (`StepShared.counts_alike`: each
        layer's placement reads back its own counts, which may leave the layers unlike for the next step); and,
        for a plan that `reads_recall` (this step's recalled blocks), a rule whose recall counts are known (the
        per-head rule's union differs by layer). Otherwise each layer makes its own. At B = 16 on a 28-layer
        model the per-row lists these are took ~60 us per layer and step."""
        if not self.layers_share_plans(n_new, reads_recall):
            return make()
        plan = self.step_plans.get(name)
        if plan is None:
            plan = self.step_plans[name] = make()
        return plan

    def layers_share_plans(self, n_new: int, reads_recall: bool = False) -> bool:
        return (n_new == 1 and (self.sharing.recall or not reads_recall)
                and (self.shared.counts_alike or not self.sharing.checked))

    # -- a forward's two calls -----------------------------------------------------------------------------------
    def update(self, rows: list[int], key_states: torch.Tensor, value_states: torch.Tensor,
               new_tokens: list[int] | None = None) -> None:
        """Append each row's new K/V [rows, Hkv, n, d]. A multi-token forward of several rows is a prefill of fresh
        rows, left-padded to a common length: `new_tokens` gives each row's real count (its last ones)."""
        append(self, rows, key_states, value_states, new_tokens)

    def attend(self, rows: list[int], query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Recall for the rows' current queries, attend their pages + recalled blocks, then score, record and
        place. Returns the attention output [rows, lq, Hq, d]."""
        states = [self.rows[r] for r in rows]
        rows_t, selected = self.row_index(rows)
        # Whether this step's layers are scored and placed together, after the last one (`layers_alike`)
        together = self.layers_share_plans(query.shape[-2], reads_recall=True) and self.plan(
            "layers", 1, lambda: self.layers_alike(rows, states), reads_recall=True)
        hidden = recall(self, rows, states, rows_t, query, together, scaling) if query.shape[-2] == 1 else None
        if self.keeps_query:  # (after recall: this step's recall read the previous step's)
            self.keep_query(selected, query)
        # The slots in use, one range: the staging pages this step's recall filled (the last `staged_pages`),
        # then the main pages up to the fullest row's resident blocks (packed at the front).
        bs, staging = self.block_size, self.n_staging_pages
        resident = self.plan("resident", query.shape[-2], lambda: max(s.hbm_blocks() for s in states))
        used = slice((staging - self.staged_pages) * bs, (staging + resident) * bs)
        keys, values, slot_pos, empty_slots = self.attended(selected, used,
                                                            query.dtype if query.shape[-2] == 1 else None)
        query_start = states[0].query_start if self.pads is None else self.query_starts  # per row when padded
        # (layers placed together hand back their weights per head: `after_attention_of_layers` reduces them all)
        output, weights_mean, weights_max = attend(query, keys, values, scaling, slot_pos, query_start,
                                                   None if hidden is None else hidden[:, :, used],
                                                   reduce_heads=not together, empty_slots=empty_slots)
        if together:
            self.tables.pending.append(Attended(self, rows, states, rows_t, weights_mean, keys, values, slot_pos))
            if self.layer_idx == self.tables.n_layers - 1:  # the step's last layer has attended
                self.tables.run_pending()
        else:
            self.after_attention(rows, states, rows_t, weights_mean, weights_max, keys, values, slot_pos)
        return output

    def keep_query(self, selected: slice | torch.Tensor, query: torch.Tensor) -> None:
        """Each of the rows' last query [rows, Hq, lq, d] -> `last_query` (what `prev-step` reads at the next
        step: at a prefill the prompt's last; a left-padded prefill's rows all end on a real token). One copy."""
        last = query[:, :, -1]
        kept, n_rows = self.last_query, len(self.rows)
        if kept is None or kept.shape[0] < n_rows or kept.shape[1:] != last.shape[1:] or kept.dtype != last.dtype:
            grown = last.new_zeros((max(n_rows, self.rows_hint), *last.shape[1:]))
            if kept is not None and kept.shape[1:] == last.shape[1:] and kept.dtype == last.dtype:
                grown[: kept.shape[0]] = kept
            self.last_query = kept = grown
        kept[selected] = last

    # -- after attention ---------------------------------------------------------------------------------------
    def after_attention(self, rows, states, rows_t, weights_mean, weights_max, keys, values, slot_pos) -> None:
        """Score, record and place after this layer's attention (a decode step of layers alike does it for every
        layer at once: `tracer.cache.step.after_attention_of_layers`)."""
        lengths = self.lengths  # [rows]: each row's logical length (made by `update`, which just ran for these rows)
        valid = slot_pos >= 0  # the slots holding an entry (the scorers'; attention makes its own mask)
        # Empty slots (weight 0) point at each row's scratch position, one past its last token.
        positions = torch.where(valid, slot_pos, lengths[:, None])
        score(self, rows, states, rows_t, lengths, positions, weights_mean, weights_max, keys, values, valid)
        query_tokens = weights_mean.shape[1]
        plan = self.plan("after", query_tokens, lambda: self.after_plan(rows, states, query_tokens), reads_recall=True)
        if len(plan.placing) < len(states):
            for state in states:
                if state.defer_placement:  # a prefill chunk before the last: scored, not placed nor recorded
                    state.deferred_query_tokens += query_tokens
        if not plan.placing:
            return
        if plan.decoding:
            add_importance(self, rows, rows_t, plan.decoding, positions, weights_mean, weights_max)
        masses = occupancy(self, plan.mass_shape, weights_mean[:, -1], positions) if plan.recording else None
        self.place_and_record(rows, states, plan, masses, query_tokens)

    def place_and_record(self, rows, states, plan: AfterPlan, masses, query_tokens: int) -> None:
        moves = place(self, rows, states, plan.placing, query_tokens)
        # (This step's staging pages keep their entries: attention reads only the staging pages its own step's
        # recall filled, `staged_pages`, reset by `update`, so a stale page is never attended nor cleared.)
        errors = quant_errors(self, rows, moves)
        recording = plan.recording
        if recording:
            # The rows' host counts and device values (masses, moved and recalled ids, quantization errors),
            # resolved with every other layer's at step end (tracer.recorder.StepRows).
            n = len(recording)
            recorded = states if n == len(states) else [states[i] for i in recording]
            if moves:
                moved = [moves.get(rows[i]) for i in recording]
                bytes_d2h = [0 if m is None else m.bytes_d2h for m in moved]
            else:  # (most steps place nothing: the shared per-row "nothing", as the recorder checks it)
                moved, bytes_d2h = repeated(None, n), repeated(0, n)
            entry = LayerEntry(
                self.recording_constants(), plan.rows.host, bytes_d2h, masses, self.layer_idx,
                None if n == len(rows) else recording, [s.recalled for s in recorded], moved,
                [errors.get(rows[i]) for i in recording] if errors else repeated(None, n))
            if self.spec.recall_buffer_blocks:  # the buffer's hits, and the blocks it holds (HBM)
                entry.hits = [s.buffer_hits if s.recalled is not None else 0 for s in recorded]
                entry.buffer_blocks = [0 if s.recall_buffer is None else len(s.recall_buffer) for s in recorded]
            self.recording.add(plan.rows.row_ids, recorded, entry)
        for i in plan.placing:
            state = states[i]
            state.deferred_query_tokens = 0
            state.step = state.step_index() + 1

    def layers_alike(self, rows: list[int], states: list[RowState]) -> bool:
        """Whether this decode step's layers (whose host plans are shared: `plan`) are scored, recorded and placed
        together after the last one has attended (`tracer.cache.step.after_attention_of_layers`): the rows are
        every row of the tables (so that [layers, rows] flattens to one axis as a view), none defers its
        placement, and they are scored by one scorer that only adds the weights (H2O) or by none."""
        scoring = score_plan(self, states)
        if scoring.active:
            scorer = states[scoring.active[0]].settings.scorer
            if not (scoring.shared and len(scoring.active) == len(rows) and scorer.adds_weights_only):
                return False
        return rows == list(range(self.tables.tensors[0].shape[1])) and not any(s.defer_placement for s in states)

    def after_plan(self, rows: list[int], states: list[RowState], query_tokens: int) -> AfterPlan:
        placing = [i for i, s in enumerate(states) if not s.defer_placement]
        decoding = tuple(i for i in placing if query_tokens == 1 and states[i].step_index() > 0
                         and states[i].settings.track_importance)
        recording = [i for i in placing if states[i].recorder is not None]
        if not recording:
            return AfterPlan(placing, decoding, recording, None, None)
        host = [(s.logical_len - s.query_start + s.deferred_query_tokens, s.logical_len, s.blocks(),
                 s.n_ddr_blocks, s.n_evicted_blocks, s.recalled_blocks, s.bytes_h2d)
                for s in (states[i] for i in recording)]
        # (every batch entry's attention is scattered, recorded or not: the width covers every row's blocks, and
        # a scratch position, the row's length, falls in its block count's column)
        lengths = [s.logical_len for s in states]
        mass_shape = MassShape((tuple(rows), tuple(lengths)), n_blocks(self.spec, max(lengths)) + 1)
        return AfterPlan(placing, decoding, recording, RecordingRows(tuple(rows[i] for i in recording), host),
                         mass_shape)

    def recording_constants(self) -> tuple[int, int, int, int]:
        """`LayerEntry.constants` (layer, block size, KV bytes of an HBM token, bytes of a DDR block), kept with
        the DDR store they were read from (a refilled row may bring another)."""
        if self.entry_constants.store is not self.ddr:
            self.entry_constants = EntryConstants(
                self.ddr, (self.layer_idx, self.block_size, self.token_bytes, self.ddr.block_bytes()))
        return self.entry_constants.constants
