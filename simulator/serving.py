"""Serving simulation: many requests share one GPU with continuous batching, HBM admission control and one
host link; each request replays a traced sample, so its per-step recall/offload pattern is real.

    result = simulate_serving("runs/hier30", "h100-pcie", ServingConfig(rate_per_s=2, duration_s=600))
    result.summary          # one row: throughput, TTFT/TBT percentiles, goodput, concurrency, link use, ...
    result.requests         # one row per request: arrival, admission, first token, finish, TBT stats
    result.timeline         # one row per batch iteration: time, running, waiting, HBM/DDR occupancy

The model (SimPy; the engine's hardware, engine.py, and cost model, costs.py):
- `arrivals`: requests arrive (Poisson at `rate_per_s` during `duration_s`, or the rows of an arrival CSV, see
  `load_arrivals_csv`) and wait in one FCFS admission queue. Each replays a traced sample: Poisson picks one
  uniformly (seeded), a CSV row the nearest in (prompt, output) length.
- `batch_loop` (holds the engine's GPU Resource per iteration): before every iteration it admits waiting
  requests in order while (a) fewer than `max_batch` run, (b) HBM holds weights + the reserved KV of every
  running request, where a request reserves its sample's peak HBM KV bytes (resident + recall buffers,
  summed over layers, at the policy's budget), and (c) DDR (or the offload tier) holds every request's peak
  offloaded KV. Reserving the peak means no request is ever preempted; the head of the queue blocks the rest
  (no overtaking). A request that cannot fit even alone is rejected (`n_rejected`).
  One iteration runs every running request's next traced step (the prefill for a new one) as the engine runs
  a step: operations = the layers, then the LM head. Before operation i the recalls of all requests that have
  one complete (a batched kernel needs all of them); operation i computes as one roofline over the batch:
  weights once + every request's own FLOPs and KV bytes (`costs.layer_flops_bytes` per request, summed,
  `costs.roofline`); after it, the offloads start on D2H (awaited only without async offload). With
  `layer-prefetch` the recalls of operation i+1 (after the LM head: of the next step's first layer) are
  issued when operation i starts computing. Every request then emits one token. Under a host model
  (costs.host_times: one host issues the batched step, whose ops do not grow with the batch) the iteration's
  GPU work starts `lead_s` after it begins and its tokens are out no sooner than `step_s` after it.
- The link: the engine's `Channel`s (H2D and D2H, or one shared channel when half duplex; a FIFO queue of
  copy engines, with one wire when there are several engines). Every request's copy is queued on them (each with the
  fixed per-copy overhead, as in the engine; `batch_copies` instead moves a batch's blocks of one operation
  in one copy, as a gather kernel would), so requests delay each other's recalls: `link_wait_s` is the time a request's copies spent beyond their uncontended
  duration. With one request (or n identical ones arriving together) the schedule is exactly the engine's
  single-sequence replay (or its lockstep `batch=n`); tests/test_serving.py checks both.
Metrics: TTFT = first token - arrival; TBT = time between a request's consecutive tokens; queueing delay =
admission - arrival; throughput = tokens / time of the last token; goodput counts requests whose mean TBT
<= `tbt_slo_s` (and TTFT <= `ttft_slo_s` if set); link utilisation = bytes / bandwidth / time; Little's law
L = lambda W on the admission queue (L integrated from the queue's trajectory, W from the requests).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from hwprofiles import HardwareProfile, load_profile
from hwprofiles.overhead_modes import apply_mode, mode_of
from simulator import costs
from simulator.engine import Hardware, Timeline
from simulator.errors import ServingError
from simulator.mechanisms import (
    DEFAULT_MECHANISM,
    LOAD_FIELDS,
    LayerLoad,
    batch_op_s,
    coalesced_copy_s,
    custom_layers,
    group_s,
    mechanism_for,
    needs_batch_op_s,
    offload_mechanism,
    sequence_load,
)
from simulator.mechanisms import build_workload as mechanism_workload
from simulator.mechanisms import context as transfer_context
from simulator.options import KEY_FIELDS, Projection, ServingConfig
from simulator.project import project_arrays
from simulator.recall_buffer import with_recall_buffer
from simulator.schedule import StepSchedule
from simulator.serving_fast import FastServing
from simulator.tiers import check_spill, serving_memory, tier_chain
from simulator.workload import step_arrays
from traces import open_run

__all__ = ["ServingConfig", "ServingError", "ServingResult", "simulate_serving"]


# ---------------------------------------------------------------- what one request costs ---------------------


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
    kv_read_bytes: np.ndarray  # [steps, layers] HBM bytes of this sequence's KV (weights excluded)
    recall_bytes: np.ndarray  # [steps, layers + 1] H2D copy before each operation
    recall_s: np.ndarray
    offload_bytes: np.ndarray  # [steps, layers + 1] D2H copy after each operation
    offload_s: np.ndarray
    hbm_kv_bytes: np.ndarray  # [steps] KV bytes in HBM at attention, all layers, incl. recall buffers
    ddr_kv_bytes: np.ndarray  # [steps] KV bytes in DDR
    load: LayerLoad | None = None  # [steps, layers] demand, for mechanisms that change the layers (zero-copy, ...)
    event_s: np.ndarray | None = None  # [steps, layers] placement / recall bookkeeping (costs.event_times)

    @property
    def n_steps(self) -> int:
        return len(self.hbm_kv_bytes)

    def truncated(self, n_steps: int) -> SampleWork:
        """The first n_steps steps (a request asking for fewer output tokens than the sample generated)."""
        n = max(1, min(n_steps, self.n_steps))
        load = None if self.load is None else LayerLoad(**{f: getattr(self.load, f)[:n] for f in LOAD_FIELDS})
        return SampleWork(self.sample_id, self.prompt_tokens, *(getattr(self, f)[:n] for f in (
            "flops", "kv_read_bytes", "recall_bytes", "recall_s", "offload_bytes", "offload_s", "hbm_kv_bytes",
            "ddr_kv_bytes")), load, None if self.event_s is None else self.event_s[:n])

    @property
    def peak_hbm_kv_bytes(self) -> float:
        return float(self.hbm_kv_bytes.max())

    @property
    def peak_ddr_kv_bytes(self) -> float:
        return float(self.ddr_kv_bytes.max())


def sample_work(steps: pd.DataFrame, sample: pd.Series, shape: costs.ModelShape,
                profile: HardwareProfile, tier: str = "ddr", transfer: str = DEFAULT_MECHANISM,
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
    query, attended = grid["query_tokens"], grid["hbm_tokens"] + grid["recalled_tokens"]
    n_steps, n_layers = query.shape
    flops, hbm_bytes = costs.layer_flops_bytes(shape, query, attended, batch=1)
    mechanism = mechanism_for(transfer, profile)
    # sync offload and no overlap: the copies' durations only; a serving iteration stretches ops itself
    work = mechanism_workload(mechanism, str(sample["sample_id"]), shape, profile, query, grid["hbm_tokens"],
                              grid["recalled_tokens"], grid["bytes_h2d"], grid["bytes_d2h"], grid["hbm_kv_bytes"],
                              grid["ddr_kv_bytes"], tier=tier, overlap="none", async_offload=False)
    load = sequence_load(mechanism, shape, query, grid["hbm_tokens"], grid["recalled_tokens"], grid["bytes_h2d"]) \
        if custom_layers(mechanism) else None
    ops = (n_steps, n_layers + 1)
    return SampleWork(
        sample_id=str(sample["sample_id"]), prompt_tokens=prompt_tokens,
        flops=flops, kv_read_bytes=hbm_bytes - shape.layer_weight_bytes,
        recall_bytes=work.recall_bytes.reshape(ops), recall_s=work.recall_s.reshape(ops),
        offload_bytes=work.offload_bytes.reshape(ops), offload_s=work.offload_s.reshape(ops),
        hbm_kv_bytes=work.step_hbm_kv_bytes, ddr_kv_bytes=work.step_ddr_kv_bytes, load=load,
        event_s=costs.event_times(shape, profile, grid.get("moved_blocks"), grid["bytes_h2d"],
                                  recalled_blocks=grid.get("recalled_blocks")),
    )


def load_run_work(run_dir: str | Path, profile: HardwareProfile, tier: str = "ddr",
                  transfer: str = DEFAULT_MECHANISM, projection: Projection | None = None,
                  lengths: str | None = None, seed: int = 0, recall_buffer_blocks: int | None = None
                  ) -> tuple[dict, costs.ModelShape, list[SampleWork]]:
    """The run's manifest, the shape its work is costed on and its samples as SampleWork, costed on `profile` as
    given (the caller picks the policy's overheads: simulate_serving): every committed sample, or with a length
    model (`lengths`, simulator/lengths.py) one work per length class, each a sample drawn with `seed`
    resampled to the class's (prompt, output) tokens. `projection` prices them on another architecture;
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
    if lengths is None:
        works = [sample_work(by_sample[row.sample_id], row, shape, profile, tier, transfer, projection, **buffer)
                 for _, row in samples.iterrows()]
    else:
        from simulator.lengths import length_model

        classes = length_model(lengths).classes()
        picks = np.random.default_rng([seed, 1]).integers(0, len(samples), size=len(classes))
        works = [sample_work(by_sample[samples.iloc[i]["sample_id"]], samples.iloc[i], shape, profile, tier, transfer,
                             projection, lengths=size, **buffer) for i, size in zip(picks, classes)]
    return run.manifest, (projection.shape if projection is not None else shape), works


# ---------------------------------------------------------------- arrivals -----------------------------------


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    sample: int  # index into the run's samples
    n_steps: int  # tokens this request generates (= traced steps replayed)


def poisson_arrivals(rate_per_s: float, duration_s: float, works: list[SampleWork], seed: int) -> list[Arrival]:
    """Exponential inter-arrival gaps at `rate_per_s` during [0, duration_s); each request replays a uniformly
    drawn sample in full."""
    rng = np.random.default_rng(seed)
    expected = rate_per_s * duration_s
    gaps = rng.exponential(1.0 / rate_per_s, size=int(expected + 10 * math.sqrt(expected) + 10))
    times = np.cumsum(gaps)
    times = times[times < duration_s]
    picks = rng.integers(0, len(works), size=len(times))
    return [Arrival(float(t), int(i), works[i].n_steps) for t, i in zip(times, picks)]


# Column names accepted for an arrival CSV: ours, and those of the Azure LLM inference traces released with
# Splitwise (Azure Public Dataset, AzureLLMInferenceTrace_2023/2024: TIMESTAMP,ContextTokens,GeneratedTokens).
CSV_COLUMNS = {
    "arrival_s": ("arrival_s", "TIMESTAMP", "timestamp"),
    "prompt_tokens": ("prompt_tokens", "ContextTokens", "input_tokens"),
    "output_tokens": ("output_tokens", "GeneratedTokens", "generated_tokens"),
}


def load_arrivals_csv(path: str | Path, works: list[SampleWork]) -> list[Arrival]:
    """Arrivals from a CSV: arrival time (seconds, or timestamps as in the Azure trace; shifted to start at 0),
    prompt tokens and output tokens per request.

    Each request replays the traced sample closest to it (|prompt - P| + |output - O| smallest), truncated to
    its output tokens; a request asking for more tokens than any sample generated replays the whole sample
    (its `n_steps` says how many tokens were simulated).
    """
    path = Path(path)
    if not path.is_file():
        raise ServingError(f"arrival file {path} not found; pass an existing CSV")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise ServingError(f"{path}: empty; write a header arrival_s,prompt_tokens,output_tokens and one row per "
                           "request") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ServingError(f"{path}: not a readable CSV ({str(exc).splitlines()[0][:120]}); fix the file") from None
    picked = {}
    for ours, names in CSV_COLUMNS.items():
        found = [n for n in names if n in frame.columns]
        if not found:
            raise ServingError(f"{path}: no column for {ours} (one of {', '.join(names)}); add it")
        picked[ours] = frame[found[0]]
    if frame.empty:
        raise ServingError(f"{path}: a header but no requests; add one row per request")
    times = picked["arrival_s"]
    if not pd.api.types.is_numeric_dtype(times):
        try:
            # "mixed": each timestamp parsed on its own (what pandas falls back to, without its warning)
            times = pd.to_datetime(times, errors="raise", format="mixed")
        except (ValueError, TypeError):
            raise ServingError(f"{path}: arrival times must be seconds or timestamps like 2023-11-16 "
                               "18:15:46.68; fix the column") from None
        if times.isna().any():
            raise ServingError(f"{path}: row {int(times.isna().to_numpy().argmax()) + 2} has no arrival time; "
                               "fill it in")
        times = (times - times.min()).dt.total_seconds()
    times = _numbers(path, times, "arrival time (seconds)", whole=False)
    prompt = _numbers(path, picked["prompt_tokens"], "prompt tokens", whole=True)
    output = _numbers(path, picked["output_tokens"], "output tokens", whole=True)
    for values, name, low in ((prompt, "prompt tokens", 0), (output, "output tokens", 1)):
        if (values < low).any():
            row = int(np.argmax(values < low)) + 2  # line in the file: 1-based, after the header
            raise ServingError(f"{path}: line {row}: {name} {int(values[row - 2])} must be >= {low}; fix the row")
    times = times - times.min()
    prompt, output = prompt.astype(np.int64), output.astype(np.int64)
    lengths = np.array([[w.prompt_tokens, w.n_steps] for w in works], dtype=np.int64)
    order = np.argsort(times, kind="stable")
    arrivals = []
    for i in order:
        distance = np.abs(lengths[:, 0] - prompt[i]) + np.abs(lengths[:, 1] - output[i])
        sample = int(np.argmin(distance))
        arrivals.append(Arrival(float(times[i]), sample, int(min(output[i], works[sample].n_steps))))
    return arrivals


def _numbers(path: Path, column: pd.Series, what: str, whole: bool) -> np.ndarray:
    """A CSV column as finite float64 numbers (whole ones if `whole`); the first bad cell -> one line."""
    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if whole:  # and within what int64 and a sample length can mean
        bad |= (values != np.round(values)) | (np.abs(values) > 2**53)
    if bad.any():
        row = int(np.argmax(bad))
        raise ServingError(f"{path}: line {row + 2}: {what} {column.iloc[row]!r} is not a finite "
                           f"{'whole number' if whole else 'number'}; fix the cell")
    return values


# ---------------------------------------------------------------- the simulation -----------------------------


@dataclass
class Request:
    rid: int
    arrival_s: float
    work: SampleWork
    admitted_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    step: int = 0  # next traced step to run
    spilled: bool = False  # its offloaded KV lives in the spill tier (--offload-tier ddr+TIER: DDR was full)
    last_token_s: float = math.nan
    link_wait_s: float = 0.0  # time its transfers spent queued for a copy engine
    tbt_s: list[float] = field(default_factory=list)
    rejected: bool = False


def requests_for(arrivals: list[Arrival], works: list[SampleWork]) -> list[Request]:
    """One Request per arrival, replaying its sample for its tokens (the DES and the fast path alike)."""
    return [Request(i, a.arrival_s, works[a.sample].truncated(a.n_steps)) for i, a in enumerate(arrivals)]


@dataclass
class ServingResult:
    summary: dict
    requests: pd.DataFrame
    timeline: pd.DataFrame
    tbt_s: np.ndarray  # every time-between-tokens interval of every request


class ServingSim:
    """The SimPy model: an arrival process, the batch loop (GPU) and copies on the engine's link channels."""

    def __init__(self, profile: HardwareProfile, shape: costs.ModelShape, works: list[SampleWork],
                 arrivals: list[Arrival], config: ServingConfig, timeline: Timeline | None = None,
                 spill_works: list[SampleWork] | None = None):
        self.profile, self.shape, self.config = profile, shape, config
        self.env = simpy.Environment()
        self.hw = Hardware(self.env, profile, timeline)  # the engine's GPU and link channels
        self.timeline = timeline
        memory = serving_memory(profile, shape, config.options.offload_tier)  # simulator/tiers.py, shared
        self.kv_capacity_bytes, self.chain, self.tier = memory.kv_capacity_bytes, memory.chain, memory.tier
        self.ddr_capacity_bytes, self.spill_capacity_bytes = memory.ddr_capacity_bytes, memory.spill_capacity_bytes
        self.spill_works = spill_works  # the samples costed on the spill tier
        self.sample_of = [a.sample for a in arrivals]
        self.reserved_spill_bytes = 0.0
        self.works = works
        self.requests = requests_for(arrivals, works)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved_hbm_bytes = 0.0
        self.reserved_ddr_bytes = 0.0
        self.all_arrived = False
        self.wakeup = self.env.event()
        self.queue_changes: list[tuple[float, int]] = [(0.0, 0)]  # (time, requests waiting) at every change
        self.occupancy: list[tuple] = []  # one row per iteration (the `timeline` table of summarise)
        # --transfer (simulator/mechanisms.py): the copies' cost, whether a group shares one copy, the layers' time
        self.mechanism = mechanism_for(config.options.transfer, profile)
        self.transfer = transfer_context(profile, shape, self.chain.primary)
        ctx, mechanism = self.transfer, self.mechanism
        coalesce = (lambda direction, n_bytes: coalesced_copy_s(mechanism, ctx, direction, n_bytes)) \
            if config.batch_copies or mechanism.batched else None
        self.coalesce = coalesce
        check_spill(self.chain, mechanism, coalesce is not None, self.hw.h2d.n_engines)
        # The engine's schedule; `pending` keeps each request's prefetched recall (layer-prefetch) across iterations.
        self.schedule = StepSchedule(self.env, self.hw, config.options.overlap == "layer-prefetch",
                                     config.options.async_offload, mechanism.copy_overhead_s(ctx, "h2d"),
                                     offload_mechanism(mechanism).copy_overhead_s(ctx, "d2h"), coalesce,
                                     _add_link_wait)
        self.host = costs.host_times(shape, profile)  # the host's lead and whole-iteration time (host model)
        self.iterations = 0
        self.tokens = 0  # emitted so far (progress)
        self.env.process(self.arrivals())
        self.done = self.env.process(self.batch_loop())

    # -- arrivals and admission ---------------------------------------------------------------------------

    def arrivals(self):
        for i, request in enumerate(self.requests):
            yield self.env.timeout(request.arrival_s - self.env.now)
            if not self.fits_alone(request):
                request.rejected = True
            else:
                self.waiting.append(request)
                self._queue_changed()
            burst_goes_on = i + 1 < len(self.requests) and self.requests[i + 1].arrival_s == request.arrival_s
            if not burst_goes_on and not self.wakeup.triggered:  # a burst is admitted together
                self.wakeup.succeed()
        self.all_arrived = True
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def fits_alone(self, request: Request) -> bool:
        return request.work.peak_hbm_kv_bytes <= self.kv_capacity_bytes and \
            (request.work.peak_ddr_kv_bytes <= self.ddr_capacity_bytes
             or request.work.peak_ddr_kv_bytes <= self.spill_capacity_bytes)

    def _queue_changed(self) -> None:
        self.queue_changes.append((self.env.now, len(self.waiting)))

    def admit(self) -> None:
        """FCFS while the batch has room and the head's peak KV fits in what HBM and DDR have left."""
        while self.waiting and len(self.running) < self.config.max_batch:
            head = self.waiting[0]
            offloaded = head.work.peak_ddr_kv_bytes
            in_ddr = self.reserved_ddr_bytes + offloaded <= self.ddr_capacity_bytes
            in_spill = self.reserved_spill_bytes + offloaded <= self.spill_capacity_bytes  # DDR full -> spill
            if self.reserved_hbm_bytes + head.work.peak_hbm_kv_bytes > self.kv_capacity_bytes or \
                    not (in_ddr or in_spill):
                return
            self.waiting.popleft()
            self._queue_changed()
            head.admitted_s = self.env.now
            self.reserved_hbm_bytes += head.work.peak_hbm_kv_bytes
            if in_ddr:
                self.reserved_ddr_bytes += offloaded
            else:  # its copies now cost what the spill tier costs
                head.spilled = True
                head.work = self.spill_works[self.sample_of[head.rid]].truncated(head.work.n_steps)
                self.reserved_spill_bytes += offloaded
            self.running.append(head)

    # -- the GPU ------------------------------------------------------------------------------------------

    def batch_loop(self):
        while True:
            self.admit()
            if not self.running:
                if self.all_arrived and not self.waiting:
                    return
                self.wakeup = self.env.event()
                yield self.wakeup
                continue
            self._record_occupancy()
            start_s = self.env.now
            with self.hw.gpu.request() as gpu:
                yield gpu
                host_start_s = self.env.now  # the host issues one batched step: its ops do not grow with the batch
                if self.host.lead_s:
                    yield self.env.timeout(self.host.lead_s)
                yield from self.iteration(self.running)
                if self.host.step_s and self.env.now < host_start_s + self.host.step_s:
                    yield self.env.timeout(host_start_s + self.host.step_s - self.env.now)
            if self.timeline is not None:
                self.timeline.span("GPU", f"iteration {self.iterations}", start_s, self.env.now,
                                   sequences=len(self.running))
            self.iterations += 1
            self._emit_tokens()

    def iteration(self, batch: list[Request]):
        """One decode iteration: every running request's next traced step, operation by operation (layers,
        then the LM head), on the engine's schedule (schedule.StepSchedule: recall -> compute -> offload).
        Operation i computes as one roofline over the batch (weights once, every request's own FLOPs and KV)."""
        rows = [(r.work, r.step) for r in batch]
        flops = np.sum([w.flops[s] for w, s in rows], axis=0)
        kv_bytes = np.sum([w.kv_read_bytes[s] for w, s in rows], axis=0)
        layer_s = costs.roofline(flops, self.shape.layer_weight_bytes + kv_bytes, self.profile,
                                 costs.layer_overhead_s(self.shape, self.profile, kv_bytes)).total_s
        op_s = [*layer_s.tolist(), float(costs.head_times(self.shape, self.profile, batch=len(batch)).total_s)]
        recall_s = np.array([w.recall_s[s] for w, s in rows])  # [batch, ops]
        recall_bytes = np.array([w.recall_bytes[s] for w, s in rows])
        following_s = following_bytes = None
        if self.schedule.prefetch:  # after the last operation comes the next step's first, for requests that go on
            nxt = [(w.recall_s[s + 1, 0], w.recall_bytes[s + 1, 0]) if s + 1 < w.n_steps else (0.0, 0.0)
                   for w, s in rows]
            following_s = np.column_stack([recall_s[:, 1:], [t for t, _ in nxt]])
            following_bytes = np.column_stack([recall_bytes[:, 1:], [b for _, b in nxt]])
        offload_s = np.array([w.offload_s[s] for w, s in rows])
        offload_bytes = np.array([w.offload_bytes[s] for w, s in rows])
        if needs_batch_op_s(self.mechanism):  # zero-copy / cpu-attention layers, sm-copy's stretch
            op_s = self.mechanism_op_s(rows, offload_s, offload_bytes, following_s, following_bytes)
        if any(w.event_s is not None for w, _ in rows):  # each sequence's placement / recall bookkeeping
            events = np.sum([w.event_s[s] for w, s in rows if w.event_s is not None], axis=0)
            op_s = costs.add_layer_events(op_s, events)
        yield from self.schedule.run(
            op_s, recall_s, recall_bytes, offload_s, offload_bytes, batch, [r.rid for r in batch], following_s,
            following_bytes, n_layers=self.shape.n_layers)

    def mechanism_op_s(self, rows, offload_s, offload_bytes, following_s, following_bytes) -> list[float]:
        """The iteration's operation times under a mechanism that changes them (mechanisms.batch_op_s): the
        batch's summed demand, and the channel time of the copies beside each operation."""
        if custom_layers(self.mechanism):
            load = LayerLoad(**{f: np.sum([getattr(w.load, f)[s] for w, s in rows], axis=0) if f != "has_host_work"
                                else np.any([w.load.has_host_work[s] for w, s in rows], axis=0) for f in LOAD_FIELDS})
        else:
            load = LayerLoad(np.sum([w.flops[s] for w, s in rows], axis=0), np.sum([w.kv_read_bytes[s] for w, s in rows],
                                                                                 axis=0), *([0.0] * 6))
        coalesce = self.coalesce
        offload_group = group_s(offload_s, offload_bytes, coalesce and (lambda b: coalesce("d2h", b)))
        following_group = None if following_s is None else \
            group_s(following_s, following_bytes, coalesce and (lambda b: coalesce("h2d", b)))
        return batch_op_s(self.mechanism, self.transfer, load, len(rows), offload_group, following_group,
                          self.config.options.async_offload)

    def _emit_tokens(self) -> None:
        now = self.env.now
        self.tokens += len(self.running)
        still_running = []
        for r in self.running:
            if r.step == 0:
                r.first_token_s = now
            else:
                r.tbt_s.append(now - r.last_token_s)
            r.last_token_s = now
            r.step += 1
            if r.step >= r.work.n_steps:
                r.finish_s = now
                self.reserved_hbm_bytes -= r.work.peak_hbm_kv_bytes
                if r.spilled:
                    self.reserved_spill_bytes -= r.work.peak_ddr_kv_bytes
                else:
                    self.reserved_ddr_bytes -= r.work.peak_ddr_kv_bytes
            else:
                still_running.append(r)
        self.running = still_running

    def _record_occupancy(self) -> None:
        hbm_kv = sum(r.work.hbm_kv_bytes[r.step] for r in self.running)
        ddr_kv = sum(r.work.ddr_kv_bytes[r.step] for r in self.running)
        self.occupancy.append((self.env.now, len(self.running), len(self.waiting),
                             self.shape.weight_bytes + hbm_kv, self.shape.weight_bytes + self.reserved_hbm_bytes,
                             ddr_kv, self.reserved_ddr_bytes))

    def run(self, progress: bool = False) -> None:
        if progress:  # tokens generated so far, checked every simulated second
            from tqdm import tqdm

            total = sum(r.work.n_steps for r in self.requests if self.fits_alone(r))
            with tqdm(total=total, unit="tok", unit_scale=True, desc=f"serving on {self.profile.name}") as bar:
                while not self.done.triggered:
                    self.env.run(until=self.env.any_of([self.done, self.env.timeout(1.0)]))
                    bar.update(self.tokens - bar.n)
        self.env.run(until=self.done)
        self.end_s = float(self.env.now)  # the last token (or 0 when nothing ran)
        self.env.run()  # drain the offload backlog (it occupies the link, not the requests)


def _add_link_wait(request: Request, seconds: float) -> None:
    """A copy of `request` spent `seconds` queued beyond its own duration (requests delay each other's copies)."""
    request.link_wait_s += seconds


# ---------------------------------------------------------------- metrics ------------------------------------


def _percentiles(values, prefix: str) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {f"{prefix}_p{q}_s": math.nan for q in (50, 90, 99)} | {f"{prefix}_mean_s": math.nan}
    return {f"{prefix}_p{q}_s": float(np.percentile(values, q)) for q in (50, 90, 99)} | \
        {f"{prefix}_mean_s": float(values.mean())}


def time_average(changes: list[tuple[float, int]], end_s: float) -> float:
    """Time-average of a step function given as (time, value) at every change, over [0, end_s]."""
    if end_s <= 0:
        return 0.0
    times = np.array([t for t, _ in changes] + [end_s])
    values = np.array([v for _, v in changes], dtype=np.float64)
    return float(np.sum(values * np.diff(times)) / end_s)


def summarise(sim: ServingSim, manifest: dict, run_dir: str, overhead_source: str = "") -> ServingResult:
    config, profile = sim.config, sim.profile
    requests = pd.DataFrame([{
        "request": r.rid, "sample_id": r.work.sample_id, "prompt_tokens": r.work.prompt_tokens,
        "tokens": r.work.n_steps, "rejected": r.rejected, "arrival_s": r.arrival_s, "admitted_s": r.admitted_s,
        "first_token_s": r.first_token_s, "finish_s": r.finish_s,
        "queue_delay_s": r.admitted_s - r.arrival_s, "ttft_s": r.first_token_s - r.arrival_s,
        "tbt_mean_s": float(np.mean(r.tbt_s)) if len(r.tbt_s) else math.nan,
        "tbt_max_s": float(np.max(r.tbt_s)) if len(r.tbt_s) else math.nan, "link_wait_s": r.link_wait_s,
        "peak_hbm_kv_bytes": r.work.peak_hbm_kv_bytes, "peak_ddr_kv_bytes": r.work.peak_ddr_kv_bytes,
        "spilled": r.spilled,
    } for r in sim.requests])
    timeline = pd.DataFrame(sim.occupancy, columns=["time_s", "running", "waiting", "hbm_bytes",
                                                   "hbm_reserved_bytes", "ddr_bytes", "ddr_reserved_bytes"])
    served = requests[~requests["rejected"]] if len(requests) else requests
    # (tbt_s may be a list or an array: serving_fast keeps each request's as an array)
    tbt = np.concatenate([np.asarray(r.tbt_s, dtype=np.float64) for r in sim.requests]) if sim.requests \
        else np.zeros(0)
    # The tokens' times (each request's first token + its TBTs), for the TBT of the arrival window's last third:
    # a rate the server cannot sustain shows there first (its batch or queue grows through the window).
    token_s = np.concatenate([r.first_token_s + np.cumsum(np.asarray(r.tbt_s, dtype=np.float64))
                              for r in sim.requests]) if sim.requests else np.zeros(0)
    arrivals_end_s = max((r.arrival_s for r in sim.requests), default=0.0)
    late = tbt[(token_s >= 2 * arrivals_end_s / 3) & (token_s <= arrivals_end_s)]
    end_s = sim.end_s
    tokens = int(served["tokens"].sum()) if len(served) else 0
    good = served["tbt_mean_s"].fillna(0.0) <= config.tbt_slo_s if len(served) else pd.Series([], dtype=bool)
    if config.ttft_slo_s is not None and len(served):
        good &= served["ttft_s"] <= config.ttft_slo_s
    # Little's law on the admission queue: time-average queue length vs arrival rate x mean wait.
    queue_length = time_average(sim.queue_changes, end_s)
    arrival_rate = len(served) / end_s if end_s > 0 else 0.0
    mean_wait = float(served["queue_delay_s"].mean()) if len(served) else 0.0
    policy = manifest["policy"]
    reserved_per_request = float(np.mean([w.peak_hbm_kv_bytes for w in sim.works]))
    projection = config.projection
    summary = {
        "run_dir": str(run_dir), "model": sim.shape.name, "policy": policy["name"],
        # what the requests are: the traced samples, or projected to another model's shapes / a length model
        "result_kind": "projected" if projection.active or config.lengths else "traced",
        "as_model": projection.as_model, "as_dtype": projection.as_dtype if projection.active else None,
        "context_scale": projection.context_scale, "recalls": projection.recalls, "lengths": config.lengths,
        "hbm_budget": policy.get("hbm_budget"), "profile": profile.name,
        **{name: getattr(config.options, name) for name in KEY_FIELDS}, "overhead_source": overhead_source,
        "overhead_mode": mode_of(profile), "host_term": profile.host_model.term,  # what was charged, resolved
        "host_s_per_iteration": sim.host.step_s,
        "batch_copies": config.batch_copies, "rate_per_s": config.rate_per_s if not config.arrivals_csv else math.nan, "duration_s": config.duration_s, "max_batch": config.max_batch, "seed": config.seed,
        "tbt_slo_s": config.tbt_slo_s, "ttft_slo_s": config.ttft_slo_s, "n_requests": len(requests), "n_rejected": int(requests["rejected"].sum())
        if len(requests) else 0, "n_completed": int(served["finish_s"].notna().sum()) if len(served) else 0,
        "end_s": end_s, "tokens": tokens, "throughput_tokens_per_s": tokens / end_s if end_s > 0 else math.nan,
        **_percentiles(served.get("ttft_s", []), "ttft"), **_percentiles(tbt, "tbt"),
        "tbt_p99_late_s": float(np.percentile(late, 99)) if late.size else math.nan,
        **_percentiles(served.get("queue_delay_s", []), "queue_delay"),
        "link_wait_mean_s": float(served["link_wait_s"].mean()) if len(served) else math.nan,
        "max_concurrency": int(timeline["running"].max()) if len(timeline) else 0,
        "mean_concurrency": time_average(list(zip(timeline["time_s"], timeline["running"])), end_s)
        if len(timeline) else 0.0,
        # How many requests of this run fit at once by HBM alone (mean reservation), whatever the load was.
        "kv_reserved_bytes_per_request": reserved_per_request,
        "hbm_capacity_requests": int(sim.kv_capacity_bytes // reserved_per_request) if reserved_per_request > 0
        else None,
        "kv_capacity_bytes": sim.kv_capacity_bytes, "hbm_capacity_bytes": profile.gpu.hbm_capacity_bytes,
        "peak_hbm_bytes": float(timeline["hbm_bytes"].max()) if len(timeline) else float(sim.shape.weight_bytes),
        "peak_hbm_reserved_bytes": float(timeline["hbm_reserved_bytes"].max()) if len(timeline) else math.nan,
        # time averages over the run (weights included): how full HBM was, not only at its fullest
        **{f"mean_{name}": time_average(list(zip(timeline["time_s"], timeline[name])), end_s) if len(timeline)
           else math.nan for name in ("hbm_bytes", "hbm_reserved_bytes")},
        "ddr_capacity_bytes": sim.ddr_capacity_bytes,
        "spill_tier": sim.chain.spill, "spill_capacity_bytes": sim.spill_capacity_bytes,
        "n_spilled": int(sum(r.spilled for r in sim.requests)),
        "peak_ddr_bytes": float(timeline["ddr_bytes"].max()) if len(timeline) else 0.0,
        # Share of the link's bandwidth used while requests were served (bytes / bandwidth / time).
        "bytes_h2d": sim.hw.h2d.bytes["h2d"], "bytes_d2h": sim.hw.d2h.bytes["d2h"],
        "link_util_h2d": sim.hw.h2d.bytes["h2d"] / sim.tier.h2d_bytes_per_s / end_s if end_s > 0 else 0.0,
        "link_util_d2h": sim.hw.d2h.bytes["d2h"] / sim.tier.d2h_bytes_per_s / end_s if end_s > 0 else 0.0,
        "goodput_requests_per_s": float(good.sum()) / end_s if end_s > 0 else math.nan,
        "goodput_tokens_per_s": float(served.loc[good, "tokens"].sum()) / end_s if end_s > 0 else math.nan,
        "slo_attainment": float(good.mean()) if len(served) else math.nan,
        "littles_queue_length": queue_length, "littles_arrival_rate_per_s": arrival_rate,
        "littles_mean_wait_s": mean_wait,
        "littles_rel_err": abs(queue_length - arrival_rate * mean_wait) / (arrival_rate * mean_wait)
        if arrival_rate * mean_wait > 0 else 0.0,
    }
    return ServingResult(summary=summary, requests=requests, timeline=timeline, tbt_s=tbt)


def simulate_serving(run_dir: str | Path, profile: str | HardwareProfile, config: ServingConfig,
                     timeline: Timeline | None = None, progress: bool = False) -> ServingResult:
    """Serve Poisson (or CSV) arrivals replaying the run's samples on one GPU of `profile`; `timeline` (the
    engine's Chrome-trace recorder) gets one span per iteration and per copy."""
    from simulator.simulate import check_prefetch
    from simulator.whatif import traced_config

    if not isinstance(profile, HardwareProfile):
        profile = load_profile(profile)
    run = open_run(run_dir)
    chain = tier_chain(profile, config.options.offload_tier)  # an unknown tier fails before any work
    if config.options.overlap == "layer-prefetch":  # the same validity rule as simulate_run's
        check_prefetch(run, traced_config(run.manifest["policy"]), projected=False)
    # The overhead mode and host term, then the same per-policy overheads simulate_run charges (calibrated
    # profiles measure each decode path).
    profile = apply_mode(profile, config.options.overhead_mode, config.options.host_term)
    profile, overhead_source = costs.profile_for_policy(profile, run.manifest["policy"]["name"])
    work_of = dict(projection=config.projection, lengths=config.lengths, seed=config.seed,  # --as-model, --lengths
                   recall_buffer_blocks=config.options.recall_buffer_blocks)
    manifest, shape, works = load_run_work(run_dir, profile, chain.primary, config.options.transfer, **work_of)
    spill_works = load_run_work(run_dir, profile, chain.spill, config.options.transfer, **work_of)[2] \
        if chain.spill else None
    if config.arrivals_csv:
        arrivals = load_arrivals_csv(config.arrivals_csv, works)
    else:
        arrivals = poisson_arrivals(config.rate_per_s, config.duration_s, works, config.seed)
    engine = config.options.engine  # auto: the fast path (serving_fast, equal to this DES) unless a timeline
    if engine == "fast" and timeline is not None:
        raise ServingError("--timeline records the DES; drop --engine fast")
    if engine == "des" or timeline is not None:
        sim = ServingSim(profile, shape, works, arrivals, config, timeline, spill_works)
        sim.run(progress)
    else:
        sim = FastServing(profile, shape, works, arrivals, config, requests_for(arrivals, works), spill_works)
        sim.run()
    return summarise(sim, manifest, str(run_dir), overhead_source)
