"""Projection to another model's shapes: `thoughtkv simulate RUN --as-model qwen2-7b`.

A trace of the bundled micro model (3 layers, fp32) says how a policy moved blocks; projection replays that
access pattern on another architecture of `traces.architectures` (its layers, heads, weights and dtype) so
that the run says something about a 7B, 32B or 70B on each hardware profile.

What is kept, per step s and target layer l (mapped to source layer m = floor(l * L_src / L_target), layers
proportionally), is every tier's share of that step's tokens:

    x_target[s, l] = (x_source[s, m] / logical_len[s]) * logical_len_target[s]    for the token counts
                     hbm_tokens, ddr_tokens, recalled_tokens (and the tokens behind bytes_h2d, bytes_d2h,
                     hbm_kv_bytes, ddr_kv_bytes, whose bytes are then tokens x the target's KV bytes per
                     token and layer)
    logical_len_target = context_scale x logical_len, query tokens of the prefill x context_scale,
    decode query tokens = 1

With `context_scale` 1 (the default) the token counts are the traced ones and only bytes per token and the
cost of every operation change. Assumptions (also in simulator/README.md): the target model's attention would
pick blocks with the same shares per tier (the policy's budget, recall_k and block size act in tokens, so the
shares carry over; which blocks are important need not); a layer of the target behaves like the source layer
at the same relative depth; with a context scale, each projected step stands for the same fraction of the
sequence (step counts do not change, so ms/token is the mean over the projected lengths). With
`recalls="count"` the recalled tokens per layer-step keep their traced count instead (a fixed recall_k).

Serving with a request-length model (`serve-sim --lengths`, simulator/lengths.py) resamples the steps too: a
request of P prompt and T output tokens replays, at its step j, the traced step at the same relative position of
the decode (`step_map`), at logical length P + j, every tier keeping its share; resampled to the traced lengths it
is the identity (tested). The option (flags, checks) is `simulator.options.Projection`; this module is its
arithmetic.
"""

from __future__ import annotations

import numpy as np

from simulator.costs import ModelShape
from simulator.errors import ProjectionError
from simulator.workload import StepArrays

# The option itself (options.Projection: flags, grid keys, checks) imports this module for the arithmetic.
__all__ = ["layer_map", "project_arrays", "step_map", "target_shape"]

TOKEN_FIELDS = ("hbm_tokens", "ddr_tokens", "recalled_tokens")
BYTE_FIELDS = ("bytes_h2d", "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes")


def target_shape(as_model: str, dtype: str = "bfloat16") -> ModelShape:
    """The cost model's shape of an architecture of traces.architectures in `dtype`."""
    from traces.architectures import ARCHITECTURES, DTYPE_BYTES
    from traces.manifest import model_manifest

    if as_model not in ARCHITECTURES:
        raise ProjectionError(f"--as-model {as_model!r} is not a known architecture; use one of "
                              f"{', '.join(ARCHITECTURES)}")
    if dtype not in DTYPE_BYTES:
        raise ProjectionError(f"--as-dtype {dtype!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")
    return ModelShape.from_manifest(model_manifest(as_model, dtype=dtype))


def layer_map(source_layers: int, target_layers: int) -> np.ndarray:
    """Target layer l -> source layer floor(l * L_src / L_target) (proportional depth)."""
    return (np.arange(target_layers) * source_layers) // target_layers


def step_map(source_steps: int, target_steps: int) -> np.ndarray:
    """Target step j -> the source step at the same relative position of the decode: the prefill (step 0) is the
    prefill, decode step j of T - 1 is source step ceil(j (N - 1) / (T - 1)) of N - 1 (every source decode step
    is used when T >= N; each stands for about T / N target steps when T > N)."""
    if target_steps < 1 or source_steps < 1:
        raise ProjectionError(f"a sample needs at least one step (source {source_steps}, target {target_steps})")
    rows = np.zeros(target_steps, dtype=np.int64)
    if target_steps > 1 and source_steps > 1:
        j = np.arange(1, target_steps, dtype=np.int64)
        rows[1:] = -((-j * (source_steps - 1)) // (target_steps - 1))  # integer ceil: no float rounding
    return rows


def project_arrays(arrays: StepArrays, source: ModelShape, target: ModelShape,
                   context_scale: float = 1.0, recalls: str = "share",
                   lengths: tuple[int, int] | None = None) -> StepArrays:
    """One sample's step arrays [steps, source layers] -> the same access pattern on `target` [steps, target
    layers] (see the module docstring). Columns other than the ones the cost model reads are dropped.

    `recalls="count"` keeps each layer-step's recalled tokens (and their staging in HBM) at the traced count
    instead of the traced share, at most the projected DDR tokens: a policy with a fixed recall_k at a longer
    context. Identical to "share" at context_scale 1.

    `lengths` = (prompt P, output tokens T) resamples the steps first (a request-length model,
    simulator/lengths.py): T steps, step j replaying source step `step_map(N, T)[j]`'s tier shares at logical
    length P + j (the prefill: P query tokens), instead of the traced lengths scaled by `context_scale`."""
    columns = layer_map(source.n_layers, target.n_layers)
    rows = slice(None) if lengths is None else step_map(len(arrays.logical_len), int(lengths[1]))

    def source_column(name: str) -> np.ndarray:
        return np.asarray(getattr(arrays, name), dtype=np.float64)[rows][:, columns]

    length = source_column("logical_len")
    query = source_column("query_tokens")
    if lengths is None:
        target_length = length * context_scale
        target_query = np.where(query > 1, query * context_scale, query)  # the prefill scales, decode stays 1
    else:
        prompt, n_steps = int(lengths[0]), int(lengths[1])
        target_length = np.broadcast_to(prompt + np.arange(n_steps, dtype=np.float64)[:, None], length.shape).copy()
        target_query = np.ones_like(length)
        target_query[0] = prompt
    share = {}
    for name in TOKEN_FIELDS:
        share[name] = source_column(name) / length
    for name in BYTE_FIELDS:  # bytes -> tokens of the source -> shares
        share[name] = source_column(name) / source.kv_bytes_per_token_layer / length
    out = {
        "logical_len": target_length,
        "query_tokens": target_query,
    }
    for name in TOKEN_FIELDS:
        out[name] = share[name] * target_length
    for name in BYTE_FIELDS:
        out[name] = share[name] * target_length * target.kv_bytes_per_token_layer
    if recalls == "count" and (context_scale != 1 or lengths is not None):
        kvpl = target.kv_bytes_per_token_layer
        traced = source_column("recalled_tokens")
        recalled = np.minimum(traced, out["ddr_tokens"])
        moved = np.minimum(source_column("bytes_h2d") / source.kv_bytes_per_token_layer, out["ddr_tokens"])
        # HBM at attention = resident (share) + staged recalls (now a count)
        out["hbm_kv_bytes"] = out["hbm_kv_bytes"] - (out["recalled_tokens"] - recalled) * kvpl
        out["recalled_tokens"] = recalled
        out["bytes_h2d"] = moved * kvpl
    return StepArrays(**out)
