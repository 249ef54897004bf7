"""What one serving request costs: a traced sample's steps precomputed once (SampleWork) so that the serving
simulation (serving.py) and its fast path only look numbers up, and a run's samples loaded as such."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from hwprofiles import HardwareProfile
from simulator import costs
from simulator.errors import ServingError
from simulator.mechanisms import (
    DEFAULT_MECHANISM,
    LOAD_FIELDS,
    LayerLoad,
    custom_layers,
    mechanism_for,
    sequence_load,
)
from simulator.mechanisms import build_workload as mechanism_workload
from simulator.options import Projection
from simulator.project import project_arrays
from simulator.recall_buffer import with_recall_buffer
from simulator.workload import step_arrays
from traces import open_run


@dataclass
class SampleWork:
    """One traced sample, precomputed once so that the DES only looks numbers up.

    Transfers come from the engine's Workload (workload.py: one operation per layer plus the LM head, with
    the recall before and the offload after it); compute is kept per sequence as FLOPs and KV bytes so that a
    batch of different sequences is one roofline (weights once + every sequence's own KV).
    """

    sample_id: str
    prompt_tokens: int
    flops: np.ndarray  # [steps, layers] FLOPs of this sequence
    kv_read_bytes: np.ndarray  # [steps, layers] its attention's HBM bytes: the KV read and the new KV written
    recall_bytes: np.ndarray  # [steps, layers + 1] H2D copy before each operation
    recall_s: np.ndarray
    offload_bytes: np.ndarray  # [steps, layers + 1] D2H copy after each operation
    offload_s: np.ndarray
    hbm_kv_bytes: np.ndarray  # [steps] KV bytes in HBM at attention, all layers, incl. recall buffers
    ddr_kv_bytes: np.ndarray  # [steps] KV bytes in DDR
    load: LayerLoad | None = None  # [steps, layers] demand, for mechanisms that change the layers (zero-copy, ...)
    event_s: np.ndarray | None = None  # [steps, layers] placement / recall bookkeeping (costs.event_times)
    query_tokens: np.ndarray | None = None  # [steps, layers] tokens through the GEMMs (the prompt at step 0, then 1)
    attn_flops: np.ndarray | None = None  # [steps, layers] FLOPs of its attention kernel
    attended_tokens: np.ndarray | None = None  # [steps, layers] tokens its attention reads (new ones included)

    @property
    def n_steps(self) -> int:
        return len(self.hbm_kv_bytes)

    def truncated(self, n_steps: int) -> SampleWork:
        """The first n_steps steps (a request asking for fewer output tokens than the sample generated)."""
        n = max(1, min(n_steps, self.n_steps))
        load = None if self.load is None else LayerLoad(**{f: getattr(self.load, f)[:n] for f in LOAD_FIELDS})
        return SampleWork(self.sample_id, self.prompt_tokens, *(getattr(self, f)[:n] for f in (
            "flops", "kv_read_bytes", "recall_bytes", "recall_s", "offload_bytes", "offload_s", "hbm_kv_bytes",
            "ddr_kv_bytes")), load, *(None if getattr(self, f) is None else getattr(self, f)[:n] for f in (
                "event_s", "query_tokens", "attn_flops", "attended_tokens")))

    @property
    def peak_hbm_kv_bytes(self) -> float:
        return float(self.hbm_kv_bytes.max())

    @property
    def peak_ddr_kv_bytes(self) -> float:
        return float(self.ddr_kv_bytes.max())


def sample_work(steps: pd.DataFrame, sample: pd.Series, shape: costs.ModelShape,
                profile: HardwareProfile, *, tier: str = "ddr", transfer: str = DEFAULT_MECHANISM,
                projection: Projection | None = None, lengths: tuple[int, int] | None = None,
                recall_buffer_blocks: int | None = None, block_size: int | None = None) -> SampleWork:
    """Arrays of one sample from its steps rows: the cost model's FLOPs/KV bytes and the engine's transfers
    (their durations, and what sits in HBM, under the `transfer` mechanism: simulator/mechanisms.py).

    `projection` (--as-model) prices the sample's access pattern on another architecture, as simulate_run does
    (project.py); `lengths` = (prompt, output tokens) resamples its steps to those lengths (a length model,
    simulator/lengths.py). Either way `shape` is the traced one and the work is costed on the target's.
    `recall_buffer_blocks` (with the run's `block_size`) replays the recorded recalls through a buffer of that
    many blocks first (simulator/recall_buffer.py: hits copy nothing, the buffer's HBM is reserved)."""
    grid = step_arrays(steps, shape.n_layers, f"sample {sample['sample_id']}")
    if recall_buffer_blocks is not None:
        grid = with_recall_buffer(grid, steps, recall_buffer_blocks, block_size, shape.kv_bytes_per_token_layer)
    prompt_tokens = int(sample["prompt_tokens"])
    if projection is not None or lengths is not None:
        projection = projection if projection is not None else Projection()
        target = projection.shape if projection.active else shape
        grid = project_arrays(grid, shape, target, projection.context_scale, projection.recalls, lengths=lengths)
        shape = target  # the block lists do not carry over: no moved_blocks / recalled_blocks, as in simulate_run
        prompt_tokens = int(lengths[0]) if lengths is not None else int(round(prompt_tokens * projection.context_scale))
    query, attended = grid.query_tokens, grid.attended_tokens
    n_steps, n_layers = query.shape
    flops, _ = costs.layer_flops_bytes(shape, query, attended, batch=1)
    attn_flops, attn_bytes = costs.attention_flops_bytes(shape, query, attended)
    mechanism = mechanism_for(transfer, profile)
    # sync offload and no overlap: the copies' durations only; a serving iteration stretches ops itself
    work = mechanism_workload(mechanism, str(sample["sample_id"]), shape, profile,
                              replace(grid, moved_blocks=None, recalled_blocks=None), tier=tier, overlap="none",
                              async_offload=False)  # the blocks' bookkeeping: event_s, once per iteration
    load = sequence_load(mechanism, shape, query, grid.hbm_tokens, grid.recalled_tokens, grid.bytes_h2d) \
        if custom_layers(mechanism) else None
    ops = (n_steps, n_layers + 1)
    return SampleWork(
        sample_id=str(sample["sample_id"]), prompt_tokens=prompt_tokens,
        flops=flops, kv_read_bytes=attn_bytes,
        recall_bytes=work.recall_bytes.reshape(ops), recall_s=work.recall_s.reshape(ops),
        offload_bytes=work.offload_bytes.reshape(ops), offload_s=work.offload_s.reshape(ops),
        hbm_kv_bytes=work.step_hbm_kv_bytes, ddr_kv_bytes=work.step_ddr_kv_bytes, load=load,
        event_s=costs.event_times(shape, profile, grid.moved_blocks, grid.bytes_h2d,
                                  recalled_blocks=grid.recalled_blocks),
        query_tokens=np.asarray(query, dtype=np.float64), attn_flops=attn_flops,
        attended_tokens=np.asarray(attended, dtype=np.float64),
    )


def load_run_work(run_dir: str | Path, profile: HardwareProfile, *, tier: str = "ddr",
                  transfer: str = DEFAULT_MECHANISM, projection: Projection | None = None,
                  lengths: str | None = None, seed: int = 0,
                  classes: list[tuple[int, int, int]] | None = None, recall_buffer_blocks: int | None = None
                  ) -> tuple[dict, costs.ModelShape, list[SampleWork]]:
    """The run's manifest, the shape its work is costed on and its samples as SampleWork, costed on `profile` as
    given (the caller picks the policy's overheads: simulate_serving): every committed sample, or with a length
    model (`lengths`, simulator/lengths.py) one work per length class, each a sample drawn with `seed`
    resampled to the class's (prompt, output) tokens, or one work per (sample index, prompt, output) of
    `classes` (an arrival CSV's lengths: lengths.csv_classes). `projection` prices them on another architecture;
    `recall_buffer_blocks` replays the recalls through a recall buffer (`sample_work`)."""
    from simulator.workload import STEP_COLUMNS

    run = open_run(run_dir)
    shape = costs.ModelShape.from_manifest(run.manifest["model"])
    projection = projection if projection is not None and projection.active else None
    samples = run.samples()
    if samples.empty:
        raise ServingError(f"{run_dir}: the run has no committed samples; trace or synthesise some first")
    steps = run.steps(columns=["sample_id", *STEP_COLUMNS])
    by_sample = dict(tuple(steps.groupby("sample_id", sort=False)))
    buffer = dict(recall_buffer_blocks=recall_buffer_blocks, block_size=int(run.manifest["policy"]["block_size"]))
    if lengths is not None:
        from simulator.lengths import length_model

        sizes = length_model(lengths).classes()
        picks = np.random.default_rng([seed, 1]).integers(0, len(samples), size=len(sizes))
        classes = [(int(i), prompt, output) for i, (prompt, output) in zip(picks, sizes)]
    if classes is None:
        works = [sample_work(by_sample[row.sample_id], row, shape, profile, tier=tier, transfer=transfer,
                             projection=projection, **buffer)
                 for _, row in samples.iterrows()]
    else:
        works = [sample_work(by_sample[samples.iloc[i]["sample_id"]], samples.iloc[i], shape, profile, tier=tier,
                             transfer=transfer, projection=projection, lengths=(prompt, output), **buffer)
                 for i, prompt, output in classes]
    return run.manifest, (projection.shape if projection is not None else shape), works
