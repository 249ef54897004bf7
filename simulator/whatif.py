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
    RECALL_RULES,
    SCORERS,
    OracleScorer,
    Placement,
    PlacementConfig,
    PlacementError,
    future_mass,
    get_scorer,
    merge_blocks,
)

# --what-if keys -> PlacementConfig fields
WHAT_IF_KEYS = {
    "policy": "policy",
    "budget": "hbm_budget",
    "hbm_budget": "hbm_budget",
    "evict": "evict_ratio",
    "evict_ratio": "evict_ratio",
    "block": "block_size",
    "block_size": "block_size",
    "recall_k": "recall_k",
    "scorer": "scorer",
    "recall_rule": "recall_rule",
    "sink": "sink_tokens",
    "window": "window_tokens",
    "promote": "promote",
}
FLOAT_FIELDS = ("hbm_budget", "evict_ratio")
INT_FIELDS = ("block_size", "recall_k", "sink_tokens", "window_tokens")


class WhatIfError(PlacementError):
    pass


def parse_what_if(text: str | dict | None) -> dict:
    """"budget=0.3,block=32" (or a dict) -> {PlacementConfig field: value}."""
    if text is None:
        return {}
    items = text.items() if isinstance(text, dict) else _pairs(str(text))
    out = {}
    for key, value in items:
        field = WHAT_IF_KEYS.get(str(key).strip())
        if field is None:
            raise WhatIfError(f"--what-if: unknown key {key!r}; use {', '.join(sorted(set(WHAT_IF_KEYS)))}")
        try:
            if field in FLOAT_FIELDS:
                out[field] = float(value)
            elif field in INT_FIELDS:
                out[field] = int(value)
            elif field == "promote":
                out[field] = _flag(value)
            else:
                out[field] = str(value).strip()
        except ValueError:
            raise WhatIfError(f"--what-if: {key}={value!r} is not a number") from None
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


def traced_config(policy: dict) -> PlacementConfig:
    """The run's own placement (run.json `policy`), as far as it can be replayed from masses."""
    name = policy.get("name", "full")
    name = name if name in ("full", "evict", "hierarchy") else "hierarchy"
    rule = policy.get("recall_rule")
    return PlacementConfig(
        policy=name,
        hbm_budget=float(policy.get("hbm_budget") or 1.0),
        evict_ratio=float(policy.get("evict_ratio") or 0.0),
        block_size=int(policy["block_size"]),
        recall_k=int(policy.get("recall_k") or 0),
        scorer=policy.get("scorer") if policy.get("scorer") in SCORERS else "h2o",
        recall_rule=rule if rule in RECALL_RULES else "query",
        sink_tokens=int(policy.get("sink_tokens") or 0),
        window_tokens=int(policy.get("window_tokens") or 0),
        promote=bool((policy.get("params") or {}).get("promote", True)),
    )


def what_if_config(policy: dict, overrides: dict) -> PlacementConfig:
    base_scorer = policy.get("scorer")
    if "scorer" not in overrides and base_scorer not in SCORERS and policy.get("name") != "full":
        raise WhatIfError(
            f"--what-if: the traced scorer {base_scorer!r} needs keys, not masses; add scorer=NAME "
            f"({', '.join(SCORERS)})"
        )
    config = replace(traced_config(policy), **overrides)
    traced_block = int(policy["block_size"])
    if config.block_size % traced_block:
        raise WhatIfError(
            f"--what-if: block={config.block_size} must be a multiple of the traced block size {traced_block}"
        )
    return config


@dataclass
class Replay:
    """[n_steps, n_layers] arrays of a replayed sample, in trace-row units."""

    hbm_tokens: np.ndarray
    recalled_tokens: np.ndarray
    ddr_tokens: np.ndarray
    bytes_h2d: np.ndarray
    bytes_d2h: np.ndarray
    mass_evicted: np.ndarray
    mass_not_recalled: np.ndarray


def replay(access: pd.DataFrame, logical_len: np.ndarray, n_layers: int, traced_block_size: int,
           config: PlacementConfig, kv_bytes_per_token_layer: float) -> Replay:
    """Re-place one sample. `access`: its rows (step, layer, block_mass); `logical_len`: [n_steps]."""
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
    placement = Placement(config, n_layers, scorer)
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
        out["mass_evicted"][s] = placed.mass_evicted
        out["mass_not_recalled"][s] = placed.mass_not_recalled
    return Replay(**out)
