"""The serving fast path: the serving DES (serving.ServingSim) as a plain loop over batch iterations.

The DES has two processes (arrivals, the batch loop) and copies reserved on the engine's counter channels
when they are issued (engine.Channel). Nothing else happens between the batch loop's yields, so the same
schedule is a loop with one clock:

- arrivals are a sorted list; before each iteration every arrival up to now joins the FCFS queue (the DES
  appends them when their timeout fires; admission only looks at the queue when an iteration starts); when
  nothing runs, the clock jumps to the next arrival (the DES's wakeup);
- one iteration gathers the running requests' next step from one table of all samples' steps (numpy, one
  fancy index per iteration: [batch, operations]), sums FLOPs / KV bytes over the batch for the layer
  times, and walks the operations: the recall group of each operation is reserved on the same `Channel`
  objects (their clock is this loop's), waited for, then the operation's compute, then the offload group;
- every request emits a token at the iteration's end, so a request's token times are a contiguous slice of
  the iteration end times (TBT = their differences, built once at the end).

The DES stays the reference: tests/test_serving_fast.py checks this loop against it to 1e-9 on random serving
cases (rates, budgets, batch limits, admission pressure, overlap, copy batching, mechanisms).
Ties between an arrival and an iteration's end at the very same float time are ordered as "arrival first"
here; in the DES they follow SimPy's event order. Continuous arrival times make such ties measure-zero.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from hwprofiles import HardwareProfile
from simulator import costs, mechanisms
from simulator.engine import Channel, engines_per_channel
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
                 requests: list, spill_works=None):
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
        self.coalesced = config.batch_copies or self.mechanism.batched
        check_spill(self.chain, self.mechanism, self.coalesced, self.hw.h2d.n_engines)
        self.overhead_s = {"h2d": self.mechanism.copy_overhead_s(self.transfer, "h2d"),
                           "d2h": mechanisms.offload_mechanism(self.mechanism).copy_overhead_s(self.transfer, "d2h")}
        self.requests = requests
        self.sample_of = np.array([a.sample for a in arrivals], dtype=np.int64)
        self.queue_changes: list[tuple[float, int]] = [(0.0, 0)]
        self.occupancy: list[tuple] = []
        self.end_s = 0.0
        self.pending: dict[int, float] = {}  # layer-prefetch: request -> end of its in-flight recall
        self.host = costs.host_times(shape, profile)  # as ServingSim: the host model's lead and iteration time
        self._tables()

    def _tables(self) -> None:
        """All samples' per-step arrays stacked: one row per (sample, step); a request reads row base + step."""
        works = self.works + (self.spill_works or [])  # the spill tier's costing of the samples after them
        n_layers = self.shape.n_layers
        bases = np.concatenate([[0], np.cumsum([w.n_steps for w in works])[:-1]]).astype(np.int64)
        self.base, self.spill_base = bases[:len(self.works)], bases[len(self.works):]
        # [rows, layers] compute demand, [rows, ops] transfers, [rows] occupancy
        # FLOPs and KV bytes side by side: one gather per iteration for both
        self.demand = np.stack([np.concatenate([w.flops for w in works]).reshape(-1, n_layers),
                                np.concatenate([w.kv_read_bytes for w in works]).reshape(-1, n_layers)], axis=1)
        self.event_s = np.concatenate([w.event_s if w.event_s is not None else np.zeros_like(w.flops)
                                       for w in works]).reshape(-1, n_layers)  # placement / recall bookkeeping
        self.recall_s = np.concatenate([w.recall_s for w in works])
        self.recall_bytes = np.concatenate([w.recall_bytes for w in works])
        self.offload_s = np.concatenate([w.offload_s for w in works])
        self.offload_bytes = np.concatenate([w.offload_bytes for w in works])
        self.copies = (self.recall_s > 0).any(1) | (self.offload_s > 0).any(1)  # rows with any transfer
        self.load = None  # zero-copy / cpu-attention: every LayerLoad field, stacked like `demand`
        if mechanisms.custom_layers(self.mechanism):
            # [rows, fields, layers]: one gather per iteration for every field (has_host_work as 0 / 1)
            self.load = np.stack([np.concatenate([getattr(w.load, f) for w in works]).reshape(-1, n_layers)
                                  .astype(np.float64) for f in mechanisms.LOAD_FIELDS], axis=1)
        self.hbm_kv = np.concatenate([w.hbm_kv_bytes for w in works])
        self.head_s: dict[int, float] = {}  # the LM head's time by batch size
        self.ddr_kv = np.concatenate([w.ddr_kv_bytes for w in works])


    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, progress: bool = False) -> None:
        config, clock = self.config, self.clock
        requests = self.requests
        n_req = len(requests)
        arrival_s = np.array([r.arrival_s for r in requests], dtype=np.float64)
        peak_hbm = np.array([r.work.peak_hbm_kv_bytes for r in requests], dtype=np.float64)
        peak_ddr = np.array([r.work.peak_ddr_kv_bytes for r in requests], dtype=np.float64)
        n_steps = np.array([r.work.n_steps for r in requests], dtype=np.int64)
        row0 = self.base[self.sample_of] if n_req else np.zeros(0, dtype=np.int64)
        fits = (peak_hbm <= self.kv_capacity_bytes) & ((peak_ddr <= self.ddr_capacity_bytes)
                                                       | (peak_ddr <= self.spill_capacity_bytes))
        spilled = np.zeros(n_req, dtype=bool)
        reserved_spill = 0.0
        waiting: deque[int] = deque()
        running = np.zeros(0, dtype=np.int64)  # request ids, admission order
        step = np.zeros(n_req, dtype=np.int64)
        first_iteration = np.full(n_req, -1, dtype=np.int64)
        admitted = np.full(n_req, math.nan)
        link_wait = np.zeros(n_req)
        iteration_end: list[float] = []
        reserved_hbm = reserved_ddr = 0.0
        next_arrival = 0
        weights = float(self.shape.weight_bytes)
        changes = self.queue_changes
        bar = _progress_bar(progress, int(n_steps[fits].sum()), self.profile.name)
        while True:
            # arrivals up to now join the queue (rejected ones never do)
            while next_arrival < n_req and arrival_s[next_arrival] <= clock.now:
                if fits[next_arrival]:
                    waiting.append(next_arrival)
                    changes.append((float(arrival_s[next_arrival]), len(waiting)))
                else:
                    requests[next_arrival].rejected = True
                next_arrival += 1
            # admission: FCFS while the batch has room and the head's peak KV fits
            admit = []
            while waiting and len(running) + len(admit) < config.max_batch:
                head = waiting[0]
                in_ddr = reserved_ddr + peak_ddr[head] <= self.ddr_capacity_bytes
                in_spill = reserved_spill + peak_ddr[head] <= self.spill_capacity_bytes  # DDR full -> spill
                if reserved_hbm + peak_hbm[head] > self.kv_capacity_bytes or not (in_ddr or in_spill):
                    break
                waiting.popleft()
                changes.append((clock.now, len(waiting)))
                admitted[head] = clock.now
                reserved_hbm += peak_hbm[head]
                if in_ddr:
                    reserved_ddr += peak_ddr[head]
                else:  # its rows: the samples costed on the spill tier
                    spilled[head] = True
                    row0[head] = self.spill_base[self.sample_of[head]]
                    reserved_spill += peak_ddr[head]
                admit.append(head)
            if admit:
                running = np.concatenate([running, np.array(admit, dtype=np.int64)])
            if not len(running):
                if next_arrival >= n_req and not waiting:
                    break
                clock.now = float(arrival_s[next_arrival])  # the DES's wakeup: the next arrival (or burst)
                continue
            rows = row0[running] + step[running]
            hbm_kv = float(self.hbm_kv[rows].sum())
            ddr_kv = float(self.ddr_kv[rows].sum())
            self.occupancy.append((clock.now, len(running), len(waiting), weights + hbm_kv, weights + reserved_hbm,
                                   ddr_kv, reserved_ddr))
            nxt = None
            if config.options.overlap == "layer-prefetch":  # the next step's first recall, for requests that go on
                goes_on = step[running] + 1 < n_steps[running]
                nxt = np.where(goes_on, rows + 1, -1)
            host_start_s = clock.now
            clock.now = host_start_s + self.host.lead_s  # (ServingSim.batch_loop: the host model)
            self._iteration(running, rows, nxt, link_wait, len(iteration_end))
            if clock.now < host_start_s + self.host.step_s:
                clock.now = host_start_s + self.host.step_s
            iteration_end.append(clock.now)
            for rid in running[first_iteration[running] < 0]:
                first_iteration[rid] = len(iteration_end) - 1
            step[running] += 1
            if bar is not None and len(iteration_end) % PROGRESS_EVERY == 0:
                bar.update(int(step.sum()) - bar.n)
            done = step[running] >= n_steps[running]
            if done.any():
                for rid in running[done]:  # one subtraction per request, in the DES's order
                    reserved_hbm -= peak_hbm[rid]
                    if spilled[rid]:
                        reserved_spill -= peak_ddr[rid]
                    else:
                        reserved_ddr -= peak_ddr[rid]
                running = running[~done]
        self.end_s = float(clock.now)
        if bar is not None:
            bar.close()
        self._requests_out(iteration_end, first_iteration, admitted, link_wait, n_steps, spilled)

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

    def _op_s(self, rows: np.ndarray, offload_s=None, offload_bytes=None, following_s=None,
              following_bytes=None) -> list[float]:
        """`_layer_op_s` plus every request's placement / recall bookkeeping on its layers (as ServingSim)."""
        op_s = self._layer_op_s(rows, offload_s, offload_bytes, following_s, following_bytes)
        return costs.add_layer_events(op_s, self.event_s[rows].sum(axis=0))

    def _layer_op_s(self, rows: np.ndarray, offload_s=None, offload_bytes=None, following_s=None,
                    following_bytes=None) -> list[float]:
        """The iteration's operation times: one roofline over the batch per layer (weights once, every
        request's FLOPs and KV bytes), then the LM head for the batch; under a mechanism that changes them
        (zero-copy, cpu-attention, sm-copy beside copies) mechanisms.batch_op_s, as ServingSim.mechanism_op_s."""
        mechanism = self.mechanism
        if self.load is not None or (mechanisms.needs_batch_op_s(mechanism) and offload_s is not None):
            if self.load is not None:
                sums = self.load[rows].sum(axis=0)  # the batch's summed demand, field by field
                load = mechanisms.LayerLoad(**{f: sums[k] > 0 if f == "has_host_work" else sums[k]
                                               for k, f in enumerate(mechanisms.LOAD_FIELDS)})
            else:
                flops, kv_bytes = self.demand[rows].sum(axis=0)
                load = mechanisms.LayerLoad(flops, kv_bytes, *([0.0] * 6))
            if offload_s is None:
                offload_s, offload_bytes = self.offload_s[rows], self.offload_bytes[rows]
            following_group = None if following_s is None else self._group_s("h2d", following_s, following_bytes)
            return mechanisms.batch_op_s(mechanism, self.transfer, load, len(rows),
                                         self._group_s("d2h", offload_s, offload_bytes), following_group,
                                         self.config.options.async_offload)
        shape, profile = self.shape, self.profile
        flops, kv_bytes = self.demand[rows].sum(axis=0)
        # costs.roofline's total, operation for operation (the same divisions, max and overhead)
        layer_s = np.maximum(flops / profile.gpu.matmul_flops_per_s,
                             (shape.layer_weight_bytes + kv_bytes) / profile.gpu.hbm_bytes_per_s) \
            + costs.layer_overhead_s(shape, profile, kv_bytes)
        batch = len(rows)
        head_s = self.head_s.get(batch)
        if head_s is None:
            head_s = self.head_s[batch] = float(costs.head_times(shape, profile, batch=batch).total_s)
        return [*layer_s.tolist(), head_s]

    def _lean_iteration(self, running: np.ndarray, rows: np.ndarray, link_wait: np.ndarray) -> None:
        """`_iteration` without prefetch on channels with one copy engine, in closed form per operation.

        A group of copies issued together on a one-engine channel starts at s = max(now, engine free) and its
        member j ends at s + (its own and the earlier members' durations), so the group is one scalar step of
        the channel (free = s + the group's total) and member j waited s - now + the earlier members'
        durations (a coalesced copy: s - now for every member). Only the scalar recurrence over operations is
        a Python loop; the per-request sums are numpy over the batch."""
        clock = self.clock
        if not self.copies[rows].any():  # nothing moves: the operations back to back (sm-copy: nothing beside)
            clock.now = self._no_copies(self._op_s(rows))
            return
        recall_s, offload_s = self.recall_s[rows], self.offload_s[rows]  # [batch, ops]
        op_s = self._op_s(rows, offload_s, self.offload_bytes[rows])
        h2d, d2h = self.hw.h2d, self.hw.d2h
        coalesce = self.coalesced
        totals, waits, group_bytes = {}, {}, {}
        for direction, durations, n_bytes in (("h2d", recall_s, self.recall_bytes[rows]),
                                              ("d2h", offload_s, self.offload_bytes[rows])):
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
            link_wait[running] += np.where(member, base[direction][None, :] + ahead, 0.0).sum(axis=1)
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

    def _iteration(self, running: np.ndarray, rows: np.ndarray, nxt, link_wait: np.ndarray, iteration: int) -> None:
        """schedule.StepSchedule.run for one iteration, with the clock as a float and channel tokens as end
        times (what it does with engine.Channel): recall -> (prefetch) -> compute -> offload per operation."""
        config, clock = self.config, self.clock
        prefetch = nxt is not None
        if not prefetch and self.hw.h2d.n_engines == 1 and self.hw.d2h.n_engines == 1:
            return self._lean_iteration(running, rows, link_wait)
        recall_s = self.recall_s[rows]  # [batch, ops]
        recall_bytes = self.recall_bytes[rows]
        offload_s = self.offload_s[rows]
        offload_bytes = self.offload_bytes[rows]
        following_s = following_bytes = None
        if prefetch:
            has_next = nxt >= 0
            first_next_s = np.where(has_next, self.recall_s[np.maximum(nxt, 0), 0], 0.0)
            first_next_bytes = np.where(has_next, self.recall_bytes[np.maximum(nxt, 0), 0], 0.0)
            following_s = np.column_stack([recall_s[:, 1:], first_next_s])
            following_bytes = np.column_stack([recall_bytes[:, 1:], first_next_bytes])
            ahead_any = (following_s > 0).any(0).tolist()
        op_s = self._op_s(rows, offload_s, offload_bytes, following_s, following_bytes)
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

    def _requests_out(self, iteration_end: list[float], first_iteration, admitted, link_wait, n_steps,
                      spilled) -> None:
        """Fill the Request records summarise reads: admission, first / last token, TBT, link wait, tier."""
        ends = np.array(iteration_end, dtype=np.float64)
        for r in self.requests:
            rid = r.rid
            r.link_wait_s = float(link_wait[rid])
            if spilled[rid]:
                r.spilled = True
                r.work = self.spill_works[self.sample_of[rid]].truncated(r.work.n_steps)
            first = first_iteration[rid]
            if r.rejected or first < 0:
                continue
            r.admitted_s = float(admitted[rid])
            times = ends[first: first + n_steps[rid]]
            r.first_token_s = float(times[0])
            r.finish_s = r.last_token_s = float(times[-1])
            r.step = int(n_steps[rid])
            r.tbt_s = np.diff(times)  # an array (serving.summarise takes lists or arrays)

