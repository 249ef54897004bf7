"""The discrete-event engine (SimPy): hardware as explicit resources, one process per sequence.

Hardware (`Hardware`):
- `gpu`: a Resource of capacity 1. A sequence (or a lockstep batch) holds it for a whole decode step: the
  step's kernels run back to back; waiting for a recall inside the step keeps the GPU idle (a link stall).
- the host link as `Channel`s: in full duplex one per direction (H2D, D2H), in half duplex one shared by both.
  A channel is a FIFO queue of copy engines; a transfer holds one engine for overhead + bytes / bandwidth.
  With more than one engine on a channel the bytes still share one wire (held for bytes / bandwidth only),
  so extra engines overlap setup costs, never bandwidth. `Channel` keeps this queue as counters (next-free
  times) and reserves each copy when it is issued; `ResourceChannel`, the same queue as SimPy Resources, is
  its reference (tests/test_engine_channel.py checks they agree).

A sequence process walks the Workload's operations (workload.py). Inside a step it keeps its own clock and
yields only where another process could observe it: before issuing a copy and at the end of the step (see
`sequence`); a step with nothing to wait for or issue is one timeout. With a host model (costs.host_times) a
step's GPU work starts `lead_s` after the step begins and the step ends no sooner than `step_s` after it (one
timeout each). Overlap modes:

- `none`: recall, then compute (the recall is on the critical path);
- `layer-prefetch`: the recall for operation i+1 is issued when operation i starts computing, so it
  overlaps with it (valid only when the recall set is known before the step: recall_rule "score");
- `async_offload`: offloads are issued after an operation and not waited for (else the sequence waits).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from hwprofiles import HardwareProfile
from simulator.options import OVERLAP_MODES  # noqa: F401 - the engine's modes, defined with the options
from simulator.schedule import StepSchedule
from simulator.workload import Timing, Workload


def engines_per_channel(profile: HardwareProfile) -> int:
    """Copy engines serving one channel: the profile counts all engines; in full duplex half go each way."""
    link = profile.link
    return max(1, link.copy_engines // 2) if link.full_duplex else link.copy_engines


@dataclass
class Timeline:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one track per resource.

    Each simulated machine (profile) is one process (`begin_process`); its resources are its threads.
    """

    events: list[dict] = field(default_factory=list)
    tracks: dict[tuple[int, str], int] = field(default_factory=dict)
    pid: int = 0

    def begin_process(self, name: str) -> None:
        self.pid += 1
        self.events.append({"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": name}})

    def span(self, track: str, name: str, start_s: float, end_s: float, **args) -> None:
        key = (self.pid, track)
        if key not in self.tracks:
            self.tracks[key] = len(self.tracks) + 1
            self.events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": self.tracks[key],
                                "args": {"name": track}})
        event = {"name": name, "ph": "X", "pid": self.pid, "tid": self.tracks[key], "ts": start_s * 1e6,
                 "dur": (end_s - start_s) * 1e6}
        if args:
            event["args"] = args
        self.events.append(event)

    def to_json(self) -> dict:
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        from traces.layout import write_bytes_atomic

        write_bytes_atomic(Path(path), json.dumps(self.to_json()).encode())


