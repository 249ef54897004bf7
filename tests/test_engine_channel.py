"""The counter-based link (engine.Channel) against its reference, the same FIFO queue as SimPy Resources
(engine.ResourceChannel): random contended copy patterns, the engine's sequence process before and after,
and the serving simulation on either channel. Every time, busy time, byte count and timeline slice agrees."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import simpy

from hwprofiles import load_profile
from simulator import serving
from simulator.costs import ModelShape
from simulator.engine import Channel, Hardware, ResourceChannel, Timeline, run_des
from simulator.options import SimOptions
from simulator.workload import StepArrays, Timing, Workload, build_workload
from traces.manifest import model_manifest

REL = 1e-12


def link_variant(profile, full_duplex: bool, copy_engines: int, **numbers):
    return dataclasses.replace(profile, link=dataclasses.replace(profile.link, full_duplex=full_duplex,
                                                                 copy_engines=copy_engines, **numbers))


# ---------------------------------------------------------------- the channel alone -----------------------


def drive(channel_class, seed: int):
    """Several processes issue copies on one channel (both directions, as on a half-duplex link) at random
    times: waited for inside the process (`transfer`), through `start` and waited for (alone or a group issued
    at once), or fire-and-forget. Returns the channel, what each process saw, and the timeline's copy slices.

    Every copy moves bytes, as in the simulator: a copy of nothing through a wire would end in the same
    instant as the one before it, and two processes woken in one instant may issue their next copies in
    either order (SimPy orders simultaneous events by how they were scheduled, which differs between the two)."""
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    timeline = Timeline()
    engines = int(rng.integers(1, 4))
    channel = channel_class(env, "link", engines, timeline)
    overhead_s = float(rng.choice([0.0, rng.uniform(1e-6, 20e-6)]))
    rate = float(rng.uniform(5e9, 60e9))
    seen: dict[str, list[float]] = {}

    def process(name: str, proc_rng: np.random.Generator):
        woke = seen.setdefault(name, [])
        for k in range(int(proc_rng.integers(3, 15))):
            gap = proc_rng.choice([0.0, proc_rng.exponential(20e-6)])
            if gap:
                yield env.timeout(gap)
            group = int(proc_rng.choice([1, 1, 2, 3]))
            sizes = np.where(proc_rng.random(group) < 0.1, proc_rng.integers(1, 16, group),  # a few tiny ones
                             proc_rng.integers(1, 2**22, group))
            direction = str(proc_rng.choice(["h2d", "d2h"]))
            mode = str(proc_rng.choice(["transfer", "start", "fire"]))
            labels = [f"{name} copy {k}.{j}" for j in range(group)]
            durations = [overhead_s + float(b) / rate for b in sizes]
            if mode == "transfer":
                for label, b, d in zip(labels, sizes, durations):
                    yield from channel.transfer(direction, float(b), d, overhead_s, label)
                    woke.append(env.now)
            elif mode == "start":
                events = [channel.start(direction, float(b), d, overhead_s, label)
                          for label, b, d in zip(labels, sizes, durations)]
                yield events[0] if group == 1 else env.all_of(events)
                woke.append(env.now)
            else:
                for label, b, d in zip(labels, sizes, durations):
                    assert channel.start(direction, float(b), d, overhead_s, label, notify=False) is None

    for p in range(int(rng.integers(1, 5))):
        env.process(process(f"p{p}", np.random.default_rng([seed, p])))
    env.run()
    slices = {e["name"]: (e["ts"], e["dur"], e["args"]["bytes"]) for e in timeline.events if e["ph"] == "X"}
    # A copy nobody waits for is no event on counters: the link is busy until its last copy ends anyway.
    return channel, seen, slices, max(env.now, *channel.last_end_s.values())


@pytest.mark.parametrize("seed", range(80))
def test_counter_channel_equals_resource_channel(seed):
    counters, seen, slices, end = drive(Channel, seed)
    resources, seen_ref, slices_ref, end_ref = drive(ResourceChannel, seed)
    assert seen.keys() == seen_ref.keys()
    for name in seen:
        np.testing.assert_allclose(seen[name], seen_ref[name], rtol=REL, atol=0)
    assert slices.keys() == slices_ref.keys() and len(slices) > 0
    for label, (ts, dur, n_bytes) in slices.items():
        ts_ref, dur_ref, bytes_ref = slices_ref[label]
        assert ts == pytest.approx(ts_ref, rel=REL, abs=1e-9) and dur == pytest.approx(dur_ref, rel=REL, abs=1e-9)
        assert n_bytes == bytes_ref
    for direction in ("h2d", "d2h"):
        assert counters.busy_s[direction] == pytest.approx(resources.busy_s[direction], rel=REL)
        assert counters.bytes[direction] == resources.bytes[direction]
        assert counters.last_end_s[direction] == pytest.approx(resources.last_end_s[direction], rel=REL)
    assert end == pytest.approx(end_ref, rel=REL)


def _ends_of_copies_issued_together(channel_class, copies: int) -> tuple[list[float], float]:
    env = simpy.Environment()
    channel = channel_class(env, "x", 2)
    ends = []
    for event in [channel.start("h2d", 1, 3.0, 1.0) for _ in range(copies)]:
        event.callbacks.append(lambda _event: ends.append(env.now))
    env.run()
    return ends, channel.busy_s["h2d"]


@pytest.mark.parametrize("channel_class", [Channel, ResourceChannel])
def test_copies_issued_together_on_two_engines_share_the_wire(channel_class):
    """Two engines, three copies (1 s setup + 2 s of bytes) at t=0: engine 1 sets up 0..1 and sends 1..3,
    engine 2 sets up 0..1 and sends 3..5, the third copy gets engine 1 at 3, sets up 3..4 and sends 5..7."""
    assert _ends_of_copies_issued_together(channel_class, 3) == ([3.0, 5.0, 7.0], 9.0)


def test_a_fire_and_forget_copy_costs_no_event():
    env = simpy.Environment()
    channel = Channel(env, "x", 1)
    assert channel.start("d2h", 10, 2.0, 0.5, notify=False) is None
    assert channel.reserve("d2h", 10, 2.0, 0.5) == 4.0  # queued behind the first
    assert len(env._queue) == 0
    env.run()
    assert channel.last_end_s["d2h"] == 4.0 and channel.bytes["d2h"] == 20


# ---------------------------------------------------------------- the engine's sequence process -----------


def _reference_copies(env: simpy.Environment, channel: ResourceChannel, direction: str, copies: int, n_bytes: float,
            duration_s: float, overhead_s: float, label: str, notify: bool = True):
    """`copies` identical transfers issued at once (one per sequence of a lockstep batch); the event of their
    completion (None when not `notify`)."""
    done = [channel.start(direction, n_bytes, duration_s, overhead_s, label, notify) for _ in range(copies)]
    if not notify:
        return None
    return done[0] if copies == 1 else env.all_of(done)


def reference_sequence(env: simpy.Environment, hw: Hardware, work: Workload, overlap: str, async_offload: bool,
             step_end_s: np.ndarray, track: str = "GPU"):
    """engine.sequence as it was before the counter channels, kept verbatim as the reference: one event per wait."""
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
                        yield _reference_copies(env, hw.h2d, "h2d", copies, recall_bytes[0], recall[0],
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
                        pending_recall = _reference_copies(env, hw.h2d, "h2d", copies, recall_bytes[nxt], recall[nxt],
                                                 work.recall_overhead_s, timeline and f"recall op {nxt}")
                elif recall[i] > 0:
                    if busy:
                        yield env.timeout(busy)
                        busy = 0.0
                    if copies == 1:  # waited for at once: run it inside this process (no extra events)
                        yield from hw.h2d.transfer("h2d", recall_bytes[i], recall[i], work.recall_overhead_s,
                                                   timeline and f"recall op {i}")
                    else:
                        yield _reference_copies(env, hw.h2d, "h2d", copies, recall_bytes[i], recall[i],
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
                        _reference_copies(env, hw.d2h, "d2h", copies, offload_bytes[i], offload[i], work.offload_overhead_s,
                                timeline and f"offload op {i}", notify=False)
                    elif copies == 1:
                        yield from hw.d2h.transfer("d2h", offload_bytes[i], offload[i], work.offload_overhead_s,
                                                   timeline and f"offload op {i}")
                    else:
                        yield _reference_copies(env, hw.d2h, "d2h", copies, offload_bytes[i], offload[i],
                                      work.offload_overhead_s, timeline and f"offload op {i}")
            if busy:
                yield env.timeout(busy)
        hw.gpu.release(gpu)
        step_end_s[s] = env.now


def reference_run(hw_profile, works: list[Workload], overlap: str, async_offload: bool, timeline, new: bool):
    """`works` as sequences sharing one machine (their own GPU tracks), with the current or the reference
    process and channel; one Timing per sequence (the link counters are the machine's)."""
    from simulator.engine import sequence

    env = simpy.Environment()
    hw = Hardware(env, hw_profile, timeline, channel=Channel if new else ResourceChannel)
    ends = [np.zeros(w.n_steps) for w in works]
    process = sequence if new else reference_sequence
    for k, (work, end) in enumerate(zip(works, ends)):
        env.process(process(env, hw, work, overlap, async_offload, end, track=f"GPU {k}"))
    env.run()
    return [Timing(step_end_s=end, h2d_busy_s=hw.h2d.busy_s["h2d"], d2h_busy_s=hw.d2h.busy_s["d2h"],
                   last_d2h_end_s=hw.d2h.last_end_s["d2h"], h2d_bytes=hw.h2d.bytes["h2d"],
                   d2h_bytes=hw.d2h.bytes["d2h"]) for end in ends]


SHAPE = ModelShape.from_manifest(model_manifest("tiny"))


def random_workload(rng, profile, batch: int) -> Workload:
    n_steps, n_layers = int(rng.integers(2, 10)), int(rng.integers(1, 5))
    prompt = int(rng.integers(1, 300))
    query = np.ones((n_steps, n_layers))
    query[0] = prompt
    attended = prompt + np.arange(n_steps)[:, None] + np.zeros((1, n_layers))
    block = 16 * SHAPE.kv_bytes_per_token // SHAPE.n_layers
    recall_p, offload_p = rng.random(), rng.random()
    h2d = np.where(rng.random((n_steps, n_layers)) < recall_p, rng.integers(1, 200, (n_steps, n_layers)) * block, 0)
    d2h = np.where(rng.random((n_steps, n_layers)) < offload_p, rng.integers(1, 200, (n_steps, n_layers)) * block, 0)
    if rng.random() < 0.5:
        h2d[0] = 0
    steps = StepArrays(query_tokens=query, hbm_tokens=attended, recalled_tokens=0 * attended, bytes_h2d=h2d,
                       bytes_d2h=d2h, hbm_kv_bytes=attended, ddr_kv_bytes=attended)
    return build_workload("s", SHAPE, profile, steps, batch=batch)


def gpu_and_copy_slices(timeline: Timeline) -> list[tuple]:
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in timeline.events if e["name"] == "thread_name"}
    return sorted((names[e["pid"], e["tid"]], e["name"], e["ts"], e["dur"], e.get("args", {}).get("bytes"))
                  for e in timeline.events if e["ph"] == "X")


