"""Property tests over random traces: the fast path equals the DES; a faster link never slows a run down."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwprofiles import load_profile
from hwprofiles.overhead_modes import apply_mode
from hwprofiles.schema import HostModel
from simulator.costs import ModelShape
from simulator.engine import run_des
from simulator.fastpath import applies, run_fast
from simulator.workload import StepArrays, build_workload
from traces.manifest import model_manifest

BASE = load_profile("h100-pcie")
SHAPE = ModelShape.from_manifest(model_manifest("tiny"))
# (overlap, async offload, full duplex, copy engines): every case the fast path claims to cover
FAST_CASES = [
    ("none", True, True, 2), ("none", False, True, 2), ("none", False, False, 1), ("none", False, False, 3),
    ("none", False, True, 6), ("layer-prefetch", True, True, 2), ("layer-prefetch", False, True, 2),
    ("layer-prefetch", False, False, 1), ("layer-prefetch", False, True, 4),
]


@st.composite
def random_trace(draw, max_steps=16, max_layers=5):
    """Trace-like arrays [steps, layers] of one sample: a prefill, then decode steps with random traffic."""
    n_steps = draw(st.integers(2, max_steps))
    n_layers = draw(st.integers(1, max_layers))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    prompt = int(rng.integers(1, 400))
    query = np.ones((n_steps, n_layers))
    query[0] = prompt
    attended = prompt + np.arange(n_steps)[:, None] - rng.integers(0, prompt, (n_steps, n_layers)) // 2
    block = 16 * SHAPE.kv_bytes_per_token // SHAPE.n_layers
    recall_p, offload_p = rng.random(), rng.random()
    h2d = np.where(rng.random((n_steps, n_layers)) < recall_p, rng.integers(1, 200, (n_steps, n_layers)) * block, 0)
    d2h = np.where(rng.random((n_steps, n_layers)) < offload_p, rng.integers(1, 200, (n_steps, n_layers)) * block, 0)
    h2d[0] = 0
    hbm = attended * block / 16
    return query, attended, h2d, d2h, hbm


def steps_of(trace) -> StepArrays:
    """A `random_trace` as StepArrays: every attended token resident, the KV in HBM and DDR both `hbm`."""
    query, attended, h2d, d2h, hbm = trace
    return StepArrays(query_tokens=query, hbm_tokens=attended, recalled_tokens=0 * attended, bytes_h2d=h2d,
                      bytes_d2h=d2h, hbm_kv_bytes=hbm, ddr_kv_bytes=hbm)


def link_variant(rng_draw, full_duplex: bool, copy_engines: int):
    h2d, d2h, overhead = rng_draw
    link = dataclasses.replace(BASE.link, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, transfer_overhead_s=overhead,
                               full_duplex=full_duplex, copy_engines=copy_engines)
    return dataclasses.replace(BASE, link=link)


link_numbers = st.tuples(st.floats(1e9, 60e9), st.floats(1e9, 60e9), st.floats(0.0, 50e-6))
# The host side of a step: none (kernel-only), the shipped modes (host-bound on this small model), or a host model
# scaled so that steps fall on both sides of max(host, GPU) (tiny's GPU decode step is ~26 us on h100-pcie).
host_models = st.one_of(st.none(), st.sampled_from(["hf-eager", "cuda-graphs"]),
                        st.tuples(st.floats(0.0, 2e-6), st.floats(0.0, 2e-4)))


def with_host(profile, host):
    if host is None or isinstance(host, str):
        return apply_mode(profile, host or "kernel-only")
    op_s, step_s = host
    return dataclasses.replace(profile, host_model=HostModel(36, 32, 14, op_s, step_s, "test"))


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=random_trace(), numbers=link_numbers, case=st.sampled_from(FAST_CASES), host=host_models)
def test_fast_path_equals_des(trace, numbers, case, host):
    """Under every overhead mode (the host model included), as well as without one."""
    overlap, async_offload, full_duplex, engines = case
    profile = with_host(link_variant(numbers, full_duplex, engines), host)
    work = build_workload("s", SHAPE, profile, steps_of(trace))
    assert applies(work, profile, overlap, async_offload)
    des = run_des(work, profile, overlap, async_offload)
    fast = run_fast(work, profile, overlap, async_offload)
    np.testing.assert_allclose(fast.step_end_s, des.step_end_s, rtol=1e-9, atol=0)
    assert fast.h2d_busy_s == pytest.approx(des.h2d_busy_s, rel=1e-9)
    assert fast.d2h_busy_s == pytest.approx(des.d2h_busy_s, rel=1e-9)
    assert fast.last_d2h_end_s == pytest.approx(des.last_d2h_end_s, rel=1e-9)
    assert fast.h2d_bytes == des.h2d_bytes and fast.d2h_bytes == des.d2h_bytes
    lean_off = run_des(work, profile, overlap, async_offload, lean=False)  # the DES's shortcuts, host model too
    np.testing.assert_allclose(lean_off.step_end_s, des.step_end_s, rtol=1e-12, atol=0)


# A lockstep batch: the cases with one copy engine per direction (its members' copies queue back to back on it)
BATCH_CASES = [case for case in FAST_CASES if (case[3] // 2 if case[2] else case[3]) == 1]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=random_trace(max_steps=10, max_layers=4), numbers=link_numbers, case=st.sampled_from(BATCH_CASES),
       host=host_models, batch=st.integers(2, 4), mechanism=st.sampled_from(["dma-per-block", "dma-batched"]))
def test_fast_path_equals_des_for_a_lockstep_batch(trace, numbers, case, host, batch, mechanism):
    """`--batch n` on one copy engine per direction: the n members' copies of an operation, back to back, are
    one copy of their summed time (per block, or one batched call split n ways)."""
    from simulator.mechanisms import build_workload as mechanism_workload
    from simulator.mechanisms import get_mechanism

    overlap, async_offload, full_duplex, engines = case
    profile = with_host(link_variant(numbers, full_duplex, engines), host)
    work = mechanism_workload(get_mechanism(mechanism), "s", SHAPE, profile, steps_of(trace), batch=batch,
                              overlap=overlap, async_offload=async_offload)
    assert applies(work, profile, overlap, async_offload)
    des = run_des(work, profile, overlap, async_offload)
    fast = run_fast(work, profile, overlap, async_offload)
    np.testing.assert_allclose(fast.step_end_s, des.step_end_s, rtol=1e-9, atol=0)
    assert fast.h2d_busy_s == pytest.approx(des.h2d_busy_s, rel=1e-9)
    assert fast.d2h_busy_s == pytest.approx(des.d2h_busy_s, rel=1e-9)
    assert fast.last_d2h_end_s == pytest.approx(des.last_d2h_end_s, rel=1e-9)
    assert fast.h2d_bytes == pytest.approx(des.h2d_bytes, rel=1e-12)
    assert fast.d2h_bytes == pytest.approx(des.d2h_bytes, rel=1e-12)
    wide = link_variant(numbers, True, 4)  # two engines per direction: their setups overlap, not a sum
    assert not applies(mechanism_workload(get_mechanism("dma-per-block"), "s", SHAPE, wide, steps_of(trace),
                                          batch=batch), wide, overlap, async_offload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=random_trace(max_steps=10, max_layers=4),
    numbers=link_numbers,
    speedup=st.floats(1.0, 20.0),
    overlap=st.sampled_from(["none", "layer-prefetch"]),
    async_offload=st.booleans(),
    full_duplex=st.booleans(),
    engines=st.integers(1, 4),
    batch=st.integers(1, 3),
)
def test_faster_link_never_makes_a_run_slower(trace, numbers, speedup, overlap, async_offload, full_duplex,
                                              engines, batch):
    h2d, d2h, overhead = numbers
    slow = link_variant(numbers, full_duplex, engines)
    fast = link_variant((h2d * speedup, d2h * speedup, overhead / speedup), full_duplex, engines)
    slow_work = build_workload("s", SHAPE, slow, steps_of(trace), batch=batch)
    fast_work = build_workload("s", SHAPE, fast, steps_of(trace), batch=batch)
    slow_s = run_des(slow_work, slow, overlap, async_offload).total_s
    fast_s = run_des(fast_work, fast, overlap, async_offload).total_s
    assert fast_s <= slow_s * (1 + 1e-12)
