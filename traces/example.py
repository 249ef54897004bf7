"""A complete, self-consistent sample of every table, built from the access model: for tests, the size
benchmark and anyone who needs a valid run without a model.

The "policy" is trivial (everything stays in HBM, nothing moves) unless `movements=True`, which fills the
block-id lists with seeded in-range ids so that every column holds data (a format exercise, not a policy:
tier counts are not kept consistent with the lists).
"""

from __future__ import annotations

import numpy as np

from traces.access_model import AccessModel
from traces.schema import TIER_HBM


def example_sample(
    sample_id: str,
    *,
    prompt_tokens: int,
    generated_tokens: int,
    n_layers: int,
    block_size: int = 16,
    kv_bytes_per_token_per_layer: int = 2048,
    seed: int = 0,
    movements: bool = False,
    access_model: AccessModel | None = None,
) -> dict:
    """{"sample": row, "steps": columns, "tokens": columns, "access": columns with float `block_mass`}."""
    model = access_model or AccessModel(n_layers=n_layers, block_size=block_size, seed=seed)
    rng = np.random.default_rng([seed, 7])
    n_steps = max(generated_tokens, 1)
    step = np.repeat(np.arange(n_steps, dtype=np.int32), n_layers)
    layer = np.tile(np.arange(n_layers, dtype=np.int16), n_steps)
    logical_len = (prompt_tokens + step).astype(np.int32)
    query_tokens = np.where(step == 0, prompt_tokens, 1).astype(np.int32)
    n_blocks = -(-logical_len // block_size)
    zeros = np.zeros(len(step), dtype=np.int32)

    block_masses, importance_sum = [], np.zeros((n_layers, -(-(prompt_tokens + n_steps) // block_size)))
    for s in range(n_steps):
        masses = model.masses(s, prompt_tokens + s)
        block_masses.extend(masses.astype(np.float32))
        if s > 0:  # importance counts decode steps; spread a block's mass evenly over its tokens
            n = masses.shape[1]
            tokens_in_block = np.full(n, float(block_size))
            tokens_in_block[-1] = prompt_tokens + s - (n - 1) * block_size
            importance_sum[:, :n] += masses / tokens_in_block

    def ids(row_n_blocks: np.ndarray) -> list[list[int]]:
        if not movements:
            return [[] for _ in row_n_blocks]
        return [sorted(rng.choice(n, size=min(n, int(rng.integers(0, 3))), replace=False).tolist()) for n in row_n_blocks]

    kv_bytes = logical_len.astype(np.int64) * kv_bytes_per_token_per_layer
    steps = {
        "step": step, "layer": layer, "query_tokens": query_tokens, "logical_len": logical_len,
        "hbm_tokens": logical_len, "ddr_tokens": zeros, "evicted_tokens": zeros, "recalled_tokens": zeros,
        "hbm_blocks": n_blocks.astype(np.int32), "ddr_blocks": zeros, "evicted_blocks": zeros,
        "recalled_block_ids": ids(n_blocks), "promoted_block_ids": ids(n_blocks),
        "offloaded_block_ids": ids(n_blocks), "evicted_block_ids": ids(n_blocks),
        "bytes_h2d": np.zeros(len(step), dtype=np.int64), "bytes_d2h": np.zeros(len(step), dtype=np.int64),
        "hbm_kv_bytes": kv_bytes, "ddr_kv_bytes": np.zeros(len(step), dtype=np.int64),
        "mass_hbm": np.ones(len(step), dtype=np.float32), "mass_ddr": np.zeros(len(step), dtype=np.float32),
        "measured_step_us": np.repeat(rng.uniform(1e4, 3e4, n_steps), n_layers),  # one value per step
    }
    if movements:
        steps["quant_max_rel_err"] = rng.uniform(0, 0.01, len(step)).astype(np.float32)

    n_positions = prompt_tokens + generated_tokens
    position = np.arange(n_positions, dtype=np.int32)
    by_layer = importance_sum[:, position // block_size].T.astype(np.float32)  # [positions, layers]
    tokens = {
        "position": position,
        "token_id": rng.integers(0, 32000, n_positions, dtype=np.int32),
        "is_prompt": position < prompt_tokens,
        "importance": by_layer.mean(axis=1),
        "importance_max": by_layer.max(axis=1),
        "importance_by_layer": list(by_layer),
        "final_tier_by_layer": list(np.full((n_positions, n_layers), TIER_HBM, dtype=np.uint8)),
    }
    sample = {
        "sample_id": sample_id, "prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens,
        "stop_reason": "max_new_tokens", "predicted": None, "gold": None, "correct": None,
        "wall_s": float(steps["measured_step_us"][::n_layers].sum() / 1e6), "nonfinite": False,
        "generated_text": None,
    }
    access = {"step": step, "layer": layer, "block_mass": block_masses}
    return {"sample": sample, "steps": steps, "tokens": tokens, "access": access}


def example_manifest(
    *, architecture: str = "tiny", sample_ids: list[str] | None = None, block_size: int = 16, access: bool = True,
    kind: str = "synthetic", **policy_params,
) -> dict:
    """A valid run.json for `example_sample` rows: a known architecture, a full-HBM policy."""
    from traces.manifest import make_manifest, model_manifest

    policy = {
        "name": "full", "hbm_budget": 1.0, "evict_ratio": 0.0, "block_size": block_size, "scorer": "none",
        "recall_k": 0, "recall_rule": "none", "sink_tokens": 0, "window_tokens": 0, "params": dict(policy_params),
    }
    task = {"name": "example", "source": "traces.example", "split": "test", "sample_ids": list(sample_ids or [])}
    hardware = {"device": "cpu", "torch": None, "cuda": None, "transformers": None}
    return make_manifest(kind=kind, model=model_manifest(architecture), task=task, policy=policy,
                         hardware=hardware, seed=0, access=access)
