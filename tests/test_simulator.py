"""The simulator against closed forms computed here from datasheet numbers and model shapes (not from
simulator.costs), and against the trace it replays (bytes, occupancy)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import simpy

from hwprofiles import load_profile
from simulator import SimOptions, simulate_run
from simulator.costs import ModelShape
from simulator.engine import Channel, Hardware, run_des
from simulator.fastpath import run_fast
from simulator.synth import synth_run
from simulator.workload import StepArrays, build_workload
from traces.architectures import get_architecture
from traces.manifest import model_manifest
from traces.reader import open_run


def with_link(profile, **link_fields):
    return dataclasses.replace(profile, link=dataclasses.replace(profile.link, **link_fields))


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200-sxm")


@pytest.fixture(scope="module")
def hierarchy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "hier"
    return synth_run(out, model="qwen2-1.5b", prompt_tokens=96, decode_steps=40, policy="hierarchy",
                     hbm_budget=0.4, evict_ratio=0.1, recall_k=3, samples=2, seed=3)


@pytest.fixture(scope="module")
def full_7b_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "full7b"
    return synth_run(out, model="qwen2-7b", prompt_tokens=256, decode_steps=16, policy="full", samples=1,
                     access=False)


# ---------------------------------------------------------------- link model ---------------------------------


def _transfer_end_times(profile, transfers):
    """Issue (direction, bytes) transfers at t=0 on a fresh machine; return their end times."""
    env = simpy.Environment()
    hw = Hardware(env, profile)
    ends = []
    overhead = profile.link.transfer_overhead_s

    def one(direction, n_bytes):
        channel, rate = (hw.h2d, profile.link.h2d_bytes_per_s) if direction == "h2d" else (
            hw.d2h, profile.link.d2h_bytes_per_s)
        yield env.process(channel.transfer(direction, n_bytes, overhead + n_bytes / rate, overhead))
        ends.append(env.now)

    for direction, n_bytes in transfers:
        env.process(one(direction, n_bytes))
    env.run()
    return sorted(ends)


def test_one_transfer_takes_overhead_plus_bytes_over_bandwidth(h200):
    n_bytes = 7 * 2**20
    (end,) = _transfer_end_times(h200, [("h2d", n_bytes)])
    # 7 us setup + 7 MiB at 53 GB/s (profile yaml: transfer_overhead 7 us, h2d_bandwidth 53 GB/s)
    assert end == pytest.approx(7e-6 + n_bytes / 53e9, rel=1e-12)


def test_full_duplex_overlaps_h2d_and_d2h_half_duplex_serialises(h200):
    n_bytes = 2**24
    one = 7e-6 + n_bytes / 53e9
    assert _transfer_end_times(h200, [("h2d", n_bytes), ("d2h", n_bytes)]) == pytest.approx([one, one])
    half = with_link(h200, full_duplex=False, copy_engines=1)
    assert _transfer_end_times(half, [("h2d", n_bytes), ("d2h", n_bytes)]) == pytest.approx([one, 2 * one])


def test_copy_engine_contention_serialises(h200):
    n_bytes = 2**22
    overhead, data = 7e-6, n_bytes / 53e9
    # h200: 2 engines = one per direction -> three H2D copies queue on one engine
    ends = _transfer_end_times(h200, [("h2d", n_bytes)] * 3)
    assert ends == pytest.approx([overhead + data, 2 * (overhead + data), 3 * (overhead + data)])
    # two engines per direction: setups overlap, the bytes still share one wire
    wide = with_link(h200, copy_engines=4)
    ends = _transfer_end_times(wide, [("h2d", n_bytes)] * 3)
    third = max(2 * overhead + data, overhead + 2 * data) + data
    assert ends == pytest.approx([overhead + data, overhead + 2 * data, third])


# ---------------------------------------------------------------- roofline and the anchor --------------------


def _roofline_step_s(arch, profile, attended_tokens: int, dtype_bytes: int = 2) -> float:
    """Independent reference: one decode step = per layer the GEMMs' max(FLOPs/F, weight bytes/B) + the
    attention's max(FLOPs/F, KV bytes/B) + the small kernels' activation bytes (7h + 2(H + H_kv)d + 3I elements
    per token) at SMALL_KERNEL_HBM_FRACTION of B, + the LM head, weights from shapes."""
    from simulator.costs import SMALL_KERNEL_HBM_FRACTION

    head_params = arch.vocab_size * arch.hidden_size
    layer_params = (arch.n_params() - head_params) / arch.n_layers
    kv_layer = 2 * arch.n_kv_heads * arch.head_dim * dtype_bytes
    flops_per_s = profile.gpu.matmul_peak_flops_per_s * profile.gpu.matmul_efficiency
    bytes_per_s = profile.gpu.hbm_peak_bytes_per_s * profile.gpu.hbm_efficiency
    gemm = max(2 * layer_params / flops_per_s, layer_params * dtype_bytes / bytes_per_s)
    attention = max(4 * arch.n_heads * arch.head_dim * attended_tokens / flops_per_s,
                    (attended_tokens + 1) * kv_layer / bytes_per_s)
    elements = 7 * arch.hidden_size + 2 * (arch.n_heads + arch.n_kv_heads) * arch.head_dim + 3 * arch.intermediate_size
    small = elements * dtype_bytes / (bytes_per_s * SMALL_KERNEL_HBM_FRACTION)
    head = max(2 * head_params / flops_per_s, head_params * dtype_bytes / bytes_per_s)
    return arch.n_layers * (gemm + attention + small) + head


@pytest.mark.parametrize("engine", ["des", "fast"])
def test_step_without_offload_equals_roofline_sum(full_7b_run, h200, engine):
    result = simulate_run(full_7b_run, h200, SimOptions(engine=engine))
    arch = get_architecture("qwen2-7b")
    steps = result.steps
    for step in (1, 8, 16):
        attended = 256 + step  # prompt + tokens generated before this step, incl. the new one
        expected = _roofline_step_s(arch, h200, attended)
        got = float(steps.loc[steps["step"] == step, "latency_s"].iloc[0])
        assert got == pytest.approx(expected, rel=1e-9)
    assert result.summary["link_stall_s"] == pytest.approx(0.0, abs=1e-12)


def test_7b_on_h200_is_at_or_above_the_weight_bandwidth_floor(full_7b_run, h200):
    """Anchor: decode of a 7B model is weight-bandwidth bound: 15.2 GB / (4.8 TB/s * 0.85) = 3.7 ms."""
    weight_bytes = get_architecture("qwen2-7b").weight_bytes("bfloat16")
    assert 15.0e9 < weight_bytes < 15.5e9
    floor_s = weight_bytes / (4.8e12 * 0.85)
    step_s = simulate_run(full_7b_run, h200).summary["ms_per_token"] / 1e3
    assert floor_s <= step_s <= 1.05 * floor_s  # KV of 272 tokens adds < 0.1 %; the stated factor is 1.05


def test_lockstep_batch_reads_weights_once(full_7b_run, h200):
    one = simulate_run(full_7b_run, h200, SimOptions(batch=1)).summary
    four = simulate_run(full_7b_run, h200, SimOptions(batch=4)).summary
    assert four["ms_per_token"] < 1.01 * one["ms_per_token"]  # bandwidth-bound: 4 sequences ~ free
    assert four["tokens_per_s"] > 3.9 * one["tokens_per_s"]
    arch = get_architecture("qwen2-7b")
    assert four["peak_hbm_bytes"] - one["peak_hbm_bytes"] == 3 * one["kv_hbm_bytes_per_seq"]
    assert one["kv_bytes_per_seq_full"] == (256 + 16) * arch.kv_bytes_per_token()


# ---------------------------------------------------------------- bytes and occupancy ------------------------


def test_bytes_simulated_equal_bytes_in_the_trace(hierarchy_run, h200):
    trace = open_run(hierarchy_run).steps(columns=["bytes_h2d", "bytes_d2h"])
    assert trace["bytes_h2d"].sum() > 0 and trace["bytes_d2h"].sum() > 0
    for engine, batch in (("des", 1), ("fast", 1), ("des", 3)):
        summary = simulate_run(hierarchy_run, h200, SimOptions(engine=engine, batch=batch)).summary
        assert summary["bytes_h2d"] == batch * trace["bytes_h2d"].sum()
        assert summary["bytes_d2h"] == batch * trace["bytes_d2h"].sum()


def test_peak_occupancy_is_weights_plus_resident_kv(hierarchy_run, h200):
    run = open_run(hierarchy_run)
    result = simulate_run(run, h200, SimOptions(batch=2))
    for row in result.samples.itertuples():
        steps = run.steps(row.sample_id, columns=["step", "hbm_kv_bytes", "ddr_kv_bytes"])
        per_step = steps.groupby("step")[["hbm_kv_bytes", "ddr_kv_bytes"]].sum()
        assert row.peak_hbm_bytes == run.manifest["model"]["weight_bytes"] + 2 * per_step["hbm_kv_bytes"].max()
        assert row.peak_ddr_bytes == 2 * per_step["ddr_kv_bytes"].max()
        assert row.peak_hbm_bytes <= h200.gpu.hbm_capacity_bytes and not row.hbm_overflow
        free = h200.gpu.hbm_capacity_bytes - run.manifest["model"]["weight_bytes"]
        assert row.max_concurrency_full == free // row.kv_bytes_per_seq_full
        assert row.max_concurrency_policy >= row.max_concurrency_full  # the budget keeps less KV in HBM


def test_overflow_is_reported_not_hidden(tmp_path):
    run = synth_run(tmp_path / "big", model="qwen2-32b", prompt_tokens=32, decode_steps=2, access=False)
    small = load_profile("rtx-4090")  # 24 GB of HBM for 65 GB of weights
    summary = simulate_run(run, small).summary
    assert summary["hbm_overflow"] and summary["peak_hbm_bytes"] > small.gpu.hbm_capacity_bytes
    assert summary["max_concurrency_full"] == 0


# ---------------------------------------------------------------- engines agree; modes behave ---------------


def _random_workload(rng, profile, n_steps=12, n_layers=4, batch=1):
    shape = ModelShape.from_manifest(model_manifest("tiny"))
    q = np.ones((n_steps, n_layers))
    q[0] = 64
    attended = 64 + np.arange(n_steps)[:, None] + np.zeros((1, n_layers))
    moves = rng.random((n_steps, n_layers)) < 0.5
    h2d = np.where(moves, rng.integers(1, 64, (n_steps, n_layers)) * 2**16, 0)
    d2h = np.where(rng.random((n_steps, n_layers)) < 0.4, rng.integers(1, 64, (n_steps, n_layers)) * 2**16, 0)
    h2d[0] = 0
    steps = StepArrays(query_tokens=q, hbm_tokens=attended, recalled_tokens=0 * attended, bytes_h2d=h2d,
                       bytes_d2h=d2h, hbm_kv_bytes=attended * 1e3, ddr_kv_bytes=attended * 1e3)
    return build_workload("s", shape, profile, steps, batch=batch)


@pytest.mark.parametrize("overlap", ["none", "layer-prefetch"])
def test_prefetch_hides_recall_behind_compute(h200, overlap):
    work = _random_workload(np.random.default_rng(0), h200)
    plain = run_des(work, h200, "none").total_s
    timed = run_des(work, h200, overlap).total_s
    assert timed <= plain + 1e-15
    assert run_fast(work, h200, overlap).total_s == pytest.approx(timed, rel=1e-12)


def test_sync_offload_is_never_faster_than_async(h200):
    work = _random_workload(np.random.default_rng(1), h200)
    assert run_des(work, h200, async_offload=False).total_s >= run_des(work, h200, async_offload=True).total_s


def test_batch_copies_queue_on_the_link(h200):
    work1 = _random_workload(np.random.default_rng(2), h200, batch=1)
    work3 = _random_workload(np.random.default_rng(2), h200, batch=3)
    one, three = run_des(work1, h200, async_offload=False), run_des(work3, h200, async_offload=False)
    stall1 = one.total_s - work1.compute_s.sum()
    stall3 = three.total_s - work3.compute_s.sum()
    assert stall3 == pytest.approx(3 * stall1, rel=1e-9)  # one engine per direction: copies serialise


def test_channel_busy_time_and_bytes(h200):
    env = simpy.Environment()
    channel = Channel(env, "x", 1)
    env.process(channel.transfer("h2d", 1000, 1.5, 0.5))
    env.run()
    assert channel.busy_s["h2d"] == 1.5 and channel.bytes["h2d"] == 1000 and math.isclose(env.now, 1.5)


def test_offload_tier_sets_copy_cost_and_capacity(hierarchy_run):
    profile = load_profile("h100-sxm-cxl")  # cxl-expander: 40 GB/s, +0.3 us, 512 GB (profile yaml)
    shape = ModelShape.from_manifest(model_manifest("tiny"))
    one = np.ones((1, 1))
    n_bytes = 2**20
    steps = StepArrays(query_tokens=one, hbm_tokens=one, recalled_tokens=one * 0, bytes_h2d=one * n_bytes,
                       bytes_d2h=one * 0, hbm_kv_bytes=one, ddr_kv_bytes=one)
    work = build_workload("s", shape, profile, steps, tier="cxl-expander")
    assert work.recall_s[0] == pytest.approx(7e-6 + 0.3e-6 + n_bytes / 40e9, rel=1e-12)
    ddr = simulate_run(hierarchy_run, profile).summary
    cxl = simulate_run(hierarchy_run, profile, SimOptions(offload_tier="cxl-expander")).summary
    assert cxl["ms_per_token"] > ddr["ms_per_token"] and cxl["bytes_h2d"] == ddr["bytes_h2d"]
    assert cxl["max_concurrency_ddr"] == 512e9 // cxl["kv_ddr_bytes_per_seq"]
