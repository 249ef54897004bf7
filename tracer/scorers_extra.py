"""Two more importance scorers, `vatp` and `gradient`, and `AlsoScore`: scorers computed alongside the policy's
own (they do not drive placement) whose final per-token importance goes into `tokens.importance_by_scorer`,
so that `thoughtkv analyze correlation` can rank-correlate any two scorers on the same trace.

vatp (Guo et al. 2024, "Attention Score is not All You Need ... Value Also Matters"): H2O's cumulative
attention times the L1 norm of the token's value vector, score_i = sum_q a_{q,i} * ||v_i||_1. Like every
scorer here it sees the attention already reduced over query heads (mean), and ||v_i||_1 is averaged over KV
heads: score_i = (sum over queries of mean_h a_{q,i}^h) * mean_kv_h ||v_i^h||_1.

gradient: importance of a cached KV entry = ||dL/dk|| + ||dL/dv|| (L2 over heads and head_dim, per layer),
where L is the next-token loss (cross-entropy on the token greedy decoding actually produced, i.e.
teacher-forced) of the last `window` positions, with respect to the K/V cached before them; the cache
entries are leaves, so the gradient flows only through the attention of those queries (not through the
hidden states that produced the cached entries). Scores accumulate over the scored steps (like H2O's
attention). Cost: one extra forward + backward of `window` tokens every `interval` decode steps (it runs in
the decode loop, after the step's token is known); entries newer than the window and those not resident in
HBM (DDR, evicted) keep their score, so placement at step t uses the gradients of step t-1 and earlier. Keep
`interval` at most the policy's recent window, or new entries leave the protected window unscored (0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from thoughtkv_base import UserError
from tracer.scorers import SCORERS, Observation, Scorer, _grown


class BadScorerOption(UserError):
    pass


@dataclass
class VATPScorer(Scorer):
    """Value-aware token pruning: cumulative attention (mean over heads) x ||v||_1 (mean over KV heads)."""

    name: str = "vatp"

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        values = getattr(obs, "values", None)
        if values is None:
            raise BadScorerOption("the vatp scorer needs the attended values in the observation (tracer.cache passes them)")
        scores = _grown(previous, obs.logical_len)
        value_norms = values.float().abs().sum(-1).mean(0)  # [n]: ||v||_1 per entry, mean over KV heads
        return scores.index_add_(0, obs.positions, obs.weights_mean.sum(0) * value_norms)


def cached_entries(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys [1, H, n, d], values, logical positions [n]) stored in a cache layer (tiered or DynamicLayer)."""
    keys, values = layer.keys, layer.values
    positions = getattr(layer, "slot_pos", None)
    if positions is None:
        positions = torch.arange(keys.shape[-2], device=keys.device)
    return keys, values, positions[: keys.shape[-2]]


def gradient_importance(
    model, keys: list[torch.Tensor], values: list[torch.Tensor], input_ids: torch.Tensor,
    position_ids: torch.Tensor, target_ids: torch.Tensor,
) -> list[torch.Tensor]:
    """Per layer, ||dL/dk_j|| + ||dL/dv_j|| for every cached entry j, L = summed next-token cross-entropy of
    the `w` query tokens `input_ids` [1, w] (at `position_ids` [1, w], targets `target_ids` [w]) attending to
    the cached `keys`/`values` ([1, H, n_l, d] per layer, treated as leaves) and causally to each other. With
    one query, layers may hold different entries (a tiered cache prunes each layer on its own)."""
    leaves = [(k.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)) for k, v in zip(keys, values, strict=True)]
    n_cached, n_query = keys[0].shape[-2], input_ids.shape[-1]
    mask = None
    if n_query > 1:  # explicit mask: the cached prefix plus causal among the queries (sdpa's own is top-left)
        allowed = torch.ones(n_query, n_cached + n_query, dtype=torch.bool, device=input_ids.device)
        allowed[:, n_cached:] = torch.ones(n_query, n_query, dtype=torch.bool, device=input_ids.device).tril()
        mask = allowed[None, None]
    with torch.enable_grad():
        cache = DynamicCache(ddp_cache_data=leaves)
        logits = model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache, use_cache=True,
            logits_to_keep=n_query,
        ).logits[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), target_ids, reduction="sum")
        grads = torch.autograd.grad(loss, [t for pair in leaves for t in pair], allow_unused=True)
    importance = []
    for index in range(len(leaves)):
        grad_k, grad_v = grads[2 * index], grads[2 * index + 1]
        norms = torch.zeros(leaves[index][0].shape[-2], dtype=torch.float32, device=input_ids.device)
        for grad in (grad_k, grad_v):
            if grad is not None:
                norms += grad[0].float().square().sum((0, 2)).sqrt()
        importance.append(norms)
    return importance


