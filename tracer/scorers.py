"""Importance scorers (kvpress-style registry): one small dataclass each with one `score()` method.

A scorer turns what one attention call observed (the new queries' softmax weights over the entries they
attended, reduced over heads) into an importance per *logical* position. Higher = more important. The tiered
cache sums token scores into block scores to decide what to evict or offload. Entries that were not attended
this step (DDR blocks not recalled, evicted ones) keep their previous score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from thoughtkv_base import UserError


@dataclass
class Observation:
    """What one layer saw in one attention call (batch 1)."""

    layer_idx: int
    step: int  # 0 = prefill
    logical_len: int  # KV entries that exist logically, incl. the new ones
    positions: torch.Tensor  # [n] long: logical position of each attended entry (HBM then recalled)
    weights_mean: torch.Tensor  # [q, n] float32: softmax of each new query, mean over query heads
    weights_max: torch.Tensor  # [q, n] float32: same, max over query heads
    keys: torch.Tensor  # [n_kv_heads, n, head_dim]: the attended keys (post-RoPE)
    values: torch.Tensor | None = None  # [n_kv_heads, n, head_dim]: the attended values (vatp)


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


@dataclass
class H2OScorer(Scorer):
    """H2O: cumulative attention received, summed over every query seen so far (prefill: all prompt queries)."""

    name: str = "h2o"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        return scores.index_add_(0, obs.positions, obs.weights_mean.sum(0))


@dataclass
class TOVAScorer(Scorer):
    """TOVA: the attention of the last query only (replaces the previous score of every attended entry)."""

    name: str = "tova"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores[obs.positions] = obs.weights_mean[-1]
        return scores


@dataclass
class SnapKVScorer(Scorer):
    """SnapKV: attention of the last `window` queries (mean), max-pooled over neighbouring positions.

    At prefill the window is the last `window` prompt queries (the paper's observation window); at decode the
    one new query. Pooling runs over logical positions (entries not attended count as 0).
    """

    name: str = "snapkv"
    window: int = 32
    kernel: int = 7

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        observed = obs.weights_mean[-self.window :].mean(0)
        dense = torch.zeros(obs.logical_len, dtype=torch.float32, device=observed.device)
        dense[obs.positions] = observed
        pooled = torch.nn.functional.max_pool1d(
            dense.view(1, 1, -1), self.kernel, stride=1, padding=self.kernel // 2
        ).view(-1)
        scores[obs.positions] = pooled[obs.positions]
        return scores


@dataclass
class KeyNormScorer(Scorer):
    """Key-norm (Devoto et al. 2024): a low L2 norm of the key marks an important token; score = -‖k‖ (mean
    over KV heads)."""

    name: str = "keynorm"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores[obs.positions] = -obs.keys.float().norm(dim=-1).mean(0)
        return scores


@dataclass
class RKVScorer(Scorer):
    """R-KV: importance minus redundancy, `lam * a / max(a) - (1 - lam) * r`.

    `a` = attention of the last `window` queries (mean over heads), `r` = mean cosine similarity of the entry's
    key to all attended keys (mean over KV heads). The mean pairwise cosine is computed exactly in O(n) as
    k̂_i · mean_j(k̂_j) (R-KV thresholds the similarity matrix; this is the unthresholded variant).
    """

    name: str = "rkv"
    window: int = 8
    lam: float = 0.1

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        attention = obs.weights_mean[-self.window :].mean(0)
        attention = attention / attention.max().clamp_min(1e-12)
        unit_keys = torch.nn.functional.normalize(obs.keys.float(), dim=-1)  # [h, n, d]
        redundancy = (unit_keys * unit_keys.mean(1, keepdim=True)).sum(-1).mean(0)  # [n]
        scores[obs.positions] = self.lam * attention - (1.0 - self.lam) * redundancy
        return scores


@dataclass
class RecencyScorer(Scorer):
    """Recency (StreamingLLM with sinks + window): the later the position, the more important."""

    name: str = "recency"

    def score(self, obs, previous):
        scores = _extended(previous, obs.logical_len)
        scores[obs.positions] = obs.positions.to(torch.float32)
        return scores


@dataclass
class RandomScorer(Scorer):
    """Uniform random score per position, seeded; identical across layers (a position's score is a function
    of (seed, position) only, drawn in chunks of 4096)."""

    name: str = "random"
    seed: int = 0
    _table: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False)

    def _chunked_table(self, length: int) -> torch.Tensor:
        chunk = 4096
        while self._table.shape[0] < length:
            index = self._table.shape[0] // chunk
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            self._table = torch.cat([self._table, torch.rand(chunk, generator=generator)])
        return self._table

    def score(self, obs, previous):
        table = self._chunked_table(obs.logical_len).to(previous.device)
        return table[: obs.logical_len].clone()


@dataclass
class OracleScorer(Scorer):
    """Oracle (upper bound, not deployable): the attention each position receives over the whole generation in
    a full-cache greedy pass over the same prompt (summed over its decode steps, mean over heads, per layer).

    The decode loop runs that pass first and fills `future_importance`; positions the full pass never reached
    score 0 (they are recent, so the window protects them in practice).
    """

    name: str = "oracle"
    future_importance: list[torch.Tensor] | None = None  # per layer, [positions]

    def score(self, obs, previous):
        if self.future_importance is None:
            raise UserError("the oracle scorer needs a full-cache pass first; use tracer.run (it runs one)")
        table = self.future_importance[obs.layer_idx].to(previous.device, torch.float32)
        scores = torch.zeros(obs.logical_len, dtype=torch.float32, device=previous.device)
        n = min(obs.logical_len, table.shape[0])
        scores[:n] = table[:n]
        return scores


SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in [
        H2OScorer, TOVAScorer, SnapKVScorer, KeyNormScorer, RKVScorer, RecencyScorer, RandomScorer,
        OracleScorer,
    ]
}


def get_scorer(name: str, **params) -> Scorer:
    try:
        cls = SCORERS[name]
    except KeyError:
        raise UserError(f"unknown scorer {name!r}; use one of {', '.join(SCORERS)}") from None
    return cls(**params)


import tracer.scorers_extra  # noqa: E402,F401 - registers vatp and gradient (tracer/scorers_extra.py)