@pytest.mark.parametrize("seed", range(60))
def test_sequence_process_equals_the_reference(seed):
    """The engine's process (own clock, counter channels) against the one it replaced (one event per wait,
    Resources): every overlap / offload mode, full and half duplex, 1..4 engines per channel, lockstep batches,
    and one to three sequences contending for the GPU and the link."""
    rng = np.random.default_rng(seed)
    profile = link_variant(load_profile("h100-pcie"), bool(rng.integers(2)), int(rng.integers(1, 5)),
                           h2d_bytes_per_s=float(rng.uniform(1e9, 60e9)),
                           d2h_bytes_per_s=float(rng.uniform(1e9, 60e9)),
                           transfer_overhead_s=float(rng.choice([0.0, rng.uniform(0, 50e-6)])))
    overlap = str(rng.choice(["none", "layer-prefetch"]))
    async_offload = bool(rng.integers(2))
    batch = int(rng.choice([1, 1, 2, 3]))
    works = [random_workload(rng, profile, batch) for _ in range(int(rng.choice([1, 1, 2, 3])))]
    record = bool(rng.integers(2))
    timelines = [Timeline() if record else None for _ in range(2)]
    for timeline in timelines:
        if timeline is not None:
            timeline.begin_process("machine")
    new = reference_run(profile, works, overlap, async_offload, timelines[0], new=True)
    old = reference_run(profile, works, overlap, async_offload, timelines[1], new=False)
    for a, b in zip(new, old):
        np.testing.assert_allclose(a.step_end_s, b.step_end_s, rtol=REL, atol=0)
        for name in ("h2d_busy_s", "d2h_busy_s", "last_d2h_end_s"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=REL)
        assert a.h2d_bytes == b.h2d_bytes and a.d2h_bytes == b.d2h_bytes
    if record:
        mine, theirs = gpu_and_copy_slices(timelines[0]), gpu_and_copy_slices(timelines[1])
        assert [s[:2] + s[4:] for s in mine] == [s[:2] + s[4:] for s in theirs]
        np.testing.assert_allclose([s[2:4] for s in mine], [s[2:4] for s in theirs], rtol=REL, atol=1e-9)


