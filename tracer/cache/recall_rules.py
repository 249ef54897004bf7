"""Recall rules: which DDR blocks a recalling row's attention reads at a decode step (a registry).

One class per rule (`traces.policy.TRACER_RECALL_RULES`), one method: `select(request) -> RecallChoice`, on
the device, for every recalling row of a layer at once. A request carries the rows' current queries, how many
blocks each may recall (`wanted`, host-known: `traces.policy.recall_blocks`, at most its DDR blocks) and the
layer (`tracer.cache.layer.PagedLayer`: its DDR store, whose `bounds` are Quest's per-block key bounds and the
DDR mask, `tracer.transfer.KeyBounds`; its pages; its token scores), so that a rule may rank by a bound under
the query (quest), by the true attention over every key (an oracle) or by what earlier steps scored. What a
rule declares:
- `uses_query`: whether its choice needs this layer's current query; a rule that does not can be decided
  before the layer runs (prefetched, overlapping the copy with earlier compute);
- `counts_known`: whether each row recalls exactly its `wanted` blocks (the host then sizes the copy without
  reading the device, and the layers of a step share their recall plans);
- `keeps_query` / `reads_layer_inputs`: whether the layer must keep its rows' last query (the previous step's,
  `PagedLayer.keep_query`) or the decode loop must catch every decoder layer's input
  (`tracer.cache.speculation.watch_layer_inputs`), for a rule that speculates the query (`tracer.cache.speculation`);
- a per-head choice returns `head_picks` (which KV heads attend each recalled block; the others' attention
  masks it out).
The copy of the chosen blocks into the staging pages is `tracer.cache.recall`'s, whatever the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from tracer.cache.indexing import cached_device_index
from tracer.cache.speculation import previous_layer_query, previous_step_query


@dataclass
class RecallRequest:
    """A layer's recalling rows at a decode step."""

    query: torch.Tensor  # [m, Hkv, group, d]: the rows' current queries, grouped by KV head
    rows: slice | torch.Tensor  # the m rows, into the layer's [rows, ...] tensors (a slice: consecutive)
    wanted: tuple[int, ...]  # blocks each row may recall (> 0, at most its DDR blocks)
    n_blocks: int  # block ids below this (the most blocks any of the rows has)
    layer: object  # the `PagedLayer`: `ddr` (its `bounds`: `KeyBounds`), pages, `token_scores` (earlier steps')
    scaling: float | None = None  # the attention's logit scale (the oracle's softmax; None: head_dim ** -0.5)
    entries: torch.Tensor | None = None  # the m rows' batch entries in this forward (None: every entry, in order)
    _wanted: torch.Tensor | None = field(default=None, repr=False)

    def wanted_tensor(self) -> torch.Tensor:
        """`wanted` on the device (kept per distinct counts: built once, not per layer)."""
        if self._wanted is None:
            self._wanted = cached_device_index(self.wanted, str(self.query.device))
        return self._wanted


class RecallChoice(NamedTuple):
    ids: torch.Tensor  # [m, width] block ids: row i's first `per_row[i]` are its picks (width = max(per_row))
    per_row: tuple[int, ...] | list[int]  # picks per row (host)
    head_picks: torch.Tensor | None = None  # [m, width, Hkv] bool: which KV heads attend each pick (per-head)


class RecallRule:
    name: ClassVar[str]
    uses_query: ClassVar[bool] = True
    counts_known: ClassVar[bool] = True
    keeps_query: ClassVar[bool] = False
    reads_layer_inputs: ClassVar[bool] = False

    def select(self, request: RecallRequest) -> RecallChoice:
        raise NotImplementedError