@dataclass
class GradientScorer(Scorer):
    """Gradient importance (see module doc): a backward pass every `interval` steps over the last `window`
    next-token losses; `score()` hands the layer its accumulated table."""

    name: str = "gradient"
    window: int = 1
    interval: int = 1
    tables: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.window < 1 or self.interval < 1:
            raise BadScorerOption(f"--grad-window and --grad-interval must be >= 1 (got {self.window}, {self.interval})")

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        table = self.tables.get(obs.layer_idx, torch.zeros(0, device=previous.device))
        return _grown(table, obs.logical_len)

    def after_step(self, model, cache, token_ids: list[int], step: int) -> None:
        """Called by the decode loop after step `step` produced `token_ids[-1]` (0 = prefill)."""
        if step % self.interval:
            return
        current = len(token_ids) - 2  # position of the token fed at this step
        first_query = max(0, current - self.window + 1)
        device = model.device
        entries = [cached_entries(layer) for layer in cache.layers]
        older = [positions < first_query for _, _, positions in entries]
        keys = [k[:, :, keep] for (k, _, _), keep in zip(entries, older, strict=True)]
        values = [v[:, :, keep] for (_, v, _), keep in zip(entries, older, strict=True)]
        if self.window > 1 and len({k.shape[-2] for k in keys}) != 1:  # one 4D mask serves every layer
            raise BadScorerOption("--grad-window > 1 needs the same number of resident entries in every layer "
                                  "(use the full policy, or --grad-window 1)")
        importance = gradient_importance(
            model, keys, values,
            input_ids=torch.tensor([token_ids[first_query : current + 1]], device=device),
            position_ids=torch.arange(first_query, current + 1, device=device)[None],
            target_ids=torch.tensor(token_ids[first_query + 1 : current + 2], device=device),
        )
        for layer_idx, ((_, _, positions), keep, norms) in enumerate(zip(entries, older, importance, strict=True)):
            previous = self.tables.get(layer_idx, torch.zeros(0, device=norms.device))
            table = _grown(previous, current + 1)
            self.tables[layer_idx] = table.index_add_(0, positions[keep], norms)


@dataclass
class AlsoScore(Scorer):
    """The policy's scorer (None: no placement scoring, e.g. the full policy) plus `extras` computed alongside.

    Each extra keeps its own per-layer scores; `importance_by_scorer(n)` returns their final scores per position,
    mean over layers, for the trace's `tokens.importance_by_scorer` column.
    """

    primary: Scorer | None = None
    extras: dict[str, Scorer] = field(default_factory=dict)
    tables: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict, repr=False)
    score_under_full: bool = True  # the cache scores even under the full policy (for the extras)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.primary.name if self.primary is not None else "none"

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        for name, scorer in self.extras.items():
            layers = self.tables.setdefault(name, {})
            layers[obs.layer_idx] = scorer.score(obs, layers.get(obs.layer_idx, torch.zeros(0, device=previous.device)))
        return self.primary.score(obs, previous) if self.primary is not None else previous

    def after_step(self, model, cache, token_ids: list[int], step: int) -> None:
        for scorer in [self.primary, *self.extras.values()]:
            if hasattr(scorer, "after_step"):
                scorer.after_step(model, cache, token_ids, step)

    def importance_by_scorer(self, n_positions: int, n_layers: int) -> list[dict[str, float]]:
        """Per position {scorer: final score, mean over layers}; positions a layer never scored count 0."""
        columns = {}
        for name, scorer in self.extras.items():
            # The gradient scorer's own tables include the last step's backward pass (no forward copied it).
            layers = scorer.tables if isinstance(scorer, GradientScorer) else self.tables.get(name, {})
            matrix = np.zeros((n_layers, n_positions), dtype=np.float32)
            for layer_idx, scores in layers.items():
                n = min(n_positions, scores.shape[0])
                matrix[layer_idx, :n] = scores[:n].float().cpu().numpy()
            columns[name] = matrix.mean(0)
        return [{name: float(values[i]) for name, values in columns.items()} for i in range(n_positions)]


EXTRA_SCORERS: dict[str, type[Scorer]] = {cls.name: cls for cls in [VATPScorer, GradientScorer]}
SCORERS.update(EXTRA_SCORERS)


def build_scorer(name: str, *, seed: int = 0, grad_window: int = 1, grad_interval: int = 1) -> Scorer:
    """A registered scorer with the options of `thoughtkv trace` that apply to it."""
    if name not in SCORERS:
        raise BadScorerOption(f"unknown scorer {name!r}; use one of {', '.join(SCORERS)}")
    if name == "random":
        return SCORERS[name](seed=seed)
    if name == "gradient":
        return GradientScorer(window=grad_window, interval=grad_interval)
    return SCORERS[name]()


def parse_also_score(text: str | None) -> tuple[str, ...]:
    """`--also-score A,B` -> ("A", "B"); the oracle needs its own full pass and cannot ride along."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    for name in names:
        if name not in SCORERS:
            raise BadScorerOption(f"--also-score: unknown scorer {name!r}; use one of {', '.join(SCORERS)}")
        if name == "oracle":
            raise BadScorerOption("--also-score cannot include oracle (it needs its own full pass); the full "
                                  "policy's tokens.importance already is the oracle's attention")
    if len(set(names)) != len(names):
        raise BadScorerOption(f"--also-score lists a scorer twice: {text!r}")
    return names


def with_also_score(primary: Scorer | None, names: tuple[str, ...], **options) -> Scorer | None:
    """Wrap the policy's scorer in an AlsoScore when extras are requested (else return it unchanged)."""
    if not names:
        return primary
    return AlsoScore(primary=primary, extras={name: build_scorer(name, **options) for name in names})
