"""The discrete-event engine (SimPy): hardware as explicit resources, one process per sequence.

Hardware (`Hardware`):
- `gpu`: a Resource of capacity 1. A sequence (or a lockstep batch) holds it for a whole decode step: the
  step's kernels run back to back; waiting for a recall inside the step keeps the GPU idle (a link stall).
- the host link as `Channel`s: in full duplex one per direction (H2D, D2H), in half duplex one shared by both.
  A channel's copy engines are a Resource (capacity = engines); a transfer holds one engine for
  overhead + bytes / bandwidth. With more than one engine on a channel the bytes still share one wire (a
  Resource of capacity 1, held for bytes / bandwidth only), so extra engines overlap setup costs, never
  bandwidth.

A sequence process walks the Workload's operations (workload.py). Consecutive operations with nothing to
wait for or to issue in between are one timeout (their sum): other processes cannot observe the boundary,
and it keeps the event count per layer-step low. Overlap modes:

- `none`: recall, then compute (the recall is on the critical path);
- `layer-prefetch`: the recall for operation i+1 is issued when operation i starts computing, so it
  overlaps with it (valid only when the recall set is known before the step: recall_rule "score");
- `async_offload`: offloads are issued after an operation and not waited for (else the sequence waits).

A copy the sequence waits for at once runs inside its process (`yield from Channel.transfer`); one it does
not (async offload, prefetch) runs as event callbacks on the same Resources (`Channel.start`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from hwprofiles import HardwareProfile
from simulator.workload import Timing, Workload

OVERLAP_MODES = ("none", "layer-prefetch")


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
        Path(path).write_text(json.dumps(self.to_json()))


class Channel:
    """One direction of the host link (or both, half duplex): copy engines + the wire they share."""

    def __init__(self, env: simpy.Environment, name: str, engines: int, timeline: Timeline | None = None):
        self.env, self.name, self.timeline = env, name, timeline
        self.engines = simpy.Resource(env, capacity=engines)
        self.wire = simpy.Resource(env, capacity=1) if engines > 1 else None
        # Per direction ("h2d", "d2h"): sum of transfer durations, bytes moved, end of the last transfer.
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
        """Issue a copy without a process of its own; returns an event that fires when it is done (or None
        when `notify` is off: an async offload nobody waits for).

        Same Resource semantics as `transfer`, driven by event callbacks: request -> (granted) timeout ->
        (elapsed) release. It needs a third of the events of a process per copy, which is what keeps the DES
        fast when every layer-step moves blocks.
        """
        env = self.env
        done = env.event() if notify else None
        if self.wire is not None:  # the two-stage (engine, wire) copy stays a process
            process = env.process(self.transfer(direction, n_bytes, duration_s, overhead_s, label))
            return process if notify else None
        request = self.engines.request()

        def granted(_event) -> None:
            start = env.now

            def elapsed(_event) -> None:
                self.engines.release(request)
                self._finished(direction, n_bytes, duration_s, start, label)
                if done is not None:
                    done.succeed()

            env.timeout(duration_s).callbacks.append(elapsed)

        request.callbacks.append(granted)
        return done

    def _finished(self, direction: str, n_bytes: float, duration_s: float, start_s: float, label: str) -> None:
        self.busy_s[direction] += duration_s
        self.bytes[direction] += n_bytes
        self.last_end_s[direction] = max(self.last_end_s[direction], self.env.now)
        if self.timeline is not None:
            self.timeline.span(self.name, label, start_s, self.env.now, bytes=int(n_bytes))


class Hardware:
    """The shared resources of one simulated machine."""

    def __init__(self, env: simpy.Environment, profile: HardwareProfile, timeline: Timeline | None = None):
        self.env, self.profile, self.timeline = env, profile, timeline
        self.gpu = simpy.Resource(env, capacity=1)
        engines = engines_per_channel(profile)
        if profile.link.full_duplex:
            self.h2d = Channel(env, "link H2D", engines, timeline)
            self.d2h = Channel(env, "link D2H", engines, timeline)
        else:
            self.h2d = self.d2h = Channel(env, "link (half duplex)", engines, timeline)


def _copies(env: simpy.Environment, channel: Channel, direction: str, copies: int, n_bytes: float,
            duration_s: float, overhead_s: float, label: str, notify: bool = True):
    """`copies` identical transfers issued at once (one per sequence of a lockstep batch); the event of their
    completion (None when not `notify`)."""
    done = [channel.start(direction, n_bytes, duration_s, overhead_s, label, notify) for _ in range(copies)]
    if not notify:
        return None
    return done[0] if copies == 1 else env.all_of(done)


def sequence(env: simpy.Environment, hw: Hardware, work: Workload, overlap: str, async_offload: bool,
             step_end_s: np.ndarray, track: str = "GPU"):
    """The process of one sequence (or one lockstep batch of `work.batch` copies of it)."""
    compute = work.compute_s.tolist()
    recall = work.recall_s.tolist()
    offload = work.offload_s.tolist()
    recall_bytes = work.recall_bytes.tolist()
    offload_bytes = work.offload_bytes.tolist()
    per_step = work.ops_per_step
    copies = work.batch
    prefetch = overlap == "layer-prefetch"
    timeline = hw.timeline
    recalls = work.recall_s.reshape(work.n_steps, per_step) > 0
    offloads = work.offload_s.reshape(work.n_steps, per_step) > 0
    has_transfer = recalls.any(1) | offloads.any(1)
    if prefetch:  # the next step's first recall is issued during this step's last operation
        has_transfer[:-1] |= recalls[1:, 0]
    step_compute = work.compute_s.reshape(work.n_steps, per_step).sum(1).tolist()
    pending_recall = None  # layer-prefetch: the in-flight recall of the next operation
    # Copy labels (`timeline and f"..."`) are only formatted when a timeline records them: formatting one
    # per copy costs more than the copy's events.

    for s in range(work.n_steps):
        gpu = hw.gpu.request()
        yield gpu
        first = s * per_step
        if not has_transfer[s] and pending_recall is None and timeline is None:
            yield env.timeout(step_compute[s])  # nothing to wait for or issue: the whole step at once
        else:
            busy = 0.0  # compute not yet turned into a timeout
            for i in range(first, first + per_step):
                if prefetch:
                    if i == 0 and recall[0] > 0:  # nothing ran before it to hide it behind
                        yield _copies(env, hw.h2d, "h2d", copies, recall_bytes[0], recall[0],
                                      work.recall_overhead_s, "recall op 0")
                    if pending_recall is not None:
                        if busy:
                            yield env.timeout(busy)
                            busy = 0.0
                        yield pending_recall
                        pending_recall = None
                    nxt = i + 1
                    if nxt < len(recall) and recall[nxt] > 0:
                        if busy:
                            yield env.timeout(busy)
                            busy = 0.0
                        pending_recall = _copies(env, hw.h2d, "h2d", copies, recall_bytes[nxt], recall[nxt],
                                                 work.recall_overhead_s, timeline and f"recall op {nxt}")
                elif recall[i] > 0:
                    if busy:
                        yield env.timeout(busy)
                        busy = 0.0
                    if copies == 1:  # waited for at once: run it inside this process (no extra events)
                        yield from hw.h2d.transfer("h2d", recall_bytes[i], recall[i], work.recall_overhead_s,
                                                   timeline and f"recall op {i}")
                    else:
                        yield _copies(env, hw.h2d, "h2d", copies, recall_bytes[i], recall[i],
                                      work.recall_overhead_s, timeline and f"recall op {i}")
                if timeline is not None:
                    if busy:
                        yield env.timeout(busy)
                        busy = 0.0
                    start = env.now
                    yield env.timeout(compute[i])
                    layer = i - first
                    name = "lm_head" if layer == work.n_layers else f"layer {layer}"
                    timeline.span(track, name, start, env.now, step=s)
                else:
                    busy += compute[i]
                if offload[i] > 0:
                    if busy:
                        yield env.timeout(busy)
                        busy = 0.0
                    if async_offload:
                        _copies(env, hw.d2h, "d2h", copies, offload_bytes[i], offload[i], work.offload_overhead_s,
                                timeline and f"offload op {i}", notify=False)
                    elif copies == 1:
                        yield from hw.d2h.transfer("d2h", offload_bytes[i], offload[i], work.offload_overhead_s,
                                                   timeline and f"offload op {i}")
                    else:
                        yield _copies(env, hw.d2h, "d2h", copies, offload_bytes[i], offload[i],
                                      work.offload_overhead_s, timeline and f"offload op {i}")
            if busy:
                yield env.timeout(busy)
        hw.gpu.release(gpu)
        step_end_s[s] = env.now


def run_des(work: Workload, profile: HardwareProfile, overlap: str = "none", async_offload: bool = True,
            timeline: Timeline | None = None) -> Timing:
    """Simulate one sample (or one lockstep batch of it) alone on a machine."""
    env = simpy.Environment()
    hw = Hardware(env, profile, timeline)
    step_end_s = np.zeros(work.n_steps)
    env.process(sequence(env, hw, work, overlap, async_offload, step_end_s))
    env.run()  # runs until the offload backlog is drained too
    return Timing(step_end_s=step_end_s, h2d_busy_s=hw.h2d.busy_s["h2d"], d2h_busy_s=hw.d2h.busy_s["d2h"],
                  last_d2h_end_s=hw.d2h.last_end_s["d2h"], h2d_bytes=hw.h2d.bytes["h2d"],
                  d2h_bytes=hw.d2h.bytes["d2h"])