class Channel:
    """One direction of the host link (or both, half duplex): copy engines + the wire they share, as counters.

    A FIFO queue of k copy engines (and, when k > 1, one wire behind them) whose state is the engines'
    next-free times (a heap) and the wire's next-free time. Copies are issued in nondecreasing env.now and a
    FIFO k-server queue starts its customers in arrival order, at start = max(now, earliest engine free); the
    wire is asked for at start + overhead, nondecreasing too, so it also serves copies in issue order:
    wire = max(start + overhead, wire free), end = wire + (duration - overhead). A copy can therefore be
    *reserved* when it is issued (`reserve` returns its end): the same start and end times, float for float,
    as `ResourceChannel`'s request -> timeout -> release, without any event. A waiter needs one timeout to
    the end (`transfer`, `start`), or none (an async offload nobody waits for, a recall folded into the
    compute after it: engine.sequence). Busy time, bytes and the timeline span are recorded at issue.
    """

    def __init__(self, env: simpy.Environment, name: str, engines: int, timeline: Timeline | None = None):
        self.env, self.name, self.timeline = env, name, timeline
        self.n_engines = engines
        self.engine_free_s = [0.0] * engines  # a heap: when each copy engine is next free
        self.wire_free_s = 0.0  # engines > 1: when the wire is next free
        self.overhead_s: float | None = None  # engines > 1: the one per-copy overhead of this channel
        # Per direction ("h2d", "d2h"): sum of transfer durations, bytes moved, end of the last transfer.
        self.busy_s = {"h2d": 0.0, "d2h": 0.0}
        self.bytes = {"h2d": 0.0, "d2h": 0.0}
        self.last_end_s = {"h2d": 0.0, "d2h": 0.0}

    def reserve(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float,
                label: str = "copy") -> float:
        """Queue one copy of `n_bytes` issued now, taking `duration_s` = overhead + bytes / bandwidth when it
        has the channel to itself; returns the time it ends."""
        now = self.env.now
        free = self.engine_free_s
        start = free[0]
        if now > start:
            start = now
        if self.n_engines == 1:
            end = start + duration_s
            free[0] = end
        else:
            if self.overhead_s is None:
                self.overhead_s = overhead_s
            elif overhead_s != self.overhead_s:  # wire requests would not come in issue order
                raise ValueError(f"{self.name}: copies on a channel with several engines must share one overhead")
            wire = start + overhead_s
            if self.wire_free_s > wire:
                wire = self.wire_free_s
            end = wire + (duration_s - overhead_s)
            self.wire_free_s = end
            heapq.heapreplace(free, end)
        self.busy_s[direction] += duration_s
        self.bytes[direction] += n_bytes
        if end > self.last_end_s[direction]:
            self.last_end_s[direction] = end
        if self.timeline is not None:
            self.timeline.span(self.name, label, start, end, bytes=int(n_bytes))
        return end

    # The schedule's interface (schedule.StepSchedule): issue a copy now, get a token for its end.
    issue = reserve

    def transfer(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float, label: str = "copy"):
        """A SimPy process body: one copy, waited for (one timeout to its end)."""
        end = self.reserve(direction, n_bytes, duration_s, overhead_s, label)
        yield self.env.timeout(end - self.env.now)

    def start(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float, label: str = "copy",
              notify: bool = True) -> simpy.Event | None:
        """Issue a copy; returns an event that fires when it is done (None when `notify` is off: an async
        offload nobody waits for, which then costs no event at all)."""
        end = self.reserve(direction, n_bytes, duration_s, overhead_s, label)
        return self.env.timeout(end - self.env.now) if notify else None


