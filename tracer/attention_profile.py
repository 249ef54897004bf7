"""The attention profile of a model's own full-cache decode: how concentrated each layer's attention is, how
much the sink takes, how far back the mass sits, and how much of it each scorer's kept set would have caught.

The project's premise is that in a reasoning chain a few tokens get most of the attention, so the rest can
leave HBM. `profile_samples` decodes samples greedily with the full cache (nothing is placed: the weights are
the model's own) and, at every decode step and layer, reads the new query's softmax over the context (mean over
query heads, as the trace records masses) and accumulates per (sample, layer):

- `top{1,5,10,20}`: the share of the mass on the top 1 / 5 / 10 / 20% of positions (at least one);
- `sink`: the share on the first `SINK_TOKENS` positions;
- `recent{16,64,256}`: the share on the last 16 / 64 / 256 positions (the new token included) and
  `mean_distance`: the mass-weighted mean distance back, in tokens;
- `captured_{scorer}_{b}`: the share of this step's mass on the positions that scorer would keep at budget b
  (10 / 20 / 30 / 50% of the context): the new token, plus the top ceil(b x L) - 1 earlier positions by the
  scorer's scores from the steps before (what a policy deciding after the last step would hold), and
  `captured_oracle_{b}`: the same by this step's own weights (the ceiling).

Means over the decode steps of a sample; a step weighs 1 whatever its length. Scorers are computed alongside
(`tracer.scorers.AlsoScore`), never placing anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tracer.scorers import AlsoScore, build_scorer

TOP_SHARES = (0.01, 0.05, 0.10, 0.20)
RECENT_TOKENS = (16, 64, 256)
SINK_TOKENS = 4
BUDGETS = (0.1, 0.2, 0.3, 0.5)
SCORERS = ("h2o", "tova", "snapkv", "keynorm", "recency")


def metric_names(scorers=SCORERS) -> list[str]:
    return ([f"top{round(f * 100)}" for f in TOP_SHARES] + ["sink"] + [f"recent{n}" for n in RECENT_TOKENS]
            + ["mean_distance"]
            + [f"captured_{s}_{round(b * 100)}" for s in (*scorers, "oracle") for b in BUDGETS])


@dataclass
class ProfileScorer(AlsoScore):
    """An AlsoScore whose extras are the profiled scorers; before they see a decode step's weights, the step is
    profiled against their previous tables. `sums[layer]` accumulates each metric; `steps[layer]` counts."""

    sums: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    steps: dict[int, int] = field(default_factory=dict, repr=False)

    def score(self, obs, previous):
        if obs.weights_mean.shape[1] == 1 and obs.layer_idx is not None:  # a decode step (one query)
            values = self._profile(obs)
            if values is not None:
                self.sums[obs.layer_idx] = self.sums.get(obs.layer_idx, 0) + values
                self.steps[obs.layer_idx] = self.steps.get(obs.layer_idx, 0) + 1
        return super().score(obs, previous)

    def _profile(self, obs) -> torch.Tensor | None:
        """This step's metrics as one tensor (in `metric_names` order), left on the device: accumulated there and
        read once per sample."""
        positions = obs.positions[0]
        weights = obs.weights_mean[0, 0]
        if obs.valid is not None:
            positions, weights = positions[obs.valid[0]], weights[obs.valid[0]]
        length = positions.shape[0]  # the full cache attends every position up to the new token's, once each
        if length < 2:
            return None
        device = weights.device
        dense = torch.zeros(length, dtype=torch.float32, device=device).scatter_(0, positions, weights.float())
        dense = dense / dense.sum()
        top = torch.sort(dense, descending=True).values.cumsum(0)
        top_index = torch.tensor([max(1, math.ceil(f * length)) - 1 for f in TOP_SHARES], device=device)
        recent = torch.stack([dense[-n:].sum() for n in RECENT_TOKENS])
        distance = torch.arange(length - 1, -1, -1, dtype=torch.float32, device=device)
        earlier = dense[:-1]
        rankings = []
        for name in self.extras:
            table = self.tables.get(name, {}).get(obs.layer_idx)
            ranking = torch.zeros(length - 1, device=device)
            if table is not None:
                n = min(length - 1, table.shape[-1])
                ranking[:n] = table.reshape(-1)[:n].float()
            rankings.append(ranking)
        rankings.append(earlier)  # the oracle: this step's own weights
        # Ties keep the later position (a scorer with nothing scored yet ranks by recency).
        tie_break = torch.arange(length - 1, device=device, dtype=torch.float64) * 1e-12
        order = torch.argsort(torch.stack(rankings).double() + tie_break, dim=1, descending=True, stable=True)
        kept = torch.cat([torch.zeros(len(rankings), 1, device=device), earlier[order].cumsum(1)], 1)
        keep = torch.tensor([max(0, math.ceil(b * length) - 1) for b in BUDGETS], device=device)
        captured = (kept[:, keep.clamp_max(length - 1)] + dense[-1]).flatten()
        return torch.cat([top[top_index], dense[:SINK_TOKENS].sum()[None], recent, (dense * distance).sum()[None],
                          captured]).double()


def profile_scorer(scorers=SCORERS) -> ProfileScorer:
    return ProfileScorer(primary=None, extras={name: build_scorer(name) for name in scorers})


def profile_samples(loaded, task, samples, max_new_tokens: int, batch_size: int = 16, progress: bool = False):
    """Greedy full-cache decode of `samples` with the profile recorded: a DataFrame with one row per (sample,
    layer): sample_id, layer, decode_steps, generated_tokens and the mean of every `metric_names()` metric."""
    import pandas as pd
    from tqdm.auto import tqdm

    from tracer.cache import TieredCache
    from tracer.decode import DecodeJob, decode_batch, encode_prompt, eos_token_ids, use_tiered_attention
    from tracer.run import TraceConfig, make_settings

    model = loaded.model
    use_tiered_attention(model)
    config = TraceConfig(model=loaded.spec, task=task.name, out="-", policy="full", max_new_tokens=max_new_tokens)

    def job(sample):
        settings = make_settings(config, scorer=profile_scorer())
        return DecodeJob(sample, encode_prompt(loaded.tokenizer, sample.prompt, task.use_chat_template), settings)

    names, rows = metric_names(), []
    cache = TieredCache(model.config.num_hidden_layers, make_settings(config, scorer=profile_scorer()))
    jobs = (job(s) for s in samples)
    with tqdm(total=len(samples), desc="attention profile", unit="sample", disable=not progress) as bar:
        for finished, result in decode_batch(model, jobs, cache, min(batch_size, len(samples)), max_new_tokens,
                                             eos_token_ids(model, loaded.tokenizer)):
            scorer = finished.settings.scorer
            for layer in sorted(scorer.steps):
                means = scorer.sums[layer].cpu().numpy() / scorer.steps[layer]
                rows.append({"sample_id": finished.key.sample_id, "layer": layer, "decode_steps": scorer.steps[layer],
                             "generated_tokens": len(result.generated_ids), **dict(zip(names, means.tolist()))})
            bar.update(1)
    return pd.DataFrame(rows)
