"""After a layer attends: its rows' token scores, importance and block masses, from the attention weights.

The scorer (tracer/scorers) turns the step's attention weights (mean and max over the query heads, per slot)
into token scores, which placement ranks blocks by; `importance` accumulates the last query's weights over the
decode steps (the tokens table, the oracle scorer); the block masses (the last query's weight per block) are
what the trace records as `mass_hbm` / `mass_ddr` and the access table. Empty slots carry weight 0 and point at
a scratch position. Rows whose scorers keep no per-sample state and share settings are scored in one call
(`ScorePlan`); a decode step of layers alike does all of this for every layer at once
(`tracer.cache.step.after_attention_of_layers`).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from tracer.cache.indexing import block_of, cached_device_index, consecutive
from tracer.cache.rows import RowState
from tracer.recorder import Deferred
from tracer.scorers import Observation


class ScorePlan(NamedTuple):
    """Which batch entries score and whether in one call, decided once per set of rows (`score_plan`)."""

    states: list  # the rows' states it was decided for (kept alive here, so never a stale identity)
    active: list[int]  # the batch entries that score
    shared: bool  # whether they share one scorer call


def score_plan(layer, states: list[RowState]) -> ScorePlan:
    """(Decided once per set of rows: the same states step after step.) Rows whose scorers keep no per-sample
    state and have the same settings share a call; the others (oracle, gradient, AlsoScore) are scored one row
    at a time, with the same code. Scorers are compared by identity and repr (dataclasses that may hold tensors)."""
    plan = layer.last_score_plan
    if len(plan.states) == len(states) and all(map(operator.is_, plan.states, states)):
        return plan
    scorers = [s.settings.scorer for s in states]
    active = [i for i, s in enumerate(states) if scorers[i] is not None and (
        s.spec.policy != "full" or getattr(scorers[i], "score_under_full", False))]
    first = scorers[active[0]] if active else None
    shared = bool(active) and first.batchable and all(
        type(scorers[i]) is type(first) and repr(scorers[i]) == repr(first) for i in active)
    layer.last_score_plan = ScorePlan(list(states), active, shared)
    return layer.last_score_plan


def _subset(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows into the layer's tensors: a slice (a view) when consecutive, else a kept device index."""
    return slice(rows[0], rows[0] + len(rows)) if consecutive(rows) else cached_device_index(tuple(rows), str(device))


def score(layer, rows, states, rows_t, lengths, positions, weights_mean, weights_max, keys, values, valid) -> None:
    """The scorer's update of the rows' token scores (in place where it can)."""
    plan = score_plan(layer, states)
    active, shared = plan.active, plan.shared
    if not active:
        return
    width, pads = layer.token_scores.shape[1], layer.pads
    # A left-padded prefill is scored row by row, on each row's real queries: a scorer that reads the last
    # queries (snapkv, rkv) then sees exactly what the row alone would.
    groups = [active] if shared and pads is None else [[i] for i in active]
    for group in groups:
        scorer = states[group[0]].settings.scorer
        if len(group) == len(rows) and pads is None:  # every row, unpadded: the tensors as they are
            observation = Observation(layer.layer_idx, states[group[0]].step_index(), width, positions,
                                      weights_mean, weights_max, keys, values=values, valid=valid)
            selected, score_rows, score_lengths = layer.row_index(rows).select, rows_t, lengths
        else:
            # (one row, as a padded prefill scores them: views of it, not gathers)
            index = slice(group[0], group[0] + 1) if len(group) == 1 else cached_device_index(tuple(group),
                                                                                              str(layer.device))
            pad = 0 if pads is None else pads[group[0]]
            observation = Observation(
                layer.layer_idx, states[group[0]].step_index(), width, positions[index],
                weights_mean[index][:, pad:], weights_max[index][:, pad:], keys[index], values=values[index],
                valid=valid[index],
            )
            selected, score_rows, score_lengths = _subset([rows[i] for i in group], layer.device), rows_t[index], \
                lengths[index]
        previous = layer.token_scores[selected]  # a view for consecutive rows: in-place scorers write through
        scores = scorer.score(observation, previous)
        if scores is not previous or not isinstance(selected, slice):
            layer.token_scores[selected] = scores[:, :width]
        if not scorer.adds_weights_only:  # the scratch positions (weight 0 added leaves them at 0)
            layer.token_scores[score_rows, score_lengths] = 0.0


def add_importance(layer, rows, rows_t, decoding: tuple[int, ...], positions, weights_mean, weights_max) -> None:
    """Add the last query's attention (mean and max over heads) of the batch entries `decoding` to their rows'
    importance."""
    selected = layer.row_index(rows).select
    if len(decoding) == len(rows) and isinstance(selected, slice):  # the rows' slice: in place
        layer.importance[selected].scatter_add_(1, positions, weights_mean[:, -1])
        layer.importance_max[selected].scatter_add_(1, positions, weights_max[:, -1])
    else:
        index = cached_device_index(decoding, str(layer.device))
        target_rows = rows_t[index].repeat_interleave(positions.shape[1])
        at = positions[index].reshape(-1)
        layer.importance.index_put_((target_rows, at), weights_mean[index, -1].reshape(-1), accumulate=True)
        layer.importance_max.index_put_((target_rows, at), weights_max[index, -1].reshape(-1), accumulate=True)


def occupancy(layer, mass_shape, last_weights: torch.Tensor, positions: torch.Tensor) -> Deferred:
    """The attention masses of every batch entry's blocks, in this layer's slice of the step's one tensor for
    every layer (`tracer.cache.step.StepMasses`, of `mass_shape`), which reaches the host in the step's one copy
    (`DeferredCopies`). Empty slots carry weight 0, so where their scratch position lands adds nothing. (A
    recalled block is in DDR, so its mass is that of its staged slots: the DDR mass is theirs, on the host.)"""
    block_mass, masses = layer.step_masses.layer(layer.copies, mass_shape, layer.layer_idx, layer.device)
    block_mass.scatter_add_(1, block_of(positions, layer.block_size), last_weights)
    return masses