def test_run_des_is_the_single_sequence_case():
    profile = load_profile("h100-pcie")
    work = random_workload(np.random.default_rng(7), profile, 1)
    (old,) = reference_run(profile, [work], "none", True, None, new=False)
    np.testing.assert_allclose(run_des(work, profile, "none", True).step_end_s, old.step_end_s, rtol=REL, atol=0)


# ---------------------------------------------------------------- serving on either channel ---------------


@pytest.fixture(scope="module")
def hierarchy_run(tmp_path_factory):
    from simulator.synth import synth_run

    return synth_run(tmp_path_factory.mktemp("synth") / "hier", model="tiny", prompt_tokens=64, decode_steps=30,
                     policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score", samples=3)


@pytest.mark.parametrize("full_duplex,engines", [(True, 2), (True, 6), (False, 1), (False, 3)])
@pytest.mark.parametrize("overlap,async_offload,batch_copies", [("none", True, False), ("none", False, False),
                                                                ("layer-prefetch", True, False),
                                                                ("layer-prefetch", False, True)])
def test_serving_is_the_same_on_either_channel(hierarchy_run, monkeypatch, full_duplex, engines, overlap,
                                               async_offload, batch_copies):
    profile = link_variant(load_profile("h100-pcie"), full_duplex, engines, h2d_bytes_per_s=2e9,
                           d2h_bytes_per_s=2e9)  # a slow link: requests queue for it
    config = serving.ServingConfig(rate_per_s=400, duration_s=0.3, max_batch=8, batch_copies=batch_copies, seed=3,
                                   options=SimOptions(overlap=overlap, async_offload=async_offload))
    counters = serving.simulate_serving(hierarchy_run, profile, config)
    monkeypatch.setattr(serving, "Hardware", functools.partial(Hardware, channel=ResourceChannel))
    resources = serving.simulate_serving(hierarchy_run, profile, config)
    assert counters.summary["n_completed"] > 50
    assert counters.summary.keys() == resources.summary.keys()
    for key, value in counters.summary.items():
        if isinstance(value, float):
            assert value == pytest.approx(resources.summary[key], rel=REL, nan_ok=True), key
        else:
            assert value == resources.summary[key], key
    numeric = counters.requests.select_dtypes("number").columns
    np.testing.assert_allclose(counters.requests[numeric].to_numpy(float), resources.requests[numeric].to_numpy(float),
                               rtol=REL, atol=1e-15)
    np.testing.assert_allclose(counters.tbt_s, resources.tbt_s, rtol=REL, atol=0)

