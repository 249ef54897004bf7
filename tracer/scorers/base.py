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
    """What one layer saw in one attention call (batch 1)."""

    layer_idx: int
    step: int  # 0 = prefill
    logical_len: int  # KV entries that exist logically, incl. the new ones (+1 scratch position, see `valid`)
    positions: torch.Tensor  # [n] long: logical position of each attended entry (HBM then recalled)
    weights_mean: torch.Tensor  # [q, n] float32: softmax of each new query, mean over query heads
    weights_max: torch.Tensor  # [q, n] float32: same, max over query heads
    keys: torch.Tensor  # [n_kv_heads, n, head_dim]: the attended keys (post-RoPE)
    values: torch.Tensor | None = None  # [n_kv_heads, n, head_dim]: the attended values (vatp)
    # [n] bool: slots that hold an entry. A paged cache attends whole pages: an empty slot has weight 0 and its
    # position is the scratch position `logical_len - 1` (one past the last token; the cache resets its score),
    # so scores written there are harmless; a scorer that pools over the attended entries must skip them.
    valid: torch.Tensor | None = None


def _grown(previous: torch.Tensor, length: int) -> torch.Tensor:
    """Previous scores extended with zeros to the current logical length (a copy: callers write into it)."""
    out = torch.zeros(length, dtype=torch.float32, device=previous.device)
    n = min(length, previous.shape[0])
    out[:n] = previous[:n]
    return out


def _extended(previous: torch.Tensor, length: int) -> torch.Tensor:
    """`previous` itself when it already covers `length` positions (scores are updated in place on the hot
    path), else a copy grown with zeros to twice that (amortised). Entries past the logical length stay 0."""
    if previous.shape[0] >= length:
        return previous
    return _grown(previous, max(length, 2 * previous.shape[0]))


class Scorer:
    name: str = ""

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        """Return the scores of (at least) all `obs.logical_len` positions (float32); entries beyond are 0."""
        raise NotImplementedError
