"""What a step shares between a cache's layers: its host plans, its score tables, its masses, its deferred work.

Where every layer's rows hold the same counts (a decode step under a policy whose counts follow from the
lengths, `tracer.cache.placements.Placement.counts_known`, or one that begins with them alike where they are
data-dependent, `tracer.cache.layer.counts_alike`), what the host derives from them (which rows open a
block, recall, place or record, each placement's targets and counts, the recording's host counts) is made
once per forward by its first layer and reused by the others (`StepShared.plans`, `PagedLayer.plan`). Under a
rule whose recall counts are known (quest) with a scorer that only adds the attention weights (H2O, or none),
such a step's scoring, importance and block masses run for every layer at once after the last layer has
attended (`after_attention_of_layers`: the layers' score tables are one [layers, rows, positions] tensor,
`LayerTables`), and each layer places after that; its next step is the first to read what its placement
moved, so the numbers are those of placing right after its own attention. That deferred work runs inside the
last layer's forward: the layer timer records it apart (`measured_deferred_us`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tracer.attention import head_mean_max
from tracer.cache.append import DecodePositions
from tracer.cache.copies import DeferredCopies, as_int64
from tracer.cache.indexing import BatchRows, block_of
from tracer.cache.placement import TargetsByLength
from tracer.cache.scoring import add_importance, score_plan
from tracer.cache.speculation import LayerInputs
from tracer.recorder import Deferred, StepRecording
from tracer.scorers import Observation


class MassShape(NamedTuple):
    """The step's mass tensor: made for `key` (the rows and their lengths), `width` = blocks + 1 (a scratch)."""

    key: tuple
    width: int


class StepMasses:
    """A step's block masses for every layer of a cache: one zeroed [layers, batch entries, blocks + 1] float32
    tensor, added to the step's copy once, into whose slice each recording layer scatters its attention (not a
    tensor and a copy per layer). A new one per forward: its key (the rows and their lengths) changes with every
    forward, as each appends."""

    def __init__(self, n_layers: int):
        self.n_layers, self.key, self.tensor, self.deferred = n_layers, None, None, None

    def layer(self, copies: DeferredCopies, shape: MassShape, layer_idx: int, device
              ) -> tuple[torch.Tensor, Deferred]:
        if shape.key != self.key or copies.fetched_since(self.deferred):
            dims = (self.n_layers, len(shape.key[0]), shape.width)  # [layers, batch entries, blocks + 1]
            self.tensor = torch.zeros(dims, dtype=torch.float32, device=device)
            self.deferred = copies.add(self.tensor, lambda a, dims=dims: a.reshape(dims))
            self.key = shape.key
        return self.tensor[layer_idx], self.deferred


class Attended(NamedTuple):
    """A layer's attention at a decode step, held until the step's last layer has attended (`LayerTables`)."""

    layer: object  # the `PagedLayer`
    rows: list[int]
    states: list
    rows_t: torch.Tensor
    weights: torch.Tensor  # [rows, Hq, 1, n] per head
    keys: torch.Tensor
    values: torch.Tensor
    slot_pos: torch.Tensor  # [rows, n]


class LayerTables:
    """Every layer's token scores, importance and max importance, one [layers, rows, positions] float32 tensor each
    (a layer's `token_scores` etc. are its views, rebound when the tables grow), so that a decode step adds every
    layer's attention with one kernel each (`after_attention_of_layers`); and that step's per-layer attention
    (`pending`), held until the last layer has attended. `timer` (the decode loop's `tracer.decode.LayerTimer`,
    when it times layers) times that deferred work apart."""

    NAMES = ("token_scores", "importance", "importance_max")

    def __init__(self, n_layers: int):
        self.n_layers, self.layers, self.tensors, self.pending = n_layers, [], None, []
        self.timer = None

    def run_pending(self) -> None:
        """Score, record and place the layers that attended and wait (`after_attention_of_layers`)."""
        if self.pending:
            entries, self.pending = self.pending, []
            timer = self.timer
            if timer is None:
                after_attention_of_layers(entries)
                return
            timer.begin_deferred()
            after_attention_of_layers(entries)
            timer.end_deferred()

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


