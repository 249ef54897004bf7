"""The serving fast path: the serving DES (serving.ServingSim) as a plain loop over batch iterations.

The DES has two processes (arrivals, the batch loop) and copies reserved on the engine's counter channels
when they are issued (engine.Channel). Nothing else happens between the batch loop's yields, so the same
schedule is a loop with one clock:

- arrivals are a sorted list; before each iteration every arrival up to now joins the queue (the DES appends
  them when their timeout fires; the scheduler only looks at the queue when an iteration is planned); when
  nothing runs, the clock jumps to the next arrival (the DES's wakeup);
- what an iteration runs is admission.Scheduler's plan, the same object the DES asks (admission, chunked
  prefill, preemption); its swap copies are reserved on the channels at the iteration's start;
- one iteration gathers the planned requests' steps from one table of all samples' steps (numpy, one fancy
  index per iteration: [batch, operations]; prefill chunks and recomputes are priced apart,
  admission.prefill_demand), sums their decodes' and their prefills' demand for the layers' kernels
  (admission.iteration_layer_s), and walks the operations: the recall group of each operation is reserved on
  the same `Channel` objects (their clock is this loop's), waited for, then the operation's compute, then the
  offload group;
- a request emits a token at the end of each iteration from its prefill's last chunk until it ends or is
  preempted, so its token times are slices of the iteration end times (TBT = their differences, built once at
  the end).

The DES stays the reference: tests/test_serving_fast.py checks this loop against it to 1e-9 on random serving
cases (rates, budgets, batch limits, admission pressure and both admissions, both preemptions, chunked prefill,
overlap, copy batching, mechanisms).
Ties between an arrival and an iteration's end at the very same float time are ordered as "arrival first"
here; in the DES they follow SimPy's event order. Continuous arrival times make such ties measure-zero.
"""

from __future__ import annotations

import math

import numpy as np

from hwprofiles import HardwareProfile
from simulator import costs, mechanisms
from simulator.admission import SPILL, iteration_layer_s, prefill_demand, record_requests, scheduler_for
from simulator.engine import Channel, engines_per_channel
from simulator.errors import ServingError
from simulator.options import ServingConfig
from simulator.tiers import check_spill, serving_memory

PROGRESS_EVERY = 4096  # iterations between progress updates (tokens generated so far)


def _progress_bar(progress: bool, total_tokens: int, profile: str):
    """The DES's progress bar (tokens generated; shown on a terminal), or None without progress."""
    if not progress or not total_tokens:
        return None
    from tqdm import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"serving on {profile}", disable=None)


class _Clock:
    """What `engine.Channel` reads of a SimPy environment: the current time (set by the loop)."""

    now = 0.0


class _Hardware:
    def __init__(self, clock: _Clock, profile: HardwareProfile):
        engines = engines_per_channel(profile)
        if profile.link.full_duplex:
            self.h2d = Channel(clock, "link H2D", engines)
            self.d2h = Channel(clock, "link D2H", engines)
        else:
            self.h2d = self.d2h = Channel(clock, "link (half duplex)", engines)


