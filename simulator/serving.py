"""Serving simulation: many requests share one GPU with continuous batching, HBM admission control and one
host link; each request replays a traced sample, so its per-step recall/offload pattern is real.

    result = simulate_serving("runs/hier30", "h100-pcie", ServingConfig(rate_per_s=2, duration_s=600))
    result.summary          # one row: throughput, TTFT/TBT percentiles, goodput, concurrency, link use, ...
    result.requests         # one row per request: arrival, admission, first token, finish, TBT stats
    result.timeline         # one row per batch iteration: time, running, waiting, HBM/DDR occupancy

The model (SimPy; the engine's hardware, engine.py, and cost model, costs.py):
- `arrivals`: requests arrive (Poisson at `rate_per_s` during `duration_s`, or the rows of an arrival CSV, see
  `lengths.read_arrivals_csv`) and wait in one FCFS admission queue. Each replays a traced sample: Poisson picks
  one uniformly (seeded); a CSV row the nearest in (prompt, output) length, resampled to the row's own lengths
  (simulator/lengths.py, as `--lengths` resamples its classes).
- `batch_loop` (holds the engine's GPU Resource per iteration): before every iteration the scheduler
  (admission.Scheduler, shared with the fast path) picks what runs, vLLM V1's way: the running requests first (a
  decode takes 1 token of the iteration's budget `max_batched_tokens`, a prefill the rest of its prompt up to what
  the budget leaves: chunked prefill), then, if nobody was preempted, the FCFS queue (no overtaking) while fewer
  than `max_batch` run and the head's KV blocks fit. `--admission paged` (default) holds each request's KV of its
  current step (the trace's HBM bytes, recall buffers included) and preempts the most recently admitted request
  when an iteration's blocks do not fit (`--preempt recompute`: prefilled again later; `swap`: its blocks copied
  to DDR and back on the link); `peak` reserves each request's peak KV at admission and never preempts. A request's
  offloaded KV reserves its peak in DDR (or the spill tier) from its first admission. A request that cannot fit even
  alone is rejected (`n_rejected`).
  One iteration runs every scheduled request's step (a decode's traced step, a prefill chunk) as the engine runs
  a step: operations = the layers, then the LM head. Before operation i the recalls of all requests that have
  one complete (a batched kernel needs all of them); operation i's kernels run one after another, each at its
  roofline (`costs.kernel_times`): the GEMMs over every token of the iteration (weights once), the decodes'
  attention, the prefill chunks' attention, the small kernels; after it, the offloads start on D2H (awaited only
  without async offload). A prefill's traced copies run with its last chunk. With
  `layer-prefetch` the recalls of operation i+1 (after the LM head: of the next step's first layer) are
  issued when operation i starts computing. Every request that finished its step emits one token. Under a host
  model (costs.host_times: one host issues the batched step, whose ops do not grow with the batch) the iteration's
  GPU work starts `lead_s` after it begins (and after its swap copies) and its tokens are out no sooner than
  `step_s` after it.
- The link: the engine's `Channel`s (H2D and D2H, or one shared channel when half duplex; a FIFO queue of
  copy engines, with one wire when there are several engines). Every request's copy is queued on them (each with the
  fixed per-copy overhead, as in the engine; `batch_copies` instead moves a batch's blocks of one operation
  in one copy, as a gather kernel would), so requests delay each other's recalls: `link_wait_s` is the time a request's copies spent beyond their uncontended
  duration. With one request (or n identical ones arriving together, under either admission) the schedule is
  exactly the engine's single-sequence replay (or its lockstep `batch=n`); tests/test_serving.py and
  tests/test_serving_paged.py check it.
Metrics: TTFT = first token - arrival; TBT = time between a request's consecutive tokens; queueing delay =
admission - arrival; throughput = tokens / time of the last token; goodput counts requests whose mean TBT
<= `tbt_slo_s` (and TTFT <= `ttft_slo_s` if set); link utilisation = bytes / bandwidth / time; Little's law
L = lambda W on the admission queue (L integrated from the queue's trajectory, W from the requests' waits, after
preemptions too); preemptions, recomputed tokens and swapped bytes; the GPU's busy share (`gpu_util`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from hwprofiles import HardwareProfile, load_profile
from hwprofiles.overhead_modes import apply_mode, mode_of
from simulator import costs
from simulator.admission import SPILL, iteration_layer_s, prefill_demand, record_requests, scheduler_for
from simulator.engine import Hardware, Timeline
from simulator.errors import ServingError
from simulator.lengths import RequestTrace, csv_classes, read_arrivals_csv
from simulator.mechanisms import (
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
from simulator.mechanisms import context as transfer_context
from simulator.options import KEY_FIELDS, ServingConfig
from simulator.schedule import StepSchedule
from simulator.serving_fast import FastServing
from simulator.serving_work import SampleWork, load_run_work, sample_work
from simulator.tiers import check_spill, serving_memory, tier_chain
from traces import open_run

__all__ = ["SampleWork", "ServingConfig", "ServingError", "ServingResult", "load_run_work", "sample_work",
           "simulate_serving"]


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


def csv_arrivals(requests: RequestTrace, request_class: np.ndarray) -> list[Arrival]:
    """An arrival CSV's requests (lengths.read_arrivals_csv), each replaying its work (lengths.csv_classes: the
    nearest sample resampled to the row's lengths) for its output tokens."""
    return [Arrival(float(t), int(c), int(o))
            for t, c, o in zip(requests.arrival_s, request_class, requests.output_tokens)]


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
    preemptions: int = 0  # times it was preempted (--admission paged)
    recomputed_tokens: int = 0  # KV tokens it lost to recompute preemptions and prefilled again
    swapped_bytes: float = 0.0  # HBM bytes it swapped out to DDR (and back)
    wait_s: float = 0.0  # all its time in the admission queue (after preemptions too)


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
    """The SimPy model: an arrival process, the batch loop (GPU) and copies on the engine's link channels. Which
    requests an iteration runs is admission.Scheduler's (shared with the fast path); this runs them."""

    def __init__(self, profile: HardwareProfile, shape: costs.ModelShape, works: list[SampleWork],
                 arrivals: list[Arrival], config: ServingConfig, timeline: Timeline | None = None,
                 spill_works: list[SampleWork] | None = None, block_tokens: int = 16):
        self.profile, self.shape, self.config = profile, shape, config
        self.env = simpy.Environment()
        self.hw = Hardware(self.env, profile, timeline)  # the engine's GPU and link channels
        self.timeline = timeline
        memory = serving_memory(profile, shape, config.options.offload_tier)  # simulator/tiers.py, shared
        self.kv_capacity_bytes, self.chain, self.tier = memory.kv_capacity_bytes, memory.chain, memory.tier
        self.ddr_capacity_bytes, self.spill_capacity_bytes = memory.ddr_capacity_bytes, memory.spill_capacity_bytes
        self.spill_works = spill_works  # the samples costed on the spill tier
        self.sample_of = [a.sample for a in arrivals]
        self.works = works
        self.requests = requests_for(arrivals, works)
        self.scheduler = scheduler_for(config, profile, works, self.requests, self.sample_of, memory, block_tokens)
        self.queue_changes = self.scheduler.queue_changes  # (time, requests waiting) at every change
        self.all_arrived = False
        self.wakeup = self.env.event()
        self.occupancy: list[tuple] = []  # one row per iteration (the `timeline` table of summarise)
        # --transfer (simulator/mechanisms.py): the copies' cost, whether a group shares one copy, the layers' time
        self.mechanism = mechanism_for(config.options.transfer, profile)
        self.transfer = transfer_context(profile, shape, self.chain.primary)
        self.spill_transfer = transfer_context(profile, shape, self.chain.spill) if self.chain.spill else None
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
        self.iteration_end: list[float] = []
        self.gpu_busy_s = 0.0  # the iterations' kernel time (their operations), for the GPU's utilisation
        self.iteration_s = 0.0  # the iterations' whole time (kernels, copies waited for, the host)
        self.tokens = 0  # emitted so far (progress)
        self.env.process(self.arrivals())
        self.done = self.env.process(self.batch_loop())

    # -- arrivals -------------------------------------------------------------------------------------------

    def arrivals(self):
        for i, request in enumerate(self.requests):
            yield self.env.timeout(request.arrival_s - self.env.now)
            if not self.fits_alone(request):
                request.rejected = True
            else:
                self.scheduler.arrive(request.rid, self.env.now)
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

    # -- the GPU ------------------------------------------------------------------------------------------

    def batch_loop(self):
        scheduler = self.scheduler
        while True:
            plan = scheduler.plan(self.env.now, self.iterations)
            for rid in plan.preempted:  # a prefetched recall of a preempted request is not waited for again
                self.schedule.pending.pop(rid, None)
            if not len(plan):
                if len(scheduler.running) or plan.swap_out:
                    raise ServingError("internal: an iteration with nothing to run; please report this")
                if self.all_arrived and not scheduler.waiting:
                    return
                if self.all_arrived:
                    raise ServingError("internal: the queue's head can never be admitted; please report this")
                self.wakeup = self.env.event()
                yield self.wakeup
                continue
            for rid in plan.admitted:  # its copies now cost what the spill tier costs
                if scheduler.tier[rid] == SPILL:
                    request = self.requests[rid]
                    request.spilled = True
                    request.work = self.spill_works[self.sample_of[rid]].truncated(request.work.n_steps)
            self._record_occupancy(plan)
            start_s = self.env.now
            with self.hw.gpu.request() as gpu:
                yield gpu
                host_start_s = self.env.now  # the host issues one batched step: its ops do not grow with the batch
                swaps = self.swap_copies(plan)
                if self.host.lead_s:
                    yield self.env.timeout(self.host.lead_s)
                if swaps:  # the forward pass waits for its swaps (as vLLM's swap-in / swap-out before it)
                    t = yield from self.schedule._wait(self.env.now, swaps)
                    if t > self.env.now:
                        yield self.env.timeout(t - self.env.now)
                yield from self.iteration(plan)
                if self.host.step_s and self.env.now < host_start_s + self.host.step_s:
                    yield self.env.timeout(host_start_s + self.host.step_s - self.env.now)
            if self.timeline is not None:
                self.timeline.span("GPU", f"iteration {self.iterations}", start_s, self.env.now,
                                   sequences=len(plan))
            self.iteration_end.append(self.env.now)
            self.iteration_s += self.env.now - start_s
            scheduler.finish(plan, self.iterations)
            self.iterations += 1
            self.tokens += int(plan.final.sum())

    def swap_copies(self, plan) -> list:
        """The iteration's swap-outs (D2H) then swap-ins (H2D), one copy per request, issued now on the channels."""
        tokens = []
        for direction, copies, channel in (("d2h", plan.swap_out, self.hw.d2h), ("h2d", plan.swap_in, self.hw.h2d)):
            mover = self.mechanism if direction == "h2d" else offload_mechanism(self.mechanism)
            for rid, n_bytes in copies:
                duration = float(mover.copy_s(self.transfer, direction, n_bytes))
                tokens += self.schedule._issue(channel, direction, [self.requests[rid]], np.array([n_bytes]),
                                               np.array([duration]), self.timeline is not None and f"swap {direction}")
        return tokens

    def iteration(self, plan):
        """One iteration: every planned request's step, operation by operation (layers, then the LM head), on
        the engine's schedule (schedule.StepSchedule: recall -> compute -> offload). A layer's kernels are priced
        as they run (costs.kernel_times): the GEMMs over every token of the iteration, the decodes' attention and
        the prefill chunks' attention each at its own roofline."""
        n_layers = self.shape.n_layers
        entries = [self.requests[rid] for rid in plan.rids.tolist()]
        ops = n_layers + 1
        zeros = np.zeros(ops)
        recall_s, recall_bytes, offload_s, offload_bytes, events, loads = [], [], [], [], [], []
        decode_rows, prefill_parts = [], []
        custom = custom_layers(self.mechanism)
        for k, r in enumerate(entries):
            w, step = r.work, int(plan.steps[k])
            if plan.whole[k]:
                (decode_rows if step > 0 else prefill_parts).append(
                    (w.query_tokens[step], w.attn_flops[step], w.kv_read_bytes[step]))
                if custom:
                    loads.append(LayerLoad(**{f: getattr(w.load, f)[step] for f in LOAD_FIELDS}))
            else:
                base = (None, None) if plan.refill[k] else (w.query_tokens[0], w.attended_tokens[0])
                q, a, flops, kv_bytes = prefill_demand(self.shape, int(plan.tokens[k]), int(plan.offset[k]),
                                                       int(plan.target[k]), *base)
                prefill_parts.append((q, flops, kv_bytes))
                if custom:
                    loads.append(sequence_load(self.mechanism, self.shape, q, a, np.zeros_like(q), np.zeros_like(q)))
            traced_copies = plan.whole[k] or (plan.final[k] and not plan.refill[k])  # the traced step's copies
            copy_step = step if plan.whole[k] else 0
            if traced_copies:
                recall_s.append(w.recall_s[copy_step])
                recall_bytes.append(w.recall_bytes[copy_step])
                offload_s.append(w.offload_s[copy_step])
                offload_bytes.append(w.offload_bytes[copy_step])
                if w.event_s is not None:
                    events.append(w.event_s[copy_step])
            else:
                recall_s.append(zeros)
                recall_bytes.append(zeros)
                refill_s, refill_bytes = self.refill_offloads(r, step) if plan.final[k] else (zeros, zeros)
                offload_s.append(refill_s)
                offload_bytes.append(refill_bytes)
        recall_s, recall_bytes = np.array(recall_s), np.array(recall_bytes)
        offload_s, offload_bytes = np.array(offload_s), np.array(offload_bytes)
        following_s = following_bytes = None
        if self.schedule.prefetch:  # after the last operation comes the next step's first, for requests that go on
            nxt = [(r.work.recall_s[s + 1, 0], r.work.recall_bytes[s + 1, 0]) if on else (0.0, 0.0)
                   for r, s, on in zip(entries, plan.steps.tolist(), plan.goes_on.tolist())]
            following_s = np.column_stack([recall_s[:, 1:], [t for t, _ in nxt]])
            following_bytes = np.column_stack([recall_bytes[:, 1:], [b for _, b in nxt]])
        if custom:
            load = LayerLoad(**{f: np.any([getattr(x, f) for x in loads], axis=0) if f == "has_host_work"
                                else np.sum([getattr(x, f) for x in loads], axis=0) for f in LOAD_FIELDS})
            op_s = self.mechanism_op_s(load, None, len(entries), offload_s, offload_bytes, following_s,
                                       following_bytes)
        else:
            layer_s = iteration_layer_s(self.shape, self.profile,
                                        np.sum(decode_rows, axis=0) if decode_rows else None,
                                        np.sum(prefill_parts, axis=0) if prefill_parts else None)
            if needs_batch_op_s(self.mechanism):  # sm-copy's stretch beside the copies
                op_s = self.mechanism_op_s(None, layer_s, len(entries), offload_s, offload_bytes, following_s,
                                           following_bytes)
            else:
                op_s = [*layer_s.tolist(), float(costs.head_times(self.shape, self.profile, batch=len(entries)).total_s)]
        if events:  # each sequence's placement / recall bookkeeping
            op_s = costs.add_layer_events(op_s, np.sum(events, axis=0))
        self.gpu_busy_s += sum(op_s)
        yield from self.schedule.run(
            op_s, recall_s, recall_bytes, offload_s, offload_bytes, entries, plan.rids.tolist(),
            following_s=following_s, following_bytes=following_bytes, n_layers=n_layers)

    def refill_offloads(self, request: Request, step: int) -> tuple[np.ndarray, np.ndarray]:
        """A recompute's last chunk re-writes the request's offloaded KV of `step`: ddr_kv_bytes / L after each
        layer, to its tier."""
        n_layers = self.shape.n_layers
        n_bytes = np.zeros(n_layers + 1)
        n_bytes[:n_layers] = float(request.work.ddr_kv_bytes[step]) / n_layers
        ctx = self.spill_transfer if request.spilled else self.transfer
        return offload_mechanism(self.mechanism).copy_s(ctx, "d2h", n_bytes), n_bytes

    def mechanism_op_s(self, load, layer_s, batch, offload_s, offload_bytes, following_s, following_bytes) -> list[float]:
        """The iteration's operation times under a mechanism that changes them (mechanisms.batch_op_s): the
        batch's summed demand (or its layers' kernel times), and the channel time of the copies beside each
        operation."""
        coalesce = self.coalesce
        offload_group = group_s(offload_s, offload_bytes, coalesce and (lambda b: coalesce("d2h", b)))
        following_group = None if following_s is None else \
            group_s(following_s, following_bytes, coalesce and (lambda b: coalesce("h2d", b)))
        return batch_op_s(self.mechanism, self.transfer, load, batch, offload_group, following_group,
                          self.config.options.async_offload, layer_s=layer_s)

    def _record_occupancy(self, plan) -> None:
        weights = self.shape.weight_bytes
        hbm_reserved, ddr_reserved = self.scheduler.reserved
        self.occupancy.append((self.env.now, len(self.scheduler.running), len(self.scheduler.waiting),
                               weights + plan.hbm_bytes, weights + hbm_reserved, plan.ddr_bytes, ddr_reserved))

    def run(self, progress: bool = False) -> None:
        if progress:  # tokens generated so far, checked every simulated second
            from tqdm import tqdm

            total = sum(r.work.n_steps for r in self.requests if self.fits_alone(r))
            with tqdm(total=total, unit="tok", unit_scale=True, desc=f"serving on {self.profile.name}") as bar:
                while not self.done.triggered:
                    self.env.run(until=self.env.any_of([self.done, self.env.timeout(1.0)]))
                    bar.update(min(self.tokens, total) - bar.n)
        self.env.run(until=self.done)
        self.end_s = float(self.env.now)  # the last token (or 0 when nothing ran)
        self.env.run()  # drain the offload backlog (it occupies the link, not the requests)
        record_requests(self.requests, self.scheduler, self.iteration_end, [r.link_wait_s for r in self.requests],
                        self.spill_works, self.sample_of)


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
        "spilled": r.spilled, "preemptions": r.preemptions, "recomputed_tokens": r.recomputed_tokens,
        "swapped_bytes": r.swapped_bytes, "wait_s": r.wait_s,
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
    # Little's law on the admission queue: time-average queue length vs arrival rate x mean wait (a preempted
    # request's waits after its preemptions included: it is in the queue then too).
    queue_length = time_average(sim.queue_changes, end_s)
    arrival_rate = len(served) / end_s if end_s > 0 else 0.0
    mean_wait = float(served["wait_s"].mean()) if len(served) else 0.0
    scheduler = sim.scheduler
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
        "batch_copies": config.batch_copies, "admission": config.admission, "preempt": config.preempt,
        "max_batched_tokens": scheduler.budget, "rate_per_s": config.rate_per_s if not config.arrivals_csv else math.nan, "duration_s": config.duration_s, "max_batch": config.max_batch, "seed": config.seed,
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
        # paged admission: preemptions, the KV tokens they made recompute, the HBM bytes swapped out (and back)
        "n_preemptions": int(scheduler.preemptions.sum()), "recomputed_tokens": int(scheduler.recomputed.sum()),
        "swapped_bytes": float(scheduler.swapped_out.sum()),
        # the GPU: its kernels' share of the iterations' time (the rest waits for copies or the host) and of the run
        "gpu_busy_s": sim.gpu_busy_s,
        "gpu_busy_frac": sim.gpu_busy_s / sim.iteration_s if sim.iteration_s > 0 else 0.0,
        "gpu_util": sim.gpu_busy_s / end_s if end_s > 0 else 0.0,
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
    if config.arrivals_csv:  # the CSV's own lengths: each row's nearest sample resampled to them
        requests = read_arrivals_csv(config.arrivals_csv)
        work_of["classes"], request_class = csv_classes(
            requests, run.samples()[["prompt_tokens", "generated_tokens"]].to_numpy())
    manifest, shape, works = load_run_work(run_dir, profile, tier=chain.primary, transfer=config.options.transfer,
                                           **work_of)
    spill_works = load_run_work(run_dir, profile, tier=chain.spill, transfer=config.options.transfer, **work_of)[2] \
        if chain.spill else None
    if config.arrivals_csv:
        arrivals = csv_arrivals(requests, request_class)
    else:
        arrivals = poisson_arrivals(config.rate_per_s, config.duration_s, works, config.seed)
    block_tokens = int(manifest["policy"].get("block_size") or 16)  # paged admission's block (admission.Scheduler)
    engine = config.options.engine  # auto: the fast path (serving_fast, equal to this DES) unless a timeline
    if engine == "fast" and timeline is not None:
        raise ServingError("--timeline records the DES; drop --engine fast")
    if engine == "des" or timeline is not None:
        sim = ServingSim(profile, shape, works, arrivals, config, timeline, spill_works, block_tokens)
        sim.run(progress)
    else:
        sim = FastServing(profile, shape, works, arrivals, config, requests_for(arrivals, works), spill_works,
                          block_tokens)
        sim.run(progress)
    return summarise(sim, manifest, str(run_dir), overhead_source)
