"""One sample as the engines see it: a flat sequence of GPU operations with the transfers around them.

A decode step is `n_layers` layer operations followed by one LM-head operation. Operation i has

    compute_s[i]   its roofline time on the GPU (costs.py)
    recall_s[i]    the H2D copy attention must wait for before it (0: nothing recalled)
    offload_s[i]   the D2H copy after it (0: nothing offloaded)

per sequence, and every step the host's `host.lead_s` before the GPU can start and `host.step_s` before its
token is out (costs.host_times; 0 without a host model). Both engines (engine.py: the DES; fastpath.py: closed form) read the same arrays, so they can
only differ in how they schedule, never in what things cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hwprofiles import HardwareProfile
from simulator import costs
from traces.errors import TraceFormatError

# The steps.parquet columns the engines read (one row per step and layer): numbers, and the block-id lists whose
# lengths say how many blocks the placement moved (`moved_blocks`: the placement overhead is charged there).
NUMERIC_STEP_COLUMNS = (
    "step", "layer", "query_tokens", "logical_len", "hbm_tokens", "ddr_tokens", "recalled_tokens", "bytes_h2d",
    "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes",
)
MOVE_COLUMNS = ("promoted_block_ids", "offloaded_block_ids", "evicted_block_ids")
# (recall_misses: the copies of a trace recorded with a recall buffer, for replaying another: simulator/recall_buffer.py)
STEP_COLUMNS = NUMERIC_STEP_COLUMNS + MOVE_COLUMNS + ("recalled_block_ids", "recall_misses")


@dataclass(frozen=True)
class StepArrays:
    """One sample's steps as float64 arrays [n_steps, n_layers]: what the cost model and the engines read.

    `logical_len` and `ddr_tokens` are the tracer's (the replays and projections read them); `moved_blocks`
    and `recalled_blocks` count the blocks each layer-step moved or recalled (placement and recall
    bookkeeping; None where they are not known, e.g. once projected onto another model)."""

    query_tokens: np.ndarray
    hbm_tokens: np.ndarray
    recalled_tokens: np.ndarray
    bytes_h2d: np.ndarray
    bytes_d2h: np.ndarray
    hbm_kv_bytes: np.ndarray
    ddr_kv_bytes: np.ndarray
    logical_len: np.ndarray | None = None
    ddr_tokens: np.ndarray | None = None
    moved_blocks: np.ndarray | None = None
    recalled_blocks: np.ndarray | None = None

    @property
    def attended_tokens(self) -> np.ndarray:
        """Tokens attention reads per layer-step: those resident in HBM and those recalled into it."""
        return np.asarray(self.hbm_tokens, dtype=np.float64) + np.asarray(self.recalled_tokens, dtype=np.float64)


def step_arrays(frame, n_layers: int, where: str = "steps table") -> StepArrays:
    """One sample's steps rows (any order) -> StepArrays: NUMERIC_STEP_COLUMNS as float64 [n_steps, n_layers]
    and `moved_blocks` (the lengths of the MOVE_COLUMNS lists present, summed; 0 where none are).

    Refuses rows that are not exactly one per (step, layer) for steps 0..n-1: the arrays would mix up layers."""
    frame = frame.sort_values(["step", "layer"], kind="stable")
    n_steps = len(frame) // n_layers
    step = frame["step"].to_numpy()
    layer = frame["layer"].to_numpy()
    if (n_steps == 0 or n_steps * n_layers != len(frame) or (step != np.repeat(np.arange(n_steps), n_layers)).any()
            or (layer != np.tile(np.arange(n_layers), n_steps)).any()):
        raise TraceFormatError(f"{where}: {len(frame)} rows that are not one per (step, layer) for {n_layers} layers; "
                               "run `thoughtkv traces validate`")
    arrays = {c: frame[c].to_numpy(dtype=np.float64).reshape(n_steps, n_layers)
              for c in NUMERIC_STEP_COLUMNS if c not in ("step", "layer")}
    moved = np.zeros(len(frame), dtype=np.float64)
    for column in MOVE_COLUMNS:
        if column in frame:
            moved += frame[column].map(lambda ids: 0 if ids is None else len(ids)).to_numpy(dtype=np.float64)
    recalled = (frame["recalled_block_ids"].map(lambda ids: 0 if ids is None else len(ids)).to_numpy(dtype=np.float64)
                if "recalled_block_ids" in frame else np.zeros(len(frame)))
    return StepArrays(**arrays, moved_blocks=moved.reshape(n_steps, n_layers),
                      recalled_blocks=recalled.reshape(n_steps, n_layers))


@dataclass
class Workload:
    sample_id: str
    n_steps: int
    n_layers: int
    batch: int
    compute_s: np.ndarray  # [n_steps * (n_layers + 1)] GPU time of each operation (all `batch` sequences)
    compute_only_s: np.ndarray  # the compute-bound part of compute_s
    hbm_only_s: np.ndarray  # the bandwidth-bound part
    overhead_s: np.ndarray
    recall_bytes: np.ndarray  # per sequence, before the operation
    offload_bytes: np.ndarray  # per sequence, after the operation
    recall_s: np.ndarray  # one sequence's recall: overhead + bytes / bandwidth (0 if no bytes)
    offload_s: np.ndarray
    recall_overhead_s: float  # the fixed part of each transfer (for the copy-engine + wire link model)
    offload_overhead_s: float
    step_hbm_kv_bytes: np.ndarray  # [n_steps] one sequence's KV in HBM at attention, summed over layers
    step_ddr_kv_bytes: np.ndarray  # [n_steps] one sequence's KV in DDR
    host: costs.HostTimes = costs.NO_HOST  # the host's lead and whole-step time of every step (costs.host_times)

    @property
    def ops_per_step(self) -> int:
        return self.n_layers + 1


def build_workload(
    sample_id: str,
    shape: costs.ModelShape,
    profile: HardwareProfile,
    steps: StepArrays,
    *,
    batch: int = 1,
    tier: str = "ddr",
) -> Workload:
    """One sample's StepArrays (trace rows or a what-if replay) -> a Workload. `steps.moved_blocks` (blocks the
    placement moved per layer-step; None: none known) adds the placement overhead where > 0."""
    query_tokens = np.asarray(steps.query_tokens, dtype=np.float64)
    attended_tokens = steps.attended_tokens
    bytes_h2d, bytes_d2h = steps.bytes_h2d, steps.bytes_d2h
    moved_blocks, recalled_blocks = steps.moved_blocks, steps.recalled_blocks
    n_steps, n_layers = query_tokens.shape
    layer = costs.layer_times(shape, profile, query_tokens, attended_tokens, batch)
    layer = costs.with_events(layer, shape, profile, moved_blocks, bytes_h2d, batch, recalled_blocks)  # bookkeeping
    head = costs.head_times(shape, profile, batch)

    def with_head(per_layer: np.ndarray, head_value: float) -> np.ndarray:
        out = np.empty((n_steps, n_layers + 1), dtype=np.float64)
        out[:, :n_layers] = per_layer
        out[:, n_layers] = head_value
        return out.ravel()

    home = costs.offload_tier(profile, tier)
    h2d_rate, d2h_rate, overhead = home.h2d_bytes_per_s, home.d2h_bytes_per_s, home.transfer_overhead_s
    recall_bytes = with_head(bytes_h2d, 0.0)
    offload_bytes = with_head(bytes_d2h, 0.0)
    return Workload(
        sample_id=sample_id,
        n_steps=n_steps,
        n_layers=n_layers,
        batch=batch,
        compute_s=with_head(layer.total_s, float(head.total_s)),
        compute_only_s=with_head(layer.compute_s, float(head.compute_s)),
        hbm_only_s=with_head(layer.hbm_s, float(head.hbm_s)),
        overhead_s=with_head(layer.overhead_s, float(head.overhead_s)),
        recall_bytes=recall_bytes,
        offload_bytes=offload_bytes,
        recall_s=costs.transfer_s(recall_bytes, h2d_rate, overhead),
        offload_s=costs.transfer_s(offload_bytes, d2h_rate, overhead),
        recall_overhead_s=overhead,
        offload_overhead_s=overhead,
        step_hbm_kv_bytes=np.asarray(steps.hbm_kv_bytes, dtype=np.float64).sum(1),
        step_ddr_kv_bytes=np.asarray(steps.ddr_kv_bytes, dtype=np.float64).sum(1),
        host=costs.host_times(shape, profile),
    )


@dataclass
class Timing:
    """What an engine measured for one Workload (both engines fill the same record)."""

    step_end_s: np.ndarray  # [n_steps] time the step's token is out (end of its LM head)
    h2d_busy_s: float  # sum of H2D transfer durations (all copies)
    d2h_busy_s: float
    last_d2h_end_s: float  # when the last offload finished (may be after the last token: the backlog)
    h2d_bytes: float  # bytes moved (all copies of a batch)
    d2h_bytes: float

    @property
    def total_s(self) -> float:
        return float(self.step_end_s[-1]) if len(self.step_end_s) else 0.0
