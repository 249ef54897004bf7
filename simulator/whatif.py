"""What-if re-simulation: replay a run's recorded block masses (access.parquet) through another placement.

The result has the same per-(step, layer) arrays as a trace row set, plus the accuracy-risk proxy: the
attention mass that fell on evicted blocks, and on DDR blocks that were not recalled. It is a projection
(result_kind "projected"): the tokens generated are the traced ones, whatever the new placement would have
changed in them. Masses of blocks the traced policy did not attend are whatever the trace recorded for them
(0 unless a shadow pass measured them), so projections towards *less* eviction than traced are optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from simulator.placement import (
    SCORERS,
    OracleScorer,
    Placement,
    PlacementError,
    future_mass,
    get_scorer,
    merge_blocks,
)
from traces.policy import PolicyError, PolicySpec

# --what-if keys -> PolicySpec fields (values are validated by PolicySpec itself, once)
WHAT_IF_KEYS = {
    "policy": "policy",
    "budget": "hbm_budget",
    "hbm_budget": "hbm_budget",
    "evict": "evict_ratio",
    "evict_ratio": "evict_ratio",
    "block": "block_size",
    "block_size": "block_size",
    "recall_k": "recall_k",
    "recall_budget": "recall_budget",
    "scorer": "scorer",
    "recall_rule": "recall_rule",
    "sink": "sink_tokens",
    "window": "window_tokens",
    "promote": "promote",
}


class WhatIfError(PlacementError):
    pass


def parse_what_if(text: str | dict | None) -> dict:
    """"budget=0.3,block=32" (or a dict) -> {PolicySpec field: value}; each key at most once, values checked
    by `PolicySpec` (on a default spec, so a bad value fails here, before any work)."""
    if text is None:
        return {}
    items = text.items() if isinstance(text, dict) else _pairs(str(text))
    out = {}
    for key, value in items:
        field = WHAT_IF_KEYS.get(str(key).strip())
        if field is None:
            raise WhatIfError(f"--what-if: unknown key {key!r}; use {', '.join(sorted(set(WHAT_IF_KEYS)))}")
        if field in out:
            raise WhatIfError(f"--what-if: {key!r} is given twice (or with its synonym); give each setting once")
        if field == "promote":
            try:
                value = _flag(value)
            except ValueError:
                raise WhatIfError(f"--what-if: promote={value!r} must be on or off") from None
        elif isinstance(value, str):
            value = value.strip()
        out[field] = value
    try:
        PolicySpec(policy="hierarchy", **{k: v for k, v in out.items() if k != "policy"})
        if "policy" in out:
            PolicySpec(policy=out["policy"])
    except PolicyError as error:
        raise WhatIfError(f"--what-if: {error}") from None
    return out


def _flag(value) -> bool:
    text = str(value).strip().lower()
    if text not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
        raise ValueError(value)
    return text in ("1", "true", "on", "yes")


def _pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise WhatIfError(f"--what-if: {part!r} is not KEY=VALUE; write e.g. budget=0.3,block=32")
        key, value = part.split("=", 1)
        pairs.append((key.strip(), value.strip()))
    return pairs


def traced_config(policy: dict) -> PolicySpec:
    """The run's own placement (run.json `policy`); a scorer that needs keys is replayed as h2o (what-if
    refuses that unless told which mass scorer to use)."""
    spec = PolicySpec.from_manifest(policy)
    return spec if spec.scorer in SCORERS else replace(spec, scorer="h2o")


def what_if_config(policy: dict, overrides: dict) -> PolicySpec:
    base_scorer = policy.get("scorer")
    if "scorer" not in overrides and base_scorer not in SCORERS and policy.get("name") != "full":
        raise WhatIfError(
            f"--what-if: the traced scorer {base_scorer!r} needs keys, not masses; add scorer=NAME "
            f"({', '.join(SCORERS)})"
        )
    try:
        config = replace(traced_config(policy), **overrides)
    except PolicyError as error:
        raise WhatIfError(f"--what-if: {error}") from None
    traced_block = int(policy["block_size"])
    if config.block_size % traced_block:
        raise WhatIfError(
            f"--what-if: block={config.block_size} must be a multiple of the traced block size {traced_block}"
        )
    return config


def replays_own_recalls(policy: dict, config: PolicySpec) -> bool:
    """True when `config` is the run's own placement with a key-bound recall rule: the recalls the tracer made
    are then replayed as recorded (masses cannot reproduce a bound computed from keys)."""
    traced = PolicySpec.from_manifest(policy)
    return config.uses_ddr and config.recall_rule not in ("query", "score") and config.effective() == traced.effective()


@dataclass
class Replay:
    """[n_steps, n_layers] arrays of a replayed sample, in trace-row units."""

    hbm_tokens: np.ndarray
    recalled_tokens: np.ndarray
    ddr_tokens: np.ndarray
    bytes_h2d: np.ndarray
    bytes_d2h: np.ndarray
    moved_blocks: np.ndarray  # blocks whose tier the placement changed (the placement overhead is charged there)
    recalled_blocks: np.ndarray  # blocks recalled (the per-block recall overhead)
    mass_evicted: np.ndarray
    mass_not_recalled: np.ndarray


def replay(access: pd.DataFrame, logical_len: np.ndarray, n_layers: int, traced_block_size: int,
           config: PolicySpec, kv_bytes_per_token_layer: float, recorded_recalls=None) -> Replay:
    """Re-place one sample. `access`: its rows (step, layer, block_mass); `logical_len`: [n_steps];
    `recorded_recalls`: [step][layer] -> block ids, replayed as recorded (see `replays_own_recalls`)."""
    n_steps = len(logical_len)
    access = access.sort_values(["step", "layer"], kind="stable")
    if len(access) != n_steps * n_layers:
        raise WhatIfError(f"access table has {len(access)} rows for {n_steps} steps x {n_layers} layers; "
                          "the run is incomplete (run `thoughtkv traces validate`)")
    factor = config.block_size // traced_block_size
    rows = access["block_mass"].tolist()
    masses = [
        merge_blocks(np.stack(rows[s * n_layers : (s + 1) * n_layers]).astype(np.float64), factor)
        for s in range(n_steps)
    ]
    scorer = get_scorer(config.scorer)
    if isinstance(scorer, OracleScorer):
        scorer.future = future_mass(masses)
    placement = Placement(config, n_layers, scorer, recorded_recalls)
    block_bytes = round(config.block_size * kv_bytes_per_token_layer)
    out = {name: np.zeros((n_steps, n_layers)) for name in Replay.__dataclass_fields__}
    for s in range(n_steps):
        n_blocks = -(-int(logical_len[s]) // config.block_size)
        mass = masses[s]
        if mass.shape[1] < n_blocks:  # quantised-away tail: pad with zeros
            mass = np.pad(mass, ((0, 0), (0, n_blocks - mass.shape[1])))
        placed = placement.step(s, int(logical_len[s]), mass[:, :n_blocks])
        out["hbm_tokens"][s] = placed.hbm_tokens
        out["recalled_tokens"][s] = placed.recalled_tokens
        out["ddr_tokens"][s] = placed.ddr_tokens
        out["bytes_h2d"][s] = placed.n_recalled * block_bytes
        out["bytes_d2h"][s] = placed.n_offloaded * block_bytes
        out["moved_blocks"][s] = placed.n_moved
        out["recalled_blocks"][s] = placed.n_recalled
        out["mass_evicted"][s] = placed.mass_evicted
        out["mass_not_recalled"][s] = placed.mass_not_recalled
    return Replay(**out)