@dataclass
class StepShared:
    """What a `TieredCache`'s layers share (one of each per cache)."""

    n_layers: int
    copies: DeferredCopies = field(default_factory=DeferredCopies)  # the step's one device->host copy
    recording: StepRecording = field(default_factory=StepRecording)  # the recorders' rows of each step
    masses: StepMasses | None = None  # the step's block masses, every layer's
    tables: LayerTables | None = None  # every layer's score tables, and the attention waiting for the last layer
    plans: dict = field(default_factory=dict)  # this forward's host plans by name (cleared as a forward begins)
    # under data-dependent counts: whether this forward began with every layer's counts alike (set as it begins)
    counts_alike: bool = False
    positions: DecodePositions = field(default_factory=DecodePositions)  # a decode append's new positions
    targets: TargetsByLength = field(default_factory=TargetsByLength)  # the policy's targets by length
    rows: BatchRows = field(default_factory=BatchRows)  # the active rows as an index
    # this forward's decoder layer inputs, for a rule that speculates from them (tracer.cache.speculation)
    layer_inputs: LayerInputs = field(default_factory=LayerInputs)

    def __post_init__(self):
        self.masses = self.masses or StepMasses(self.n_layers)
        self.tables = self.tables or LayerTables(self.n_layers)


def after_attention_of_layers(entries: list[Attended]) -> None:
    """A decode step's scoring, importance and block masses for every layer at once, after its last layer has
    attended (`PagedLayer.layers_alike`): the layers' attention weights ([rows, Hq, 1, n] each, one n under the
    policies this runs for) stacked on a layer axis, reduced over the heads and added into the layers' tables
    (`LayerTables`, [layers x rows, positions] views) and the step's mass tensor ([layers x batch entries,
    blocks + 1]) with one kernel each, not one per layer; then each layer places and records, in order. The same
    numbers as each layer's own `PagedLayer.after_attention`: a layer's scores, importance and masses are the
    sums of its own weights either way, and its placement (after its scoring) changes only its own next step.
    On the micro model at B = 1 this was ~4 % of a traced step; on a 28-layer model it removes ~6 of ~75 kernels
    per layer and step."""
    first, rows, states = entries[0].layer, entries[0].rows, entries[0].states
    layer_ids = [entry.layer.recalled_ids for entry in entries if entry.layer.staged_pages]  # (layers that recalled)
    if layer_ids:  # every layer's recalled ids in one copy: [layers x recalled]
        ids = torch.cat([part.ids for part in layer_ids])
        deferred, base = first.copies.add(ids, as_int64), 0
        for part in layer_ids:
            part.deferred, part.base = deferred, base
            base += part.ids.shape[0]
    if len(entries) != first.tables.n_layers or len({entry.slot_pos.shape[1] for entry in entries}) != 1:
        for entry in entries:  # (layers that attended unlike: each its own)
            entry.layer.after_attention(entry.rows, entry.states, entry.rows_t, *head_mean_max(entry.weights),
                                        entry.keys, entry.values, entry.slot_pos)
        return
    per_head = torch.stack([entry.weights for entry in entries])
    slot_pos = torch.stack([entry.slot_pos for entry in entries])
    weights_mean, weights_max = head_mean_max(per_head)  # [layers, rows, 1, n] each
    # An empty slot (weight exactly 0) points at position 0, not at its row's scratch position: the scorers run
    # here only add weights (`layers_alike`), and so do importance and masses, and adding 0 changes nothing.
    positions = slot_pos.clamp_min(0).flatten(0, 1)  # [layers x rows, n]
    weights_mean, weights_max = weights_mean.flatten(0, 1), weights_max.flatten(0, 1)
    active = score_plan(first, states).active
    token_scores, importance, importance_max = (tensor.flatten(0, 1) for tensor in first.tables.tensors)
    if active:  # one scorer that adds the weights: in place
        scorer = states[active[0]].settings.scorer
        observation = Observation(None, states[active[0]].step_index(), token_scores.shape[1], positions,
                                  weights_mean, weights_max, None)
        scores = scorer.score(observation, token_scores)
        if scores is not token_scores:
            token_scores.copy_(scores[:, : token_scores.shape[1]])
    plan = first.plan("after", 1, lambda: first.after_plan(rows, states, 1), reads_recall=True)
    if len(plan.decoding) == len(rows):
        importance.scatter_add_(1, positions, weights_mean[:, -1])
        importance_max.scatter_add_(1, positions, weights_max[:, -1])
    elif plan.decoding:
        for index, entry in enumerate(entries):
            part = slice(index * len(rows), (index + 1) * len(rows))
            add_importance(entry.layer, entry.rows, entry.rows_t, plan.decoding, positions[part], weights_mean[part],
                           weights_max[part])
    masses = None
    if plan.recording:
        _, masses = first.step_masses.layer(first.copies, plan.mass_shape, 0, first.device)
        first.step_masses.tensor.flatten(0, 1).scatter_add_(1, block_of(positions, first.block_size),
                                                            weights_mean[:, -1])
    for entry in entries:
        entry.layer.place_and_record(entry.rows, entry.states, plan, masses, 1)