class ResourceChannel:
    """The reference for `Channel`: the same FIFO link as SimPy Resources and events (kept for the tests).

    A channel's copy engines are a Resource (capacity = engines); a transfer holds one engine for
    overhead + bytes / bandwidth. With more than one engine the bytes also hold the wire (a capacity-1
    Resource) for bytes / bandwidth only, so extra engines overlap setup costs, never bandwidth.
    """

    def __init__(self, env: simpy.Environment, name: str, engines: int, timeline: Timeline | None = None):
        self.env, self.name, self.timeline = env, name, timeline
        self.n_engines = engines
        self.engines = simpy.Resource(env, capacity=engines)
        self.wire = simpy.Resource(env, capacity=1) if engines > 1 else None
        self.busy_s = {"h2d": 0.0, "d2h": 0.0}
        self.bytes = {"h2d": 0.0, "d2h": 0.0}
        self.last_end_s = {"h2d": 0.0, "d2h": 0.0}

    def transfer(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float, label: str = "copy"):
        """A SimPy process body: one copy of `n_bytes` taking `duration_s` = overhead + bytes / bandwidth
        when it has the channel to itself."""
        env = self.env
        with self.engines.request() as engine:
            yield engine
            start = env.now
            if self.wire is None:
                yield env.timeout(duration_s)
            else:
                yield env.timeout(overhead_s)
                with self.wire.request() as wire:
                    yield wire
                    yield env.timeout(duration_s - overhead_s)
        self._finished(direction, n_bytes, duration_s, start, label)

    def start(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float, label: str = "copy",
              notify: bool = True) -> simpy.Event | None:
        """Issue a copy without a process of its own: request -> (granted) timeout -> (elapsed) release as event
        callbacks, through the wire when there is one; returns an event that fires when it is done, or None
        when not `notify`. The engine is requested here, so copies queue in the order they are issued (as
        `transfer`'s, and as `Channel`'s). (The engine used to run a wired copy as a process, which requested
        its engine only when the process started: a copy issued right after it in the same instant went first.)
        """
        env = self.env
        done = env.event() if notify else None
        request = self.engines.request()

        def granted(_event) -> None:
            start = env.now

            def elapsed(_event, wire=None) -> None:
                if wire is not None:
                    self.wire.release(wire)
                self.engines.release(request)
                self._finished(direction, n_bytes, duration_s, start, label)
                if done is not None:
                    done.succeed()

            def set_up(_event) -> None:
                wire = self.wire.request()
                wire.callbacks.append(
                    lambda _e: env.timeout(duration_s - overhead_s).callbacks.append(lambda e: elapsed(e, wire)))

            if self.wire is None:
                env.timeout(duration_s).callbacks.append(elapsed)
            else:
                env.timeout(overhead_s).callbacks.append(set_up)

        request.callbacks.append(granted)
        return done

    def issue(self, direction: str, n_bytes: float, duration_s: float, overhead_s: float, label: str = "copy"):
        """The schedule's interface (schedule.StepSchedule): an event that fires when the copy is done."""
        return self.start(direction, n_bytes, duration_s, overhead_s, label)

    def _finished(self, direction: str, n_bytes: float, duration_s: float, start_s: float, label: str) -> None:
        self.busy_s[direction] += duration_s
        self.bytes[direction] += n_bytes
        self.last_end_s[direction] = max(self.last_end_s[direction], self.env.now)
        if self.timeline is not None:
            self.timeline.span(self.name, label, start_s, self.env.now, bytes=int(n_bytes))


class Hardware:
    """The shared resources of one simulated machine (`channel`: `Channel`, or `ResourceChannel` in tests)."""

    def __init__(self, env: simpy.Environment, profile: HardwareProfile, timeline: Timeline | None = None,
                 channel: type = Channel):
        self.env, self.profile, self.timeline = env, profile, timeline
        self.gpu = simpy.Resource(env, capacity=1)
        engines = engines_per_channel(profile)
        if profile.link.full_duplex:
            self.h2d = channel(env, "link H2D", engines, timeline)
            self.d2h = channel(env, "link D2H", engines, timeline)
        else:
            self.h2d = self.d2h = channel(env, "link (half duplex)", engines, timeline)