class Quest(RecallRule):
    """Quest (Tang et al., 2024, arXiv:2406.10774): every DDR block gets the upper bound `max over query heads of
    sum_d max(q_d * kmin_d, q_d * kmax_d)` of its attention logit under the current query (one GEMM,
    `KeyBounds.logit_bounds`, every block outside DDR at the dtype's lowest value); each row recalls its top
    `wanted` blocks, and every head attends them. `query_of` is the query the bound is taken under (the
    speculative rules below give another)."""

    name = "quest"

    def query_of(self, request: RecallRequest) -> torch.Tensor:
        return request.query

    def select(self, request: RecallRequest) -> RecallChoice:
        bounds = request.layer.ddr.bounds.logit_bounds(self.query_of(request), request.rows, request.n_blocks)
        best = bounds.flatten(1, 2).amax(1)  # [m, blocks]: the max over the query heads
        # By bound, highest first: a row's first `wanted` are its picks, in that order (the trace records them
        # sorted; attention reads them as a set).
        return RecallChoice(best.topk(max(request.wanted), dim=1).indices, request.wanted)


class QuestPerHead(Quest):
    """Each KV head ranks the DDR blocks by the Quest bound maximised over its own query group and picks its own
    top `wanted`; a block is copied once when any head picks it (the union is what moves and what the trace
    records), and each KV head attends only the recalled blocks it picked (`head_picks`; the others' are masked
    out of its softmax, so its accuracy is the per-head rule's, not the union's). The union's size is
    data-dependent: one read-back per layer."""

    name = "quest-per-head"
    counts_known = False

    def select(self, request: RecallRequest) -> RecallChoice:
        bounds = request.layer.ddr.bounds.logit_bounds(self.query_of(request), request.rows, request.n_blocks)
        k_max = max(request.wanted)
        rank = torch.arange(k_max, device=bounds.device)
        counts = request.wanted_tensor()
        in_ddr = request.layer.ddr.bounds.in_ddr(request.rows, request.n_blocks)
        per_head = bounds.amax(2).transpose(1, 2)  # [m, blocks, Hkv] (outside DDR: the lowest value)
        top = per_head.topk(k_max, dim=1).indices  # [m, k_max, Hkv]
        picks = torch.zeros_like(per_head, dtype=torch.bool)
        picks.scatter_(1, top, (rank < counts[:, None])[:, :, None].expand_as(top))
        picks &= in_ddr[:, :, None]
        union = picks.any(2)
        per_row = union.sum(1).tolist()  # (the read-back)
        ids = torch.argsort((~union).to(torch.int8), dim=1, stable=True)[:, : max(per_row)]
        head_picks = picks.gather(1, ids[:, :, None].expand(-1, -1, picks.shape[2]))
        return RecallChoice(ids, per_row, head_picks)


class Oracle(RecallRule):
    """A ceiling, not a deployable rule: each row recalls the `wanted` DDR blocks with the largest true attention
    mass under its current query, from an exact softmax over every key it still has (its resident ones in the
    pages and every DDR block, read from the store as attention would read it); the mass is the mean over query
    heads, as the trace records it. It costs a full attention over the context per layer (and reads the DDR
    store back), so it says what a perfect selection would keep at the same recall traffic, nothing about what
    a system could run. (The simulator's `query` rule ranks by the masses a trace recorded, which cover only what
    that run attended: an approximation of this one.)"""

    name = "oracle"

    def select(self, request: RecallRequest) -> RecallChoice:
        layer, k_max = request.layer, max(request.wanted)
        in_ddr = layer.ddr.bounds.in_ddr(request.rows, request.n_blocks)  # [m, blocks]
        rows = request.rows
        row_ids = list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()
        scaling = request.scaling if request.scaling is not None else layer.head_dim ** -0.5
        main = layer.main_slots
        picks = torch.zeros(len(row_ids), k_max, dtype=torch.long, device=in_ddr.device)
        for i, row in enumerate(row_ids):
            ddr_ids = in_ddr[i].nonzero().squeeze(1)
            stored = layer.slot_pos[row, main] >= 0
            resident = layer.keys[row][:, main][:, stored]  # [Hkv, r, d]
            ddr_keys = layer.ddr.get(torch.full_like(ddr_ids, row), ddr_ids, row=row)[0]  # [n, Hkv, block, d]
            ddr_keys = ddr_keys.permute(1, 0, 2, 3).flatten(1, 2).to(resident.dtype)  # [Hkv, n * block, d]
            keys = torch.cat([resident, ddr_keys], 1).float()
            weights = torch.softmax(torch.einsum("hgd,hkd->hgk", request.query[i].float(), keys) * scaling, -1)
            mass = weights[..., resident.shape[1]:].mean((0, 1)).view(len(ddr_ids), -1).sum(1)  # [n]
            order = torch.argsort(-mass, stable=True)[: request.wanted[i]]  # (ties: the lower block id)
            picks[i, : len(order)] = ddr_ids[order]
        return RecallChoice(picks, request.wanted)