class FastServing:
    """Same inputs and the same attributes `serving.summarise` reads as `serving.ServingSim`."""

    def __init__(self, profile: HardwareProfile, shape: costs.ModelShape, works, arrivals, config: ServingConfig,
                 requests: list, spill_works=None, block_tokens: int = 16):
        """`requests`: serving.Request records of the arrivals, in order (serving.requests_for builds them; this
        module does not import serving, which dispatches to it)."""
        self.profile, self.shape, self.config, self.works = profile, shape, config, works
        self.spill_works = spill_works
        self.clock = _Clock()
        self.hw = _Hardware(self.clock, profile)
        memory = serving_memory(profile, shape, config.options.offload_tier)  # simulator/tiers.py, shared
        self.kv_capacity_bytes, self.chain, self.tier = memory.kv_capacity_bytes, memory.chain, memory.tier
        self.ddr_capacity_bytes, self.spill_capacity_bytes = memory.ddr_capacity_bytes, memory.spill_capacity_bytes
        # --transfer: as ServingSim (the copies' cost, coalescing, per-direction overheads, the layers' time)
        self.mechanism = mechanisms.mechanism_for(config.options.transfer, profile)
        self.transfer = mechanisms.context(profile, shape, self.chain.primary)
        self.spill_transfer = mechanisms.context(profile, shape, self.chain.spill) if self.chain.spill else None
        self.coalesced = config.batch_copies or self.mechanism.batched
        check_spill(self.chain, self.mechanism, self.coalesced, self.hw.h2d.n_engines)
        self.offloader = mechanisms.offload_mechanism(self.mechanism)
        self.overhead_s = {"h2d": self.mechanism.copy_overhead_s(self.transfer, "h2d"),
                           "d2h": self.offloader.copy_overhead_s(self.transfer, "d2h")}
        self.requests = requests
        self.sample_of = np.array([a.sample for a in arrivals], dtype=np.int64)
        self.scheduler = scheduler_for(config, profile, works, requests, self.sample_of, memory, block_tokens)
        self.queue_changes = self.scheduler.queue_changes
        self.occupancy: list[tuple] = []
        self.end_s = 0.0
        self.gpu_busy_s = 0.0
        self.iteration_s = 0.0
        self.pending: dict[int, float] = {}  # layer-prefetch: request -> end of its in-flight recall
        self.host = costs.host_times(shape, profile)  # as ServingSim: the host model's lead and iteration time
        self._tables()

    def _tables(self) -> None:
        """All samples' per-step arrays stacked: one row per (sample, step); a request reads row base + step."""
        works = self.works + (self.spill_works or [])  # the spill tier's costing of the samples after them
        n_layers = self.shape.n_layers
        bases = np.concatenate([[0], np.cumsum([w.n_steps for w in works])[:-1]]).astype(np.int64)
        self.base, self.spill_base = bases[:len(self.works)], bases[len(self.works):]
        # [rows, 3, layers]: query tokens, attention FLOPs and bytes side by side (one gather per iteration)
        self.demand = np.stack([np.concatenate([getattr(w, f) for w in works]).reshape(-1, n_layers)
                                for f in ("query_tokens", "attn_flops", "kv_read_bytes")], axis=1)
        self.attended = np.concatenate([w.attended_tokens for w in works]).reshape(-1, n_layers)
        self.event_s = np.concatenate([w.event_s if w.event_s is not None else np.zeros_like(w.flops)
                                       for w in works]).reshape(-1, n_layers)  # placement / recall bookkeeping
        self.has_events = bool(self.event_s.any())
        self.recall_s = np.concatenate([w.recall_s for w in works])
        self.recall_bytes = np.concatenate([w.recall_bytes for w in works])
        self.offload_s = np.concatenate([w.offload_s for w in works])
        self.offload_bytes = np.concatenate([w.offload_bytes for w in works])
        self.ddr_kv = np.concatenate([w.ddr_kv_bytes for w in works])
        self.copies = (self.recall_s > 0).any(1) | (self.offload_s > 0).any(1)  # rows with any transfer
        self.load = None  # zero-copy / cpu-attention: every LayerLoad field, stacked like `demand`
        if mechanisms.custom_layers(self.mechanism):
            # [rows, fields, layers]: one gather per iteration for every field (has_host_work as 0 / 1)
            self.load = np.stack([np.concatenate([np.broadcast_to(getattr(w.load, f), w.flops.shape)
                                                  for w in works]).reshape(-1, n_layers)
                                  .astype(np.float64) for f in mechanisms.LOAD_FIELDS], axis=1)
        self.head_s: dict[int, float] = {}  # the LM head's time by batch size

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, progress: bool = False) -> None:
        clock, scheduler = self.clock, self.scheduler
        requests = self.requests
        n_req = len(requests)
        arrival_s = np.array([r.arrival_s for r in requests], dtype=np.float64)
        peak_hbm = np.array([r.work.peak_hbm_kv_bytes for r in requests], dtype=np.float64)
        peak_ddr = np.array([r.work.peak_ddr_kv_bytes for r in requests], dtype=np.float64)
        fits = (peak_hbm <= self.kv_capacity_bytes) & ((peak_ddr <= self.ddr_capacity_bytes)
                                                       | (peak_ddr <= self.spill_capacity_bytes))
        row0 = self.base[self.sample_of] if n_req else np.zeros(0, dtype=np.int64)
        self.row0 = row0
        link_wait = np.zeros(n_req)
        iteration_end: list[float] = []
        next_arrival = 0
        weights = float(self.shape.weight_bytes)
        n_steps = np.array([r.work.n_steps for r in requests], dtype=np.int64)
        bar = _progress_bar(progress, int(n_steps[fits].sum()), self.profile.name)
        scheduled = 0  # steps run so far (a prefill chunk counts as one): what the bar shows
        while True:
            # arrivals up to now join the queue (rejected ones never do)
            while next_arrival < n_req and arrival_s[next_arrival] <= clock.now:
                if fits[next_arrival]:
                    scheduler.arrive(next_arrival, float(arrival_s[next_arrival]))
                else:
                    requests[next_arrival].rejected = True
                next_arrival += 1
            plan = scheduler.plan(clock.now, len(iteration_end))
            for rid in plan.preempted:
                self.pending.pop(rid, None)
            if not len(plan):
                if len(scheduler.running) or plan.swap_out:
                    raise ServingError("internal: an iteration with nothing to run; please report this")
                if next_arrival >= n_req:
                    if scheduler.waiting:
                        raise ServingError("internal: the queue's head can never be admitted; please report this")
                    break
                clock.now = float(arrival_s[next_arrival])  # the DES's wakeup: the next arrival (or burst)
                continue
            for rid in plan.admitted:  # its rows: the samples costed on the spill tier
                if scheduler.tier[rid] == SPILL:
                    row0[rid] = self.spill_base[self.sample_of[rid]]
            hbm_reserved, ddr_reserved = scheduler.reserved
            self.occupancy.append((clock.now, len(scheduler.running), len(scheduler.waiting), weights + plan.hbm_bytes,
                                   weights + hbm_reserved, plan.ddr_bytes, ddr_reserved))
            host_start_s = clock.now
            swap_end_s = self._swaps(plan, link_wait)
            clock.now = host_start_s + self.host.lead_s  # (ServingSim.batch_loop: the host model)
            if swap_end_s > clock.now:
                clock.now = swap_end_s
            self._iteration(plan, link_wait)
            if clock.now < host_start_s + self.host.step_s:
                clock.now = host_start_s + self.host.step_s
            iteration_end.append(clock.now)
            self.iteration_s += clock.now - host_start_s
            scheduler.finish(plan, len(iteration_end) - 1)
            scheduled += len(plan)
            if bar is not None and len(iteration_end) % PROGRESS_EVERY == 0:
                bar.update(scheduled - bar.n)
        self.end_s = float(clock.now)
        if bar is not None:
            bar.close()
        record_requests(requests, scheduler, iteration_end, link_wait, self.spill_works, self.sample_of)

    def _swaps(self, plan, link_wait: np.ndarray) -> float:
        """The iteration's swap copies (ServingSim.swap_copies): D2H then H2D, one per request; their last end."""
        end = -math.inf
        asked_s = self.clock.now
        for direction, copies, channel in (("d2h", plan.swap_out, self.hw.d2h), ("h2d", plan.swap_in, self.hw.h2d)):
            mover = self.mechanism if direction == "h2d" else self.offloader
            for rid, n_bytes in copies:
                duration = float(mover.copy_s(self.transfer, direction, n_bytes))
                copy_end = channel.reserve(direction, n_bytes, duration, self.overhead_s[direction])
                link_wait[rid] += copy_end - asked_s - duration
                end = max(end, copy_end)
        return end

    def _entries(self, plan):
        """The iteration's per-request arrays ([entries, ops] copies) and its layers' demand, in entry order (as
        ServingSim.iteration builds them)."""
        rows = self.row0[plan.rids] + plan.steps
        whole = plan.whole
        if whole.all():  # decodes and whole prefills only: every array is a gather
            if self.copies[rows].any():
                recall_s, offload_s = self.recall_s[rows], self.offload_s[rows]
                recall_bytes, offload_bytes = self.recall_bytes[rows], self.offload_bytes[rows]
            else:  # nothing moves (the full cache): no [batch, operations] arrays at all
                recall_s = recall_bytes = offload_s = offload_bytes = None
            event_rows = rows
            prefill = plan.steps == 0
            decode_rows = rows[~prefill] if prefill.any() else rows
            demand = self.demand[decode_rows].sum(axis=0) if len(decode_rows) else None
            pre = self.demand[rows[prefill]].sum(axis=0) if prefill.any() else None
            loads = self.load[rows] if self.load is not None else None
            return rows, recall_s, recall_bytes, offload_s, offload_bytes, event_rows, demand, pre, loads
        ops = self.shape.n_layers + 1
        n = len(rows)
        traced = whole | (plan.final & ~plan.refill)  # entries with their traced step's copies
        copy_rows = np.where(whole, rows, self.row0[plan.rids])  # a prompt's last chunk: its prefill's copies
        recall_s, recall_bytes = np.zeros((n, ops)), np.zeros((n, ops))
        offload_s, offload_bytes = np.zeros((n, ops)), np.zeros((n, ops))
        recall_s[traced], recall_bytes[traced] = self.recall_s[copy_rows[traced]], self.recall_bytes[copy_rows[traced]]
        offload_s[traced] = self.offload_s[copy_rows[traced]]
        offload_bytes[traced] = self.offload_bytes[copy_rows[traced]]
        n_layers = self.shape.n_layers
        for k in np.flatnonzero(plan.refill & plan.final).tolist():  # a recompute re-writes its offloaded KV
            offload_bytes[k, :n_layers] = float(self.ddr_kv[rows[k]]) / n_layers
            spilled = self.scheduler.tier[plan.rids[k]] == SPILL
            offload_s[k] = self.offloader.copy_s(self.spill_transfer if spilled else self.transfer, "d2h",
                                                 offload_bytes[k])
        event_rows = copy_rows[traced]
        decode = whole & (plan.steps > 0)
        demand = self.demand[rows[decode]].sum(axis=0) if decode.any() else None
        loads = self.load[rows] if self.load is not None else None  # a prefill chunk's row replaced below
        parts = []
        for k in np.flatnonzero(~decode).tolist():  # the prefills, in entry order (few)
            if whole[k]:
                parts.append(self.demand[rows[k]])
                continue
            base = (None, None) if plan.refill[k] else (self.demand[copy_rows[k], 0], self.attended[copy_rows[k]])
            q, a, flops, kv_bytes = prefill_demand(self.shape, int(plan.tokens[k]), int(plan.offset[k]),
                                                   int(plan.target[k]), *base)
            parts.append(np.stack([q, flops, kv_bytes]))
            if loads is not None:
                load = mechanisms.sequence_load(self.mechanism, self.shape, q, a, np.zeros_like(q), np.zeros_like(q))
                loads[k] = np.stack([np.asarray(getattr(load, f), dtype=np.float64) for f in mechanisms.LOAD_FIELDS])
        pre = np.sum(parts, axis=0) if parts else None
        return rows, recall_s, recall_bytes, offload_s, offload_bytes, event_rows, demand, pre, loads

    def _coalesce(self, direction: str, n_bytes):
        """One copy for a group's summed bytes (array or scalar): mechanisms.coalesced_copy_s, elementwise."""
        mover = self.mechanism if direction == "h2d" else mechanisms.offload_mechanism(self.mechanism)
        return mover.copy_s(self.transfer, direction, n_bytes)

    def _group_s(self, direction: str, durations_s: np.ndarray, n_bytes: np.ndarray) -> np.ndarray:
        """mechanisms.group_s for this machine's coalescing rule."""
        total = durations_s.sum(axis=0)
        if not self.coalesced:
            return total
        many = (durations_s > 0).sum(axis=0) > 1
        return np.where(many, self._coalesce(direction, n_bytes.sum(axis=0)), total)

    def _op_s(self, entries, offload_s=None, offload_bytes=None, following_s=None, following_bytes=None) -> list[float]:
        """The iteration's operation times (as ServingSim.iteration): its layers' kernels (admission.
        iteration_layer_s: the GEMMs over every token, the decodes' and the prefill chunks' attention apart), then
        the LM head for the batch; under a mechanism that changes them (zero-copy, cpu-attention: the batch's
        summed LayerLoad; sm-copy beside copies) mechanisms.batch_op_s; plus every request's placement / recall
        bookkeeping. Adds them to the GPU's busy time."""
        rows, _, _, entry_offload_s, entry_offload_bytes, event_rows, decode, prefill, loads = entries
        mechanism, batch = self.mechanism, len(rows)
        if loads is not None:  # zero-copy / cpu-attention: the batch's summed demand, field by field
            sums = loads.sum(axis=0)
            load = mechanisms.LayerLoad(**{f: sums[k] > 0 if f == "has_host_work" else sums[k]
                                           for k, f in enumerate(mechanisms.LOAD_FIELDS)})
            if offload_s is None:
                offload_s, offload_bytes = entry_offload_s, entry_offload_bytes
            if offload_s is None:
                offload_s = offload_bytes = np.zeros((batch, self.shape.n_layers + 1))
            op_s = mechanisms.batch_op_s(mechanism, self.transfer, load, batch, self._group_s("d2h", offload_s, offload_bytes),
                                         None if following_s is None else self._group_s("h2d", following_s, following_bytes),
                                         self.config.options.async_offload)
        else:
            layer_s = iteration_layer_s(self.shape, self.profile, decode, prefill)
            if mechanisms.needs_batch_op_s(mechanism) and offload_s is not None:  # sm-copy's stretch
                following_group = None if following_s is None else self._group_s("h2d", following_s, following_bytes)
                op_s = mechanisms.batch_op_s(mechanism, self.transfer, None, batch,
                                             self._group_s("d2h", offload_s, offload_bytes), following_group,
                                             self.config.options.async_offload, layer_s=layer_s)
            else:
                head_s = self.head_s.get(batch)
                if head_s is None:
                    head_s = self.head_s[batch] = float(costs.head_times(self.shape, self.profile, batch=batch).total_s)
                op_s = [*layer_s.tolist(), head_s]
        if self.has_events:
            op_s = costs.add_layer_events(op_s, self.event_s[event_rows].sum(axis=0))
        self.gpu_busy_s += sum(op_s)
        return op_s

    def _lean_iteration(self, rids: np.ndarray, entries, link_wait: np.ndarray) -> None:
        """`_iteration` without prefetch on channels with one copy engine, in closed form per operation.

        A group of copies issued together on a one-engine channel starts at s = max(now, engine free) and its
        member j ends at s + (its own and the earlier members' durations), so the group is one scalar step of
        the channel (free = s + the group's total) and member j waited s - now + the earlier members'
        durations (a coalesced copy: s - now for every member). Only the scalar recurrence over operations is
        a Python loop; the per-request sums are numpy over the batch."""
        clock = self.clock
        rows, recall_s, recall_bytes, offload_s, offload_bytes = entries[:5]
        if recall_s is None or not (recall_s.any() or offload_s.any()):  # nothing moves: operations back to back
            clock.now = self._no_copies(self._op_s(entries))
            return
        op_s = self._op_s(entries, offload_s, offload_bytes)
        h2d, d2h = self.hw.h2d, self.hw.d2h
        coalesce = self.coalesced
        totals, waits, group_bytes = {}, {}, {}
        for direction, durations, n_bytes in (("h2d", recall_s, recall_bytes), ("d2h", offload_s, offload_bytes)):
            member = durations > 0
            group_bytes[direction] = n_bytes.sum(axis=0)
            total = durations.sum(axis=0)
            ahead = durations.cumsum(axis=0) - durations  # the earlier members' durations (exclusive)
            if coalesce:
                many = member.sum(axis=0) > 1
                total = np.where(many, self._coalesce(direction, group_bytes[direction]), total)
                ahead = np.where(many[None, :], 0.0, ahead)
            totals[direction] = total.tolist()
            waits[direction] = (member, ahead)
        same = h2d is d2h  # half duplex: one channel for both directions
        free = {"h2d": h2d.engine_free_s[0], "d2h": d2h.engine_free_s[0]}
        n_ops = len(op_s)
        base = {"h2d": np.zeros(n_ops), "d2h": np.zeros(n_ops)}
        busy = {"h2d": 0.0, "d2h": 0.0}
        async_offload = self.config.options.async_offload
        recall_total, offload_total = totals["h2d"], totals["d2h"]
        t = clock.now
        for i in range(n_ops):
            r = recall_total[i]
            if r > 0:
                start = free["h2d"] if free["h2d"] > t else t
                base["h2d"][i] = start - t
                t = start + r
                free["h2d"] = t
                if same:
                    free["d2h"] = t
                busy["h2d"] += r
            t += op_s[i]
            o = offload_total[i]
            if o > 0:
                start = free["d2h"] if free["d2h"] > t else t
                base["d2h"][i] = start - t
                end = start + o
                free["d2h"] = end
                if same:
                    free["h2d"] = end
                busy["d2h"] += o
                if not async_offload:
                    t = end
        for direction, channel in (("h2d", h2d), ("d2h", d2h)):
            member, ahead = waits[direction]
            link_wait[rids] += np.where(member, base[direction][None, :] + ahead, 0.0).sum(axis=1)
            channel.busy_s[direction] += busy[direction]
            channel.bytes[direction] += float(group_bytes[direction].sum())
            channel.engine_free_s[0] = free[direction]
            if busy[direction] > 0:
                channel.last_end_s[direction] = max(channel.last_end_s[direction], free[direction])
        clock.now = t

    def _no_copies(self, op_s: list[float]) -> float:
        t = self.clock.now
        for c in op_s:  # t += c one by one, as the schedule's clock does
            t += c
        return t

    def _iteration(self, plan, link_wait: np.ndarray) -> None:
        """schedule.StepSchedule.run for one iteration, with the clock as a float and channel tokens as end
        times (what it does with engine.Channel): recall -> (prefetch) -> compute -> offload per operation."""
        config, clock = self.config, self.clock
        running = plan.rids
        entries = self._entries(plan)
        prefetch = config.options.overlap == "layer-prefetch"
        if not prefetch and self.hw.h2d.n_engines == 1 and self.hw.d2h.n_engines == 1:
            return self._lean_iteration(running, entries, link_wait)
        rows, recall_s, recall_bytes, offload_s, offload_bytes = entries[:5]
        if recall_s is None:
            recall_s = recall_bytes = offload_s = offload_bytes = np.zeros((len(rows), self.shape.n_layers + 1))
        following_s = following_bytes = None
        if prefetch:  # the next step's first recall, for requests that go on
            nxt = np.where(plan.goes_on, rows + 1, -1)
            has_next = nxt >= 0
            first_next_s = np.where(has_next, self.recall_s[np.maximum(nxt, 0), 0], 0.0)
            first_next_bytes = np.where(has_next, self.recall_bytes[np.maximum(nxt, 0), 0], 0.0)
            following_s = np.column_stack([recall_s[:, 1:], first_next_s])
            following_bytes = np.column_stack([recall_bytes[:, 1:], first_next_bytes])
            ahead_any = (following_s > 0).any(0).tolist()
        op_s = self._op_s(entries, offload_s, offload_bytes, following_s, following_bytes)
        pending = self.pending
        h2d, d2h = self.hw.h2d, self.hw.d2h
        needs_any = (recall_s > 0).any(0).tolist()
        moving_any = (offload_s > 0).any(0).tolist()
        async_offload = config.options.async_offload
        t = clock.now
        for i in range(len(op_s)):
            if needs_any[i]:
                needs = np.flatnonzero(recall_s[:, i])
                end = t
                if pending:
                    fresh = []
                    for j in needs.tolist():
                        token = pending.pop(int(running[j]), None)
                        if token is None:
                            fresh.append(j)
                        elif token > end:
                            end = token
                    fresh = np.array(fresh, dtype=np.int64)
                else:
                    fresh = needs
                if len(fresh):
                    clock.now = t
                    ends = self._group(h2d, "h2d", running[fresh], recall_bytes[fresh, i], recall_s[fresh, i],
                                       link_wait)
                    end = max(end, float(ends.max()))
                t = end
            if prefetch and ahead_any[i]:
                ahead = np.flatnonzero(following_s[:, i])
                clock.now = t
                ends = self._group(h2d, "h2d", running[ahead], following_bytes[ahead, i], following_s[ahead, i],
                                   link_wait)
                pending.update(zip(running[ahead].tolist(), ends.tolist()))
            t += op_s[i]
            if moving_any[i]:
                moving = np.flatnonzero(offload_s[:, i])
                clock.now = t
                ends = self._group(d2h, "d2h", running[moving], offload_bytes[moving, i], offload_s[moving, i],
                                   link_wait)
                if not async_offload:
                    t = max(t, float(ends.max()))
        clock.now = t

    def _group(self, channel: Channel, direction: str, rids: np.ndarray, n_bytes: np.ndarray, durations_s: np.ndarray,
               link_wait: np.ndarray) -> np.ndarray:
        """The copies of `rids` issued now, in member order (schedule.StepSchedule._issue); returns each one's
        end and adds its time beyond its own duration to `link_wait`."""
        asked_s = self.clock.now
        overhead_s = self.overhead_s[direction]
        if self.coalesced and len(rids) > 1:  # one coalesced copy shared by the group
            total_bytes = float(n_bytes.sum())
            copy_s = mechanisms.coalesced_copy_s(self.mechanism, self.transfer, direction, total_bytes)
            end = channel.reserve(direction, total_bytes, copy_s, overhead_s)
            link_wait[rids] += end - asked_s - copy_s
            return np.full(len(rids), end)
        if channel.n_engines == 1 and len(rids) > 1:
            # one engine: the group's copies run back to back from the first one's start; reserving their summed
            # duration once leaves the channel where the member-by-member reservations would
            start_s = max(asked_s, channel.engine_free_s[0])
            ends = start_s + np.cumsum(durations_s)
            channel.reserve(direction, float(n_bytes.sum()), float(ends[-1] - start_s), overhead_s)
            channel.engine_free_s[0] = float(ends[-1])
            link_wait[rids] += ends - asked_s - durations_s
            return ends
        ends = np.empty(len(rids))
        for k, (rid, b, d) in enumerate(zip(rids.tolist(), n_bytes.tolist(), durations_s.tolist())):
            ends[k] = channel.reserve(direction, b, d, overhead_s)
            link_wait[rid] += ends[k] - asked_s - d
        return ends
