"""What every scorer shares: the `Observation` one attention call hands it, the `Scorer` base class and the
score-table helpers. Shapes are documented once, here.

A scorer turns what one attention call observed (the new queries' softmax weights over the entries they
attended, reduced over heads) into an importance per *logical* position. Higher = more important. The tiered
cache sums token scores into block scores to decide what to evict or offload. Entries that were not attended
this step (DDR blocks not recalled, evicted ones) keep their previous score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thoughtkv_base import UserError


class BadScorerOption(UserError):
    pass


@dataclass
class Observation:
    """What one layer saw in one attention call, for a batch of rows (sequences; a prefill is scored one row at a
    time, on that row's own queries).

    A paged cache attends whole pages: a slot that holds no entry (`valid` False) has weight exactly 0 and its
    position is the row's scratch position (one past its last token; the cache resets that score after the
    call), so a score written there is harmless; a scorer that pools over the attended entries skips them.
    When the cache scores a decode step's layers in one call (`layer_idx` None, only for a scorer that
    `adds_weights_only`), an empty slot's position is 0 and `valid` is None: its weight 0 adds nothing there.
    """

    layer_idx: int | None  # None: a decode step's layers scored together, rows = layers x rows (see `keys`)
    step: int  # 0 = prefill (of the first row; rows of a decode batch are all past it)
    logical_len: int  # width of the score table: at least every row's logical length + 1 (the scratch position)
    positions: torch.Tensor  # [rows, n] long: logical position of each attended slot (HBM pages, then recalled)
    weights_mean: torch.Tensor  # [rows, q, n] float32: softmax of each new query, mean over query heads
    weights_max: torch.Tensor  # [rows, q, n] float32: same, max over query heads
    # [rows, n_kv_heads, n, head_dim]: the attended keys (post-RoPE); None when the cache scores a decode step's
    # layers in one call (tracer.cache.step.after_attention_of_layers), which it does only for a scorer that
    # `adds_weights_only` (reads the weights and positions alone)
    keys: torch.Tensor | None
    values: torch.Tensor | None = None  # [rows, n_kv_heads, n, head_dim]: the attended values (vatp)
    valid: torch.Tensor | None = None  # [rows, n] bool: slots that hold an entry (None: all, or layers together)


def _grown(previous: torch.Tensor, length: int) -> torch.Tensor:
    """Previous scores [rows, m] extended with zeros to `length` columns (a copy: callers write into it)."""
    out = torch.zeros(previous.shape[0], length, dtype=torch.float32, device=previous.device)
    n = min(length, previous.shape[-1])
    out[:, :n] = previous[:, :n]
    return out


def _extended(previous: torch.Tensor, length: int) -> torch.Tensor:
    """`previous` itself when it already covers `length` positions (scores are updated in place on the hot
    path), else a copy grown with zeros to twice that (amortised). Entries past the logical length stay 0."""
    if previous.shape[-1] >= length:
        return previous
    return _grown(previous, max(length, 2 * previous.shape[-1]))


class Scorer:
    name: str = ""
    # Whether one call may score many rows (sequences) at once: the scorer keeps no per-sequence state, so
    # rows whose scorers have the same settings share one call. Per-sample state (oracle, gradient, AlsoScore)
    # is scored one row at a time.
    batchable: bool = True
    # Whether the scores only ever add the weights given (reading nothing else but the positions): an empty slot
    # (weight exactly 0) then leaves its scratch position at 0, and the cache skips resetting it after each call;
    # and a decode step's layers may be scored in one call (rows: layers x rows; no keys, no layer index).
    adds_weights_only: bool = False
    # Whether scoring runs autograd (a backward pass): the decode loop then runs under no_grad, not
    # inference_mode, whose tensors autograd cannot save (tracer.decode.decode_grad_mode).
    needs_autograd: bool = False

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        """Return the scores [rows, >= obs.logical_len] of every position (float32); entries beyond are 0."""
        raise NotImplementedError