class Score(RecallRule):
    """Known before the layer runs: each row recalls the `wanted` DDR blocks with the highest score from earlier
    steps (its scorer's token scores, summed per block: under h2o the attention each block has received so far).
    It reads nothing of this step's query, so its copy can be issued before the layer (layer prefetch). Ties rank
    by block id."""

    name = "score"
    uses_query = False

    def select(self, request: RecallRequest) -> RecallChoice:
        layer, n = request.layer, request.n_blocks
        bs = layer.block_size
        scores = layer.token_scores[request.rows]  # [m, positions]: written after earlier steps' attention
        width = min(scores.shape[1], n * bs)
        block_scores = torch.zeros(scores.shape[0], n * bs, dtype=torch.float32, device=scores.device)
        block_scores[:, :width] = scores[:, :width]
        block_scores = block_scores.view(-1, n, bs).sum(2)
        in_ddr = layer.ddr.bounds.in_ddr(request.rows, n)
        key = block_scores.masked_fill_(~in_ddr, -torch.inf)
        order = torch.argsort(-key, dim=1, stable=True)[:, : max(request.wanted)]
        return RecallChoice(order, request.wanted)


def _grouped(request: RecallRequest, query: torch.Tensor) -> torch.Tensor:
    """A query [m, Hq, d] grouped by KV head as the request's, [m, Hkv, group, d], in the cache's dtype."""
    return query.reshape(request.query.shape).to(request.query.dtype)


class PrevLayer(Quest):
    """Quest's bound under layer i's query speculated from the input of layer i - 1 (InfiniGen's speculation,
    Lee et al., OSDI '24: that hidden state through layer i's own input norm, `q_proj` and RoPE at the current
    position; layer 0: its query of the previous step), so the choice exists before layer i runs and its copy can
    overlap layer i - 1's compute (`tracer.cache.speculation`). The current query is not read."""

    name = "prev-layer"
    uses_query = False
    keeps_query = True  # (layer 0)
    reads_layer_inputs = True

    def query_of(self, request: RecallRequest) -> torch.Tensor:
        return _grouped(request, previous_layer_query(request.layer, request.entries, request.rows))


class PrevLayerPerHead(QuestPerHead):
    """quest-per-head's choice (each KV head its own top blocks, the union copied, each head attending its own)
    under `prev-layer`'s speculated query."""

    name = "prev-layer-per-head"
    uses_query = False
    keeps_query = True
    reads_layer_inputs = True
    query_of = PrevLayer.query_of


class PrevStep(Quest):
    """Quest's bound under the layer's query of the previous decode step (for a row's first decode step, its
    prompt's last query), known one step ahead: the choice of every layer exists before the step begins. The
    current query is not read."""

    name = "prev-step"
    uses_query = False
    keeps_query = True

    def query_of(self, request: RecallRequest) -> torch.Tensor:
        return _grouped(request, previous_step_query(request.layer, request.rows))


class PrevStepPerHead(QuestPerHead):
    """quest-per-head's choice under `prev-step`'s query."""

    name = "prev-step-per-head"
    uses_query = False
    keeps_query = True
    query_of = PrevStep.query_of


RECALL_RULES: dict[str, RecallRule] = {rule.name: rule for rule in (
    Quest(), QuestPerHead(), Oracle(), Score(), PrevLayer(), PrevLayerPerHead(), PrevStep(), PrevStepPerHead())}
