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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simulator.costs import ModelShape
from thoughtkv_base import UserError

TOKEN_FIELDS = ("hbm_tokens", "ddr_tokens", "recalled_tokens")
RECALL_MODES = ("share", "count")
BYTE_FIELDS = ("bytes_h2d", "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes")


class ProjectionError(UserError):
    """A projection that cannot be made (unknown architecture or dtype, bad scale): one line, exit 2."""


@dataclass(frozen=True)
class Projection:
    """`--as-model NAME [--as-dtype D] [--context-scale X]`, validated once on construction."""

    as_model: str
    dtype: str = "bfloat16"
    context_scale: float = 1.0
    recalls: str = "share"  # share: recalled tokens keep their share of the context; count: their traced count

    def __post_init__(self) -> None:
        target_shape(self.as_model, self.dtype)
        if self.recalls not in RECALL_MODES:
            raise ProjectionError(f"--recalls {self.recalls!r} is unknown; use one of {', '.join(RECALL_MODES)}")
        if isinstance(self.context_scale, bool) or not isinstance(self.context_scale, int | float) \
                or not math.isfinite(self.context_scale) or self.context_scale <= 0:
            raise ProjectionError(f"--context-scale {self.context_scale!r} must be a number > 0 (1 keeps the "
                                  "traced lengths)")

    @property
    def shape(self) -> ModelShape:
        return target_shape(self.as_model, self.dtype)

    def apply(self, arrays: dict[str, np.ndarray], source: ModelShape) -> dict[str, np.ndarray]:
        return project_arrays(arrays, source, self.shape, self.context_scale, self.recalls)

    def label(self, source_label: str) -> str:
        scale = f", context x{self.context_scale:g}" if self.context_scale != 1 else ""
        if self.context_scale != 1 and self.recalls == "count":
            scale += ", recalls by count"
        return f"{source_label} [as {self.as_model} {self.dtype}{scale}]"


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


def project_arrays(arrays: dict[str, np.ndarray], source: ModelShape, target: ModelShape,
                   context_scale: float = 1.0, recalls: str = "share") -> dict[str, np.ndarray]:
    """One sample's step arrays [steps, source layers] -> the same access pattern on `target` [steps, target
    layers] (see the module docstring). Columns other than the ones the cost model reads are dropped.

    `recalls="count"` keeps each layer-step's recalled tokens (and their staging in HBM) at the traced count
    instead of the traced share, at most the projected DDR tokens: a policy with a fixed recall_k at a longer
    context. Identical to "share" at context_scale 1."""
    columns = layer_map(source.n_layers, target.n_layers)
    length = np.asarray(arrays["logical_len"], dtype=np.float64)[:, columns]
    target_length = length * context_scale
    share = {}
    for name in TOKEN_FIELDS:
        share[name] = np.asarray(arrays[name], dtype=np.float64)[:, columns] / length
    for name in BYTE_FIELDS:  # bytes -> tokens of the source -> shares
        share[name] = np.asarray(arrays[name], dtype=np.float64)[:, columns] / source.kv_bytes_per_token_layer / length
    query = np.asarray(arrays["query_tokens"], dtype=np.float64)[:, columns]
    out = {
        "step": np.asarray(arrays["step"], dtype=np.float64)[:, columns],
        "layer": np.broadcast_to(np.arange(target.n_layers, dtype=np.float64), length.shape).copy(),
        "logical_len": target_length,
        "query_tokens": np.where(query > 1, query * context_scale, query),  # the prefill scales, decode stays 1
    }
    for name in TOKEN_FIELDS:
        out[name] = share[name] * target_length
    for name in BYTE_FIELDS:
        out[name] = share[name] * target_length * target.kv_bytes_per_token_layer
    if recalls == "count" and context_scale != 1:
        kvpl = target.kv_bytes_per_token_layer
        traced = np.asarray(arrays["recalled_tokens"], dtype=np.float64)[:, columns]
        recalled = np.minimum(traced, out["ddr_tokens"])
        moved = np.minimum(np.asarray(arrays["bytes_h2d"], dtype=np.float64)[:, columns]
                           / source.kv_bytes_per_token_layer, out["ddr_tokens"])
        # HBM at attention = resident (share) + staged recalls (now a count)
        out["hbm_kv_bytes"] = out["hbm_kv_bytes"] - (out["recalled_tokens"] - recalled) * kvpl
        out["recalled_tokens"] = recalled
        out["bytes_h2d"] = moved * kvpl
    return out
