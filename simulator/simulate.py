"""simulate_run: one trace run x one hardware profile -> per-sample results and per-step latencies.

    from simulator import SimOptions, simulate_run
    result = simulate_run("runs/r1", "h200-sxm", SimOptions(overlap="none"), what_if="budget=0.3,block=32")
    result.summary      # one row (dict) for the whole run; result.samples: one row per sample
    result.steps        # DataFrame: sample_id, step, latency_s, compute_s, link_stall_s, ...

The columns are those of simulator/columns.py; every output formula is in simulator/README.md ("Outputs").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from hwprofiles import HardwareProfile, load_profile
from hwprofiles.overhead_modes import apply_mode, mode_of
from simulator import costs, fastpath, mechanisms, tiers
from simulator.columns import (
    KEY_COLUMNS,
    MAX_COLUMNS,
    MIN_COLUMNS,
    RESULT_COLUMNS,
    SUM_COLUMNS,
    SUMMARY_SAMPLE_ID,
)
from simulator.costs import ModelShape
from simulator.engine import Timeline, engines_per_channel, run_des
from simulator.errors import SimulationError
from simulator.options import KEY_FIELDS, Projection, SimOptions
from simulator.recall_buffer import with_recall_buffer
from simulator.whatif import parse_what_if, replay, replays_own_recalls, traced_config, what_if_config
from simulator.workload import STEP_COLUMNS, StepArrays, Timing, Workload, step_arrays
from traces.host import provenance_warning, same_host
from traces.policy import PREFETCHABLE_RECALL_RULES, PolicySpec, recall_is_prefetchable
from traces.reader import TraceRun, open_run

__all__ = ["SimResult", "SimulationError", "check_prefetch", "simulate_run", "summarise"]


@dataclass
class SimResult:
    samples: pd.DataFrame  # one row per sample (columns.RESULT_COLUMNS)
    steps: pd.DataFrame  # one row per (sample, step)
    summary: dict = field(default_factory=dict)  # the run as one row: sums / maxima over samples
    warnings: list[str] = field(default_factory=list)  # one line each, for the CLI to print (e.g. another host)


def simulate_run(
    run_dir: str | Path | TraceRun,
    profile: str | HardwareProfile,
    options: SimOptions | None = None,
    what_if: str | dict | None = None,
    timeline: Timeline | None = None,
    progress: Callable[[int], object] | None = None,
    projection: Projection | None = None,
) -> SimResult:
    """Simulate every committed sample of a run on one profile (see the module docstring and README).

    `timeline` records the first sample (with the DES); `progress(1)` is called after each sample.
    `projection` (project.Projection, `--as-model`) replays the run's access pattern on another architecture.
    """
    options = SimOptions() if options is None else options
    if projection is not None and not projection.active:  # Projection(): the run's own shapes
        projection = None
    if not isinstance(options, SimOptions):
        raise TypeError(f"options must be a SimOptions, not {type(options).__name__}")
    overlap, async_offload, engine = options.overlap, options.async_offload, options.engine
    run = run_dir if isinstance(run_dir, TraceRun) else open_run(run_dir)
    profile = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    chain = tiers.tier_chain(profile, options.offload_tier)  # an unknown tier fails before any work (ddr+TIER: spill)
    shape = ModelShape.from_manifest(run.manifest["model"])
    policy = run.manifest["policy"]
    overrides = parse_what_if(what_if)
    projected = bool(overrides) or what_if == {}  # an empty dict still asks for a replay of the traced policy
    if projected and not run.has_access:
        raise SimulationError(f"--what-if needs per-block masses but {run.path} was recorded without access; "
                              "re-collect with access enabled")
    config = what_if_config(policy, overrides) if projected else traced_config(policy)
    if overlap == "layer-prefetch":
        check_prefetch(run, config, projected)
    if projected and options.recall_buffer_blocks is not None:
        raise SimulationError("--recall-buffer-blocks replays the recalls the trace recorded; a --what-if "
                              "re-places the blocks: drop one of them")
    host_warning = provenance_warning(profile.name, profile.provenance, str(run.path), run.manifest.get("hardware"))
    profile = apply_mode(profile, options.overhead_mode, options.host_term)  # measured | kernel-only | hf-eager | cuda-graphs
    geometry_warning = costs.geometry_warning(profile, config, str(run.path)) if mode_of(profile) == "measured" else None
    profile, overhead_source = costs.profile_for_policy(profile, config.policy)
    mechanism = mechanisms.mechanism_for(options.transfer, profile)  # refused on a profile lacking its parameters

    sample_ids = run.sample_ids()
    if not sample_ids:
        raise SimulationError(f"{run.path}: no committed samples to simulate; let the trace run finish (or resume it)")
    rows, step_frames = [], []
    for index, sample_id in enumerate(sample_ids):
        frame = run.steps(sample_id, columns=list(STEP_COLUMNS))
        arrays = step_arrays(frame, shape.n_layers, f"{run.path} sample {sample_id}")
        if options.recall_buffer_blocks is not None:  # hits copy nothing; the buffer's blocks sit in HBM
            arrays = with_recall_buffer(arrays, frame, options.recall_buffer_blocks, int(policy["block_size"]),
                                        shape.kv_bytes_per_token_layer)
        mass_evicted = mass_not_recalled = None
        if projected:
            recorded = recorded_recalls(run, sample_id, shape.n_layers) if replays_own_recalls(policy, config) else None
            played = replay(run.access(sample_id), arrays.logical_len[:, 0], shape.n_layers,
                            int(policy["block_size"]), config, shape.kv_bytes_per_token_layer, recorded)
            kvpl = shape.kv_bytes_per_token_layer
            arrays = replace(
                arrays, hbm_tokens=played.hbm_tokens, recalled_tokens=played.recalled_tokens,
                bytes_h2d=played.bytes_h2d, bytes_d2h=played.bytes_d2h, moved_blocks=played.moved_blocks,
                recalled_blocks=played.recalled_blocks,
                hbm_kv_bytes=(played.hbm_tokens + played.recalled_tokens) * kvpl,
                ddr_kv_bytes=played.ddr_tokens * kvpl,
            )
            decode = slice(1, None) if len(played.mass_evicted) > 1 else slice(None)
            mass_evicted = float(played.mass_evicted[decode].mean())
            mass_not_recalled = float(played.mass_not_recalled[decode].mean())
        cost_shape = shape if projection is None else projection.shape  # --as-model: the target's shapes
        if projection is not None:
            arrays = projection.apply(arrays, shape)
        work = mechanisms.build_workload(  # --transfer: how blocks cross the link (dma-per-block: as before)
            mechanism, sample_id, cost_shape, profile, arrays, batch=options.batch,
            tier=tiers.tier_for(profile, chain, options.batch * float(arrays.ddr_kv_bytes.sum(1).max())),
            overlap=overlap, async_offload=async_offload,  # moved/recalled blocks: None once projected
        )
        record = timeline if index == 0 else None  # a timeline shows the first sample (the DES records it)
        use_fast = engine == "fast" or (engine == "auto" and record is None
                                        and fastpath.applies(work, profile, overlap, async_offload))
        if engine == "fast" and not fastpath.applies(work, profile, overlap, async_offload):
            raise SimulationError("--engine fast covers transfers that share no resource in other ways than a sum (a "
                                  "lockstep --batch and async offload only on a full-duplex link with one copy "
                                  "engine per direction); use des")
        if use_fast:
            timing = fastpath.run_fast(work, profile, overlap, async_offload)
        else:
            if record is not None:
                record.begin_process(f"{profile.name} {sample_id}")
            timing = run_des(work, profile, overlap, async_offload, record)
        row = _sample_row(run, cost_shape, profile, config, options, work, timing, arrays,
                          engine_used="fast" if use_fast else "des", projected=projected, overrides=overrides,
                          mass_evicted=mass_evicted, mass_not_recalled=mass_not_recalled,
                          overhead_source=overhead_source)
        if projection is not None:  # labelled "projected", the source run named
            row.update(result_kind="projected", run_label=projection.label(row["run_label"]))
        row["overhead_mode"] = mode_of(profile)  # the mode charged (the option may leave it to the profile)
        row["host_term"] = profile.host_model.term  # and the host's cost per op it used (none without a host model)
        rows.append(row)
        if progress is not None:
            progress(1)
        step_frames.append(_step_frame(work, timing))
    samples = pd.DataFrame(rows)
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame()
    for key in KEY_COLUMNS:
        if key != "sample_id" and key in samples:
            steps[key] = samples[key].iloc[0] if len(samples) else None
    return SimResult(samples=samples, steps=steps, summary=summarise(samples),
                     warnings=[w for w in (host_warning, geometry_warning) if w])


def recorded_recalls(run: TraceRun, sample_id: str, n_layers: int) -> list[list]:
    """[step][layer] -> the block ids the tracer recalled (a replay of the run's own key-bound recall rule)."""
    frame = run.steps(sample_id, columns=["step", "layer", "recalled_block_ids"]).sort_values(["step", "layer"])
    ids = frame["recalled_block_ids"].tolist()
    return [ids[s : s + n_layers] for s in range(0, len(ids), n_layers)]


def check_prefetch(run: TraceRun, config: PolicySpec, projected: bool) -> None:
    """layer-prefetch issues a recall before the layer's query exists: only a recall set known in advance (the
    policy contract's `recall_is_prefetchable`: the rules that read nothing of the current query)."""
    if config.policy != "hierarchy" or (config.recall_k == 0 and config.recall_budget is None) \
            or recall_is_prefetchable(config.recall_rule):
        return
    source = "--what-if" if projected else f"the trace's recall_rule {run.manifest['policy'].get('recall_rule')!r}"
    raise SimulationError(
        f"--overlap layer-prefetch needs recalls decided before the layer runs, but {source} picks them with the "
        f"current query; use --overlap none, a run traced with --recall-rule "
        f"{' or '.join(PREFETCHABLE_RECALL_RULES)}, or --what-if recall_rule=score"
    )


def _sample_row(run, shape, profile, config: PolicySpec, options: SimOptions, work: Workload, timing: Timing,
                arrays: StepArrays, *, engine_used, projected, overrides, mass_evicted, mass_not_recalled,
                overhead_source) -> dict:
    """One results row, in the order and with the names of columns.RESULT_COLUMNS."""
    batch = work.batch
    total_s = timing.total_s
    prefill_s = float(timing.step_end_s[0])
    decode_steps = work.n_steps - 1
    decode_s = total_s - prefill_s
    compute_s = float(work.compute_only_s.sum())
    hbm_s = float(work.hbm_only_s.sum())
    overhead_s = float(work.overhead_s.sum() + host_wait_s(work).sum())
    link_stall_s = max(0.0, total_s - compute_s - hbm_s - overhead_s)
    engines = engines_per_channel(profile)
    # Per-sequence footprint for the capacity projection: the decode steps' peak (the prefill's all-prompt
    # residency is transient: it is offloaded layer by layer, and servers chunk prefills).
    decode_rows = slice(1, None) if work.n_steps > 1 else slice(None)
    kv_hbm_per_seq = float(work.step_hbm_kv_bytes[decode_rows].max())
    kv_ddr_per_seq = float(work.step_ddr_kv_bytes[decode_rows].max())
    kv_full_per_seq = float(arrays.logical_len[-1, 0] * shape.kv_bytes_per_token)
    free_hbm = profile.gpu.hbm_capacity_bytes - shape.weight_bytes
    chain = tiers.tier_chain(profile, options.offload_tier)
    ddr_capacity = tiers.capacity_bytes(profile, chain)  # the offload tier, with its spill tier (ddr+TIER)
    peak_hbm = shape.weight_bytes + batch * float(work.step_hbm_kv_bytes.max())
    peak_ddr = batch * float(work.step_ddr_kv_bytes.max())
    label = str(run.manifest.get("label") or run.path.name) + (f" [what-if {_describe(overrides)}]" if projected else "")
    values = {
        "run_dir": str(run.path),
        "run_label": label,
        "result_kind": "projected" if projected else "synthetic" if run.manifest.get("kind") == "synthetic" else "traced",
        "model": shape.name,
        "policy": config.policy,
        "hbm_budget": config.hbm_budget,
        "evict_ratio": config.evict_ratio,
        "block_size": config.block_size,
        "recall_k": config.recall_k,
        "scorer": config.scorer if projected else str(run.manifest["policy"].get("scorer")),
        "recall_rule": config.recall_rule if projected else str(run.manifest["policy"].get("recall_rule")),
        "policy_key": (config if projected else PolicySpec.from_manifest(run.manifest["policy"])).identity(),
        "profile": profile.name,
        **{name: getattr(options, name) for name in KEY_FIELDS},
        "engine": engine_used,
        "overhead_set": costs.overheads_for(shape, profile).set,
        "overhead_source": overhead_source,
        "sample_id": work.sample_id,
        "steps": work.n_steps,
        "prompt_tokens": int(arrays.query_tokens[0, 0]),
        "total_s": total_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "ms_per_token": 1e3 * (decode_s / decode_steps if decode_steps else prefill_s),
        "tokens_per_s": batch * decode_steps / decode_s if decode_steps and decode_s > 0 else math.nan,
        "compute_s": compute_s,
        "hbm_s": hbm_s,
        "overhead_s": overhead_s,
        "host_s": work.n_steps * work.host.step_s,
        "link_stall_s": link_stall_s,
        "link_stall_frac": link_stall_s / total_s if total_s else 0.0,
        "bytes_h2d": int(round(timing.h2d_bytes)),
        "bytes_d2h": int(round(timing.d2h_bytes)),
        "link_util_h2d": timing.h2d_busy_s / (total_s * engines) if total_s else 0.0,
        "link_util_d2h": timing.d2h_busy_s / (total_s * engines) if total_s else 0.0,
        "d2h_backlog_s": max(0.0, timing.last_d2h_end_s - total_s),
        "peak_hbm_bytes": int(round(peak_hbm)),
        "peak_ddr_bytes": int(round(peak_ddr)),
        "hbm_capacity_bytes": profile.gpu.hbm_capacity_bytes,
        "hbm_overflow": bool(peak_hbm > profile.gpu.hbm_capacity_bytes),
        "ddr_overflow": bool(peak_ddr > ddr_capacity),
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_seq_full": int(round(kv_full_per_seq)),
        "kv_hbm_bytes_per_seq": int(round(kv_hbm_per_seq)),
        "kv_ddr_bytes_per_seq": int(round(kv_ddr_per_seq)),
        "max_concurrency_full": _fit(free_hbm, kv_full_per_seq),
        "max_concurrency_policy": _fit(free_hbm, kv_hbm_per_seq),
        "max_concurrency_ddr": tiers.sequences_that_fit(profile, chain, kv_ddr_per_seq) if kv_ddr_per_seq > 0
        else None,
        "mass_lost_evicted": mass_evicted,
        "mass_lost_not_recalled": mass_not_recalled,
        "same_host": same_host(profile.provenance.get("host_facts"), (run.manifest.get("hardware") or {}).get("host_facts")),
    }
    return {name: values[name] for name in RESULT_COLUMNS}  # a column missing from `values` fails here


def _fit(capacity_bytes: float, per_sequence_bytes: float) -> int:
    """Whole sequences that fit (0 when not even one, e.g. the weights alone overflow)."""
    if per_sequence_bytes <= 0:
        return 0 if capacity_bytes < 0 else 2**31 - 1
    return max(0, int(capacity_bytes // per_sequence_bytes))


def _describe(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "traced policy"


def host_wait_s(work: Workload) -> np.ndarray:
    """[n_steps] the host time the GPU waits for in each step, counted without copies: max(lead + GPU, host) -
    GPU (costs.host_step_s; 0 without a host model). What copies add beyond it is link stall."""
    if not (work.host.lead_s or work.host.step_s):
        return np.zeros(work.n_steps)
    gpu_s = work.compute_s.reshape(work.n_steps, work.ops_per_step).sum(1)
    return costs.host_step_s(gpu_s, work.host) - gpu_s


def _step_frame(work: Workload, timing: Timing) -> pd.DataFrame:
    per_step = work.ops_per_step
    end = timing.step_end_s
    latency = np.diff(np.concatenate([[0.0], end]))
    host_wait = host_wait_s(work)
    gpu_s = work.compute_s.reshape(work.n_steps, per_step).sum(1) + host_wait
    return pd.DataFrame({
        "sample_id": work.sample_id,
        "step": np.arange(work.n_steps, dtype=np.int32),
        "latency_s": latency,
        "compute_s": work.compute_only_s.reshape(work.n_steps, per_step).sum(1),
        "hbm_s": work.hbm_only_s.reshape(work.n_steps, per_step).sum(1),
        "overhead_s": work.overhead_s.reshape(work.n_steps, per_step).sum(1) + host_wait,
        "link_stall_s": np.maximum(latency - gpu_s, 0.0),
        "hbm_kv_bytes": work.step_hbm_kv_bytes,
        "ddr_kv_bytes": work.step_ddr_kv_bytes,
    })


def summarise(samples: pd.DataFrame) -> dict:
    """Samples run one after another: times and bytes add up, peaks are maxima, capacities the worst case."""
    if samples.empty:
        return {}
    row = samples.iloc[0].to_dict()
    row["sample_id"] = SUMMARY_SAMPLE_ID
    row["engine"] = ",".join(sorted(set(samples["engine"])))
    for column in SUM_COLUMNS:
        row[column] = samples[column].sum()
    for column in MAX_COLUMNS:
        row[column] = samples[column].max()
    for column in MIN_COLUMNS:
        values = samples[column].dropna()
        row[column] = int(values.min()) if len(values) else None
    for column in ("hbm_overflow", "ddr_overflow"):
        row[column] = bool(samples[column].any())
    decode_steps = row["steps"] - len(samples)
    total = row["total_s"]
    row["ms_per_token"] = 1e3 * row["decode_s"] / decode_steps if decode_steps else 1e3 * row["prefill_s"]
    row["tokens_per_s"] = row["batch"] * decode_steps / row["decode_s"] if row["decode_s"] > 0 else math.nan
    row["link_stall_frac"] = row["link_stall_s"] / total if total else 0.0
    for direction in ("h2d", "d2h"):  # busy-time weighted by each sample's duration
        busy = (samples[f"link_util_{direction}"] * samples["total_s"]).sum()
        row[f"link_util_{direction}"] = busy / total if total else 0.0
    for column in ("mass_lost_evicted", "mass_lost_not_recalled"):  # step-weighted mean over samples
        values = samples[column].dropna()
        weights = samples.loc[values.index, "steps"]
        row[column] = float((values * weights).sum() / weights.sum()) if len(values) else None
    return row
