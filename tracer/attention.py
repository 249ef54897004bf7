"""The attention function the tiered cache runs under (registered as `attn_implementation="thoughtkv"`).

The model calls `cache.update(k, v)` and then its attention function, which receives `module` (with
`layer_idx`), the query and the K/V that `update` returned. `update` leaves its layer here as "pending"; this
function takes it, asks it to recall DDR blocks for the *current* query (the recall rule therefore decides
from this layer's query: prefetching a layer's blocks before its query exists is a prediction, not this
rule), computes softmax attention over the layer's HBM pages + recalled entries (equal to sdpa: GQA, and the causal
mask among the new tokens at prefill; empty slots of the paged pool get weight 0), hands the new queries' weights (mean and max over heads) back to the layer, which
then scores and places blocks (offload/evict/promote) after attention. Without a pending tiered layer (e.g.
a plain DynamicCache) it is exactly sdpa.

The mask HF would build is None here (this name has no mask function): each row is attended on its own
without padding, so none is needed, and the causal part inside the prefill is applied below. A batched
forward pends a list of layers (one per row of `TieredCache.active`).
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "thoughtkv"
_pending: list = [None]  # the tiered layer whose update() ran last and whose attention comes next


def set_pending(layer) -> None:
    _pending[0] = layer


# On a CPU, a batched prefill attends at most this many logits at a time (rows x query heads x queries x keys;
# 4 MiB of float32, this box's L2): its logits, softmax and weighted sum then stay in cache between the passes over
# them (tests/bench/collect_throughput.py's traced prefill measures the difference). A GPU attends the batch at
# once (one launch per op, not one per chunk).
CHUNK_LOGITS = 1 << 20


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, key_positions: torch.Tensor,
    query_start: int, hidden_keys: torch.Tensor | None = None, reduce_heads: bool = True,
    empty_slots: EmptySlots | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Softmax attention with GQA over the slots of a paged cache layer, for a batch of rows (`_attend`), on a CPU
    in chunks of rows of at most `CHUNK_LOGITS` logits (each row's attention is its own: the same result)."""
    rows, row_logits = query.shape[0], query.shape[1] * query.shape[2] * key.shape[2]
    if rows == 1 or rows * row_logits <= CHUNK_LOGITS or query.device.type != "cpu" or not reduce_heads:
        return _attend(query, key, value, scaling, key_positions, query_start, hidden_keys, reduce_heads, empty_slots)
    # Each chunk writes its rows' slice of whole outputs (contiguous along rows): no concatenation after, which
    # would copy the chunks' (transposed) outputs and weights once more.
    n_heads, lq, head_dim = query.shape[1:]
    n_kv_heads = key.shape[1]
    outs = (query.new_empty((rows * n_kv_heads, n_heads // n_kv_heads * lq, head_dim)),
            query.new_empty((rows, lq, key.shape[2]), dtype=torch.float32),
            query.new_empty((rows, lq, key.shape[2]), dtype=torch.float32))
    step = max(1, CHUNK_LOGITS // row_logits)
    for first in range(0, rows, step):
        chunk = slice(first, first + step)
        _attend(query[chunk], key[chunk], value[chunk], scaling, key_positions[chunk],
                query_start[chunk] if isinstance(query_start, torch.Tensor) else query_start,
                None if hidden_keys is None else hidden_keys[chunk], out=(
                    outs[0][first * n_kv_heads : (first + step) * n_kv_heads], outs[1][chunk], outs[2][chunk]))
    return outs[0].view(rows, n_heads, lq, head_dim).transpose(1, 2), outs[1], outs[2]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, key_positions: torch.Tensor,
    query_start: int, hidden_keys: torch.Tensor | None = None, reduce_heads: bool = True,
    empty_slots: EmptySlots | None = None, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Softmax attention with GQA over the slots of a paged cache layer, for a batch of rows (in one pass).

    `query` [rows, Hq, lq, d], `key`/`value` [rows, Hkv, n_keys, d]. `key_positions` [rows, n_keys]: the
    logical position each key slot holds, -1 for an empty slot (a free page, an unused staging slot); the `lq`
    queries sit at positions [query_start, query_start + lq) (lq > 1: a prefill; `query_start` a tensor [rows]
    for rows left-padded to one length, where a pad's negative position reads position 0 only, so that it
    stays finite: its output is never used), and each attends the slots holding a position up to its own
    (causal, in any slot order). `hidden_keys` ([rows, Hkv, n_keys]
    bool, decode only): key columns a KV head's queries must not attend (the per-head recall rule's blocks
    picked by other heads). Blocked slots get weight exactly 0. `empty_slots` (decode): an `EmptySlots` its caller
    keeps for `key_positions` (one is made when it is absent or was made for another view).

    Returns the output [rows, lq, Hq, d] and the weights [rows, lq, n_keys] reduced over query heads (mean,
    max: `head_mean_max`), float32; with `reduce_heads` False, the output, the weights per head [rows, Hq, lq,
    n_keys] and None (a decode step's layers are then reduced together, one kernel each: tracer.cache). `out`
    (reduced heads only): where the output, as [rows x Hkv, group x lq, d], and the two weights go (`attend`'s
    chunks).
    """
    rows, n_heads, lq, head_dim = query.shape
    n_kv_heads, n_keys = key.shape[1], key.shape[2]
    group = n_heads // n_kv_heads  # query head h reads KV head h // group (HF's repeat_kv order)
    # One batched GEMM with the scaling folded in (a view of the pages: rows and KV heads collapse).
    grouped_query = query.reshape(rows * n_kv_heads, group * lq, head_dim)
    flat_keys = key.reshape(rows * n_kv_heads, n_keys, head_dim)
    if lq == 1:
        # A decode step: the mask rides in the GEMM as its input, min(position, 0) per row and KV head (one kernel)
        # times the dtype's largest value: exactly 0 added to an entry's logit, -max to an empty slot's, whose
        # weight is then exactly 0 (exp underflows), as with -inf; a kernel fewer than a mask and a `where` over
        # the logits, and no pass over them.
        if empty_slots is None or empty_slots.key_positions is not key_positions:
            empty_slots = EmptySlots(key_positions, n_kv_heads, query.dtype)
        logits = torch.baddbmm(empty_slots.fill(), grouped_query, flat_keys.transpose(1, 2),
                               beta=torch.finfo(query.dtype).max, alpha=scaling)
        logits = logits.view(rows, n_kv_heads, group, lq, n_keys)
    else:
        # (beta=0: the input is never read, only broadcast to the product's shape: one cached element, no allocation)
        logits = torch.baddbmm(_unread(query.dtype, query.device), grouped_query, flat_keys.transpose(1, 2), beta=0,
                               alpha=scaling, out=_prefill_logits(rows * n_kv_heads, group * lq, n_keys, query, reduce_heads))
        offsets = torch.arange(lq, device=query.device)
        if isinstance(query_start, torch.Tensor):  # per row, left-padded: a pad (negative) reads position 0
            query_positions = (query_start[:, None] + offsets).clamp_min(0)  # [rows, lq]
        else:
            query_positions = (offsets + query_start)[None]
            if rows > 1 and key_positions.device.type == "cpu" and torch.equal(
                    key_positions, key_positions[:1].expand_as(key_positions)):
                # Rows of one length, prefilled together, hold their tokens in the same slots: one row's mask
                # serves all (broadcast by the add below; the check is one pass over [rows, keys], the mask four
                # over [rows, queries, keys]).
                key_positions = key_positions[:1]
        blocked = (key_positions[:, None, :] > query_positions[:, :, None]) | (key_positions < 0)[:, None, :]
        # As an additive -inf / 0 bias, made at the mask's size and added in place (the logits are this call's
        # own, and a prefill's are rows x Hq x lq x keys: no second copy): the same logits as masked_fill_ (a
        # finite logit + 0 is itself), whose broadcast over the query heads took ~4x as long as this add.
        bias = torch.where(blocked, _negative_infinity(logits.dtype, logits.device), 0.0)[:, None, None]
        logits = logits.view(rows, n_kv_heads, group, lq, n_keys).add_(bias)  # bias: [rows, 1, 1, lq, n_keys]
    if hidden_keys is not None:
        logits = logits.masked_fill_(hidden_keys[:, :, None, None, :], float("-inf"))
    # (softmax's dtype argument only where it casts: on float32 logits it selects a slower kernel)
    logits = logits.view(rows, n_kv_heads, group * lq, n_keys)
    if logits.dtype != torch.float32:
        weights = torch.softmax(logits, -1, torch.float32)
    elif logits.requires_grad:  # (a scorer's backward pass through attention: out= has no grad)
        weights = torch.softmax(logits, -1)
    else:  # in place (the logits are this call's own): no second buffer of their size
        weights = torch.softmax(logits, -1, out=logits)
    # (bmm on the [rows x Hkv] batch, as the logits: a cheaper dispatch than matmul's 4-D broadcasting)
    flat_weights = weights.view(rows * n_kv_heads, group * lq, n_keys)
    output = torch.bmm(flat_weights if flat_weights.dtype == value.dtype else flat_weights.to(value.dtype),
                       value.reshape(rows * n_kv_heads, n_keys, head_dim), out=None if out is None else out[0])
    output = output.view(rows, n_heads, lq, head_dim).transpose(1, 2)
    per_head = weights.view(rows, n_heads, lq, n_keys)
    if not reduce_heads:
        return output, per_head, None
    return output, *head_mean_max(per_head, None if out is None else out[1:])


def head_mean_max(per_head: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention weights [..., Hq, lq, n_keys] -> their mean and max over the query heads, [..., lq, n_keys] each
    (what the scorers, importance and block masses add); into `out` when given."""
    if out is None:
        return per_head.mean(-3), per_head.amax(-3)
    return torch.mean(per_head, -3, out=out[0]), torch.amax(per_head, -3, out=out[1])


class EmptySlots:
    """A decode step's mask input for the logits GEMM, for one `key_positions` view [rows, n_keys]: min(position, 0)
    per row and KV head, [rows x Hkv, 1, n_keys] of `dtype` (-1 at an empty slot, 0 at an entry), refilled in place
    by `fill` (one kernel; the comparison to a float zero casts on the way). Made once for a view that recurs (a
    paged layer keeps one with the slots it attends, tracer.cache): the buffer and its views then cost no view op
    per call (~6 us per layer and step on a CPU). One made under inference mode holds an inference tensor, which
    may not be written outside it: its maker keys it on the mode."""

    def __init__(self, key_positions: torch.Tensor, n_kv_heads: int, dtype: torch.dtype):
        rows, n_keys = key_positions.shape
        self.key_positions = key_positions
        self.out = torch.empty((rows, n_kv_heads, 1, n_keys), dtype=dtype, device=key_positions.device)
        self.expanded = key_positions[:, None, None, :].expand_as(self.out)
        self.flat = self.out.view(rows * n_kv_heads, 1, n_keys)
        self.zero = _zero(dtype, key_positions.device)

    def fill(self) -> torch.Tensor:
        torch.minimum(self.expanded, self.zero, out=self.out)
        return self.flat


def _prefill_logits(batch: int, n_queries: int, n_keys: int, query: torch.Tensor, reduce_heads: bool
                    ) -> torch.Tensor | None:
    """Where a CPU prefill's logits are computed, masked and softmaxed (`workspace`), for at most a chunk's
    (`CHUNK_LOGITS`: a long one-row prompt's are its own) and when the weights are reduced here (per head they
    are returned, and must not alias it); None: a fresh tensor."""
    if batch * n_queries * n_keys > CHUNK_LOGITS or not reduce_heads or query.requires_grad:  # (out= has no grad)
        return None
    return workspace("prefill logits", (batch, n_queries, n_keys), query.dtype, query.device)


# (name, dtype, inference mode) -> a kept CPU buffer (`workspace`; one made under inference mode is an inference
# tensor, which may not be written outside it). Each name's is written and read by one call after another.
_WORKSPACES: dict = {}


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A kept CPU buffer viewed as `shape`, for a temporary of a few MiB that every layer would make anew (a prefill
    chunk's logits, a batch's recalled blocks) and that its caller has used up before asking again; None on a GPU,
    whose caching allocator reuses its blocks. On glibc a fresh tensor of that size is a fresh mapping, faulted in
    page by page: a B = 8 prefill of 128-token prompts on the micro model attended in ~2x its time alone
    (tests/bench/collect_throughput.py), and a B = 32 decode step's recall gathered at ~half speed."""
    if device.type != "cpu":
        return None
    key = (name, dtype, torch.is_inference_mode_enabled())
    kept = _WORKSPACES.get(key)  # (buffer, the shape last asked, its view: most calls ask the last one's again)
    if kept is not None and kept[1] == shape:
        return kept[2]
    size = math.prod(shape)
    buffer = kept[0] if kept is not None and kept[0].numel() >= size else torch.empty(size, dtype=dtype)
    _WORKSPACES[key] = (buffer, shape, buffer[:size].view(shape))
    return _WORKSPACES[key][2]


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device)


@functools.cache
def _unread(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((1, 1, 1), dtype=dtype, device=device)


@functools.cache
def _negative_infinity(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """-inf as a 0-dim tensor, made once per dtype and device (a Python float would be made into one at every
    call: a kernel per layer and step). Filled on the device: `torch.tensor(-inf, device=cuda)` would be a blocking
    copy from pageable memory, at whichever step first asks."""
    return torch.full((), float("-inf"), dtype=dtype, device=device)


def tiered_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    pending, _pending[0] = _pending[0], None
    if pending is None or pending[0].layer_idx != module.layer_idx:
        output, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return output, None
    layer, rows = pending
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # Every row's recall, attention over its own pages, scoring and placement, as one set of kernels.
    return layer.attend(rows, query, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, tiered_attention_forward)
