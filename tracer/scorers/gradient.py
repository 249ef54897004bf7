"""Gradient importance.

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

import torch
from transformers import DynamicCache

from tracer.compat import cache_kwargs
from tracer.scorers.base import BadScorerOption, Observation, Scorer, _grown


def cached_entries(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys [1, H, n, d], values, logical positions [n]) stored in a cache layer (tiered or DynamicLayer)."""
    resident = getattr(layer, "resident_entries", None)
    if resident is not None:  # a tiered layer's pages: only the slots that hold an entry
        return resident()
    keys, values = layer.keys, layer.values
    return keys, values, torch.arange(keys.shape[-2], device=keys.device)


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
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True,
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
    batchable = False  # tables per sample
    needs_autograd = True
    window: int = 1
    interval: int = 1
    tables: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.window < 1 or self.interval < 1:
            raise BadScorerOption(f"--grad-window and --grad-interval must be >= 1 (got {self.window}, {self.interval})")

    def score(self, obs: Observation, previous: torch.Tensor) -> torch.Tensor:
        table = self.tables.get(obs.layer_idx, torch.zeros(0, device=previous.device))
        return _grown(table[None], obs.logical_len)

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
            table = _grown(previous[None], current + 1)[0]
            self.tables[layer_idx] = table.index_add_(0, positions[keep], norms)