def sequence(env: simpy.Environment, hw: Hardware, work: Workload, overlap: str, async_offload: bool,
             step_end_s: np.ndarray, track: str = "GPU", lean: bool = True):
    """The process of one sequence (or one lockstep batch of `work.batch` copies of it): per step, hold the GPU
    and run schedule.StepSchedule (recall -> compute -> offload per operation).

    Two shortcuts give the same times for the common cases (`lean=False` turns them off; the tests compare):
    a step with nothing to wait for or issue is one timeout, and one sequence without prefetch or timeline on
    counter channels (the hierarchy replay's hot path) runs the schedule inline on plain lists.
    """
    per_step = work.ops_per_step
    copies = work.batch
    prefetch = overlap == "layer-prefetch"
    timeline = hw.timeline
    h2d, d2h = hw.h2d, hw.d2h
    recall_overhead_s, offload_overhead_s = work.recall_overhead_s, work.offload_overhead_s
    compute2 = work.compute_s.reshape(work.n_steps, per_step)
    recall2 = work.recall_s.reshape(work.n_steps, per_step)
    offload2 = work.offload_s.reshape(work.n_steps, per_step)
    has_transfer = ((recall2 > 0).any(1) | (offload2 > 0).any(1)).tolist()
    if prefetch:  # the next step's first recall is issued during this step's last operation
        has_transfer[:-1] = (np.array(has_transfer[:-1]) | (recall2[1:, 0] > 0)).tolist()
    step_compute = compute2.sum(1).tolist()
    inline = lean and not prefetch and copies == 1 and timeline is None and isinstance(h2d, Channel)
    if inline:
        compute = work.compute_s.tolist()
        recall = work.recall_s.tolist()
        offload = work.offload_s.tolist()
        recall_bytes = work.recall_bytes.tolist()
        offload_bytes = work.offload_bytes.tolist()
    else:
        schedule = StepSchedule(env, hw, prefetch, async_offload, recall_overhead_s, offload_overhead_s)
        members = list(range(copies))

        def per_member(a: np.ndarray) -> np.ndarray:
            return np.broadcast_to(a, (copies, per_step))

        recall_bytes2 = work.recall_bytes.reshape(work.n_steps, per_step)
        offload_bytes2 = work.offload_bytes.reshape(work.n_steps, per_step)
        following2 = np.append(work.recall_s[1:], 0.0).reshape(work.n_steps, per_step)
        following_bytes2 = np.append(work.recall_bytes[1:], 0.0).reshape(work.n_steps, per_step)
    timeout = env.timeout
    lead_s, host_s = work.host.lead_s, work.host.step_s  # the host model (costs.host_times; 0, 0 without)

    for s in range(work.n_steps):
        gpu = hw.gpu.request()
        yield gpu
        host_start_s = env.now  # the previous token is out: the host starts issuing this step
        if lead_s:
            yield timeout(lead_s)
        if lean and not has_transfer[s] and timeline is None and (inline or not schedule.pending):
            yield timeout(step_compute[s])  # nothing to wait for or issue: the whole step at once
        elif inline:
            # schedule.StepSchedule.run for one member, on lists, without prefetch (the DES's hot path)
            t = env.now
            for i in range(s * per_step, (s + 1) * per_step):
                r = recall[i]
                if r > 0:
                    now = env.now
                    if t > now:
                        yield timeout(t - now)
                    t = h2d.reserve("h2d", recall_bytes[i], r, recall_overhead_s, "recall")  # ends >= now = t
                t += compute[i]
                o = offload[i]
                if o > 0:
                    now = env.now
                    if t > now:
                        yield timeout(t - now)
                    end = d2h.reserve("d2h", offload_bytes[i], o, offload_overhead_s, "offload")
                    if not async_offload:
                        t = end
            if t > env.now:
                yield timeout(t - env.now)
        else:
            yield from schedule.run(
                compute2[s].tolist(), per_member(recall2[s]), per_member(recall_bytes2[s]), per_member(offload2[s]),
                per_member(offload_bytes2[s]), members, members, following_s=per_member(following2[s]),
                following_bytes=per_member(following_bytes2[s]), op_offset=s * per_step, track=track, step=s, n_layers=work.n_layers)
        if host_s and env.now < host_start_s + host_s:  # the token is out once the host has issued every op
            yield timeout(host_start_s + host_s - env.now)
        hw.gpu.release(gpu)
        step_end_s[s] = env.now


def run_des(work: Workload, profile: HardwareProfile, overlap: str = "none", async_offload: bool = True,
            timeline: Timeline | None = None, lean: bool = True) -> Timing:
    """Simulate one sample (or one lockstep batch of it) alone on a machine (`lean`: see `sequence`)."""
    env = simpy.Environment()
    hw = Hardware(env, profile, timeline)
    step_end_s = np.zeros(work.n_steps)
    env.process(sequence(env, hw, work, overlap, async_offload, step_end_s, lean=lean))
    env.run()  # runs until the offload backlog is drained too
    return Timing(step_end_s=step_end_s, h2d_busy_s=hw.h2d.busy_s["h2d"], d2h_busy_s=hw.d2h.busy_s["d2h"],
                  last_d2h_end_s=hw.d2h.last_end_s["d2h"], h2d_bytes=hw.h2d.bytes["h2d"],
                  d2h_bytes=hw.d2h.bytes["d2h"])
