"""Transfer mechanisms (simulator/mechanisms.py): closed forms per mechanism, the copy curve, profile checks,
property tests, and fast path == DES for every mechanism."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hwprofiles import load_profile
from hwprofiles.schema import CopyCurve
from simulator import costs, fastpath, mechanisms
from simulator.engine import run_des
from simulator.mechanisms import MECHANISMS, MechanismError, build_workload, get_mechanism
from simulator.workload import StepArrays
from simulator.workload import build_workload as base_workload
from traces.manifest import model_manifest

SHAPE = costs.ModelShape.from_manifest(model_manifest("qwen2-7b"))
KVPL = SHAPE.kv_bytes_per_token_layer
PROFILE = load_profile("h100-pcie")


def sample(n_steps=6, n_layers=SHAPE.n_layers, seed=0, recall_every=1):
    """Arrays [steps, layers] of a decode with a recall and an offload at most layer-steps."""
    rng = np.random.default_rng(seed)
    query = np.ones((n_steps, n_layers))
    query[0] = 64  # a short prefill
    hbm = np.repeat((64 + np.arange(n_steps))[:, None], n_layers, 1).astype(float)
    rec = rng.integers(0, 3, (n_steps, n_layers)).astype(float) * 16
    rec[::recall_every] = rec[::recall_every]
    off = rng.integers(0, 2, (n_steps, n_layers)).astype(float) * 16
    rec[0] = 0
    return dict(query_tokens=query, hbm_tokens=hbm, recalled_tokens=rec, bytes_h2d=rec * KVPL, bytes_d2h=off * KVPL,
                hbm_kv_bytes=(hbm + rec) * KVPL, ddr_kv_bytes=np.full((n_steps, n_layers), 320 * KVPL))


def work_for(name, arrays, profile=PROFILE, batch=1, overlap="none", async_offload=True, tier="ddr"):
    return build_workload(get_mechanism(name), "s", SHAPE, profile, StepArrays(**arrays), batch=batch, tier=tier,
                          overlap=overlap, async_offload=async_offload)


def one_op(query=1.0, hbm=1000.0, rec=0.0, off=0.0):
    """A one-step, one-layer sample (plus the LM head)."""
    a = np.array([[query]])
    return dict(query_tokens=a, hbm_tokens=np.array([[hbm]]), recalled_tokens=np.array([[rec]]),
                bytes_h2d=np.array([[rec * KVPL]]), bytes_d2h=np.array([[off * KVPL]]),
                hbm_kv_bytes=np.array([[(hbm + rec) * KVPL]]), ddr_kv_bytes=np.array([[1e6]]))


def shape_1layer():
    return dataclasses.replace(SHAPE, n_layers=1, kv_bytes_per_token=int(KVPL),
                               weight_bytes=int(SHAPE.layer_weight_bytes + SHAPE.head_weight_bytes),
                               n_params=int(SHAPE.layer_params + SHAPE.head_params))


def run_one(name, arrays, profile=PROFILE, shape=None, **kw):
    shape = shape or shape_1layer()
    steps = StepArrays(**{**arrays, "bytes_h2d": arrays["bytes_h2d"] * shape.kv_bytes_per_token_layer / KVPL})
    work = build_workload(get_mechanism(name), "s", shape, profile, steps, **kw)
    return work, run_des(work, profile, kw.get("overlap", "none"), kw.get("async_offload", True))


def roofline_s(shape, profile, flops, hbm_bytes):
    return max(flops / profile.gpu.matmul_flops_per_s, hbm_bytes / profile.gpu.hbm_bytes_per_s)


def kernels_s(shape, profile, tokens, attn_flops, attn_bytes):
    """A layer operation as its kernels run, written out: the GEMMs (2 P_layer T FLOPs, the layer's weights) and
    the attention each at its roofline, plus the small kernels' activation traffic (7h + 2(H + H_kv)d + 3I
    elements per token at SMALL_KERNEL_HBM_FRACTION of the HBM rate)."""
    from simulator.costs import SMALL_KERNEL_HBM_FRACTION
    from traces.architectures import dtype_bytes

    elements = 7 * shape.hidden_size + 2 * (shape.n_heads + shape.n_kv_heads) * shape.head_dim \
        + 3 * shape.intermediate_size
    small = tokens * elements * dtype_bytes(shape.dtype) / (profile.gpu.hbm_bytes_per_s * SMALL_KERNEL_HBM_FRACTION)
    return (roofline_s(shape, profile, 2 * shape.layer_params * tokens, shape.layer_weight_bytes)
            + roofline_s(shape, profile, attn_flops, attn_bytes) + small)


# ---------------------------------------------------------------- registry and checks ------------------------


def test_registry_is_static_and_complete():
    assert list(MECHANISMS) == ["dma-per-block", "dma-batched", "sm-copy", "zero-copy", "cpu-attention"]
    assert all(m.name == k and m.summary for k, m in MECHANISMS.items())


def test_unknown_mechanism_and_missing_parameter_are_one_line_errors():
    with pytest.raises(MechanismError, match="unknown --transfer 'dma'; use one of dma-per-block"):
        get_mechanism("dma")
    bare = load_profile("l40s")  # no transfer section
    for name in ("sm-copy", "zero-copy", "cpu-attention"):
        with pytest.raises(MechanismError, match=f"--transfer {name} needs transfer.* in profile l40s"):
            mechanisms.mechanism_for(name, bare)
    mechanisms.mechanism_for("dma-batched", bare)  # DMA needs nothing new


def test_dma_per_block_is_exactly_the_old_rule():
    arrays = sample(seed=3)
    new = work_for("dma-per-block", arrays)
    old = base_workload("s", SHAPE, PROFILE, StepArrays(**arrays))
    for field in ("compute_s", "recall_s", "offload_s", "recall_bytes", "offload_bytes", "step_hbm_kv_bytes"):
        assert np.array_equal(getattr(new, field), getattr(old, field)), field


# ---------------------------------------------------------------- closed forms -------------------------------


def test_one_copy_dma_and_sm_copy():
    n_bytes = 3 * 2**20
    ctx = mechanisms.context(PROFILE, SHAPE)
    link = PROFILE.link
    assert get_mechanism("dma-per-block").copy_s(ctx, "h2d", n_bytes) == pytest.approx(
        link.transfer_overhead_s + n_bytes / min(link.h2d_bytes_per_s, PROFILE.host.ddr_bytes_per_s), rel=1e-12)
    t = PROFILE.transfer
    assert get_mechanism("sm-copy").copy_s(ctx, "d2h", n_bytes) == pytest.approx(
        t.sm_copy_overhead_s + n_bytes / t.sm_copy_d2h_bytes_per_s, rel=1e-12)
    assert get_mechanism("sm-copy").copy_s(ctx, "h2d", 0) == 0.0


@pytest.mark.parametrize("batch", [2, 5])
def test_a_batch_of_copies_per_block_vs_batched(batch):
    """A lockstep batch of n with one recall of B before the only layer: per block n copies each o + B / r,
    batched one copy o + n B / r; the step = that + the layer + the LM head."""
    arrays = one_op(rec=64)
    shape = shape_1layer()
    b = 64 * shape.kv_bytes_per_token_layer
    o, r = PROFILE.link.transfer_overhead_s, PROFILE.link.h2d_bytes_per_s
    per_block, t1 = run_one("dma-per-block", arrays, batch=batch)
    batched, t2 = run_one("dma-batched", arrays, batch=batch)
    gpu = float(per_block.compute_s.sum())
    assert t1.total_s == pytest.approx(batch * (o + b / r) + gpu, rel=1e-12)
    assert t2.total_s == pytest.approx(o + batch * b / r + gpu, rel=1e-12)
    assert t1.h2d_bytes == t2.h2d_bytes == pytest.approx(batch * b)


def test_sm_copy_slows_the_operation_its_copy_runs_beside():
    """Step 0's offload after layer 0 (async) runs beside the LM head: head' = head + s min(d, head / (1 - s))."""
    arrays = one_op(off=256)
    work, timing = run_one("sm-copy", arrays, async_offload=True)
    plain, _ = run_one("dma-per-block", arrays, async_offload=True)
    s = PROFILE.transfer.sm_copy_sm_share
    d = float(work.offload_s[0])
    head = float(plain.compute_s[1])
    assert d == pytest.approx(PROFILE.transfer.sm_copy_overhead_s + 256 * KVPL / PROFILE.transfer.sm_copy_d2h_bytes_per_s)
    assert work.compute_s[1] == pytest.approx(head + s * min(d, head / (1 - s)), rel=1e-12)
    assert work.compute_s[0] == plain.compute_s[0]  # nothing ran beside layer 0
    assert timing.total_s == pytest.approx(float(plain.compute_s[0]) + float(work.compute_s[1]), rel=1e-12)
    sync, _ = run_one("sm-copy", arrays, async_offload=False)  # waited for: nothing overlaps, nothing slows
    assert np.array_equal(sync.compute_s, plain.compute_s)


def test_zero_copy_stages_nothing_and_reads_over_the_link():
    rec = 16384.0
    arrays = one_op(hbm=128, rec=rec)
    work, timing = run_one("zero-copy", arrays)
    shape = shape_1layer()
    k = shape.kv_bytes_per_token_layer
    assert timing.h2d_bytes == 0 and not work.recall_s.any()
    assert work.step_hbm_kv_bytes[0] == pytest.approx(128 * k)  # no staging buffer for the recalled tokens
    gpu = kernels_s(shape, PROFILE, 1, 4 * shape.n_heads * shape.head_dim * (128 + rec), (128 + 1) * k)
    t = PROFILE.transfer
    link = t.zero_copy_latency_s + rec * k / min(t.zero_copy_bytes_per_s, PROFILE.host.ddr_bytes_per_s)
    assert link > gpu  # a link-bound kernel: the point of the case
    assert work.compute_s[0] == pytest.approx(max(gpu, link), rel=1e-12)
    assert work.compute_only_s[0] + work.hbm_only_s[0] == pytest.approx(gpu, rel=1e-12)  # the excess is link stall


def test_cpu_attention_host_time():
    """op = GPU roofline over the HBM tokens + max(0, host path - GPU attention), host path =
    2 o + query / D2H + max(host FLOPs / host F, recalled bytes / DDR) + partial / H2D."""
    rec = 8192.0
    arrays = one_op(hbm=256, rec=rec)
    work, timing = run_one("cpu-attention", arrays)
    shape = shape_1layer()
    k = shape.kv_bytes_per_token_layer
    H, d = shape.n_heads, shape.head_dim
    gpu = kernels_s(shape, PROFILE, 1, 4 * H * d * 256, 257 * k)
    attn = max(4 * H * d * 256 / PROFILE.gpu.matmul_flops_per_s, 257 * k / PROFILE.gpu.hbm_bytes_per_s)
    host = max(4 * H * d * rec / PROFILE.transfer.host_attention_flops_per_s, rec * k / PROFILE.host.ddr_bytes_per_s)
    link = PROFILE.link
    path = 2 * link.transfer_overhead_s + H * d * 2 / link.d2h_bytes_per_s + host + H * (d * 2 + 8) / link.h2d_bytes_per_s
    assert path > attn
    assert work.compute_s[0] == pytest.approx(gpu + path - attn, rel=1e-12)
    assert timing.h2d_bytes == 0 and work.step_hbm_kv_bytes[0] == pytest.approx(256 * k)


# ---------------------------------------------------------------- the copy curve -----------------------------


def with_curve(profile, key, sizes, seconds):
    curve = CopyCurve(tuple(float(b) for b in sizes), tuple(float(t) for t in seconds))
    curves = tuple(c for c in profile.transfer.copy_curves if c[0] != key) + ((key, curve),)
    return dataclasses.replace(profile, transfer=dataclasses.replace(profile.transfer, copy_curves=curves))


def test_a_copy_curve_that_is_a_line_is_the_linear_model():
    link = PROFILE.link
    sizes = [4096, 2**20, 2**24, 2**28]
    for direction in ("h2d", "d2h"):
        rate = getattr(link, f"{direction}_bytes_per_s")
        line = [link.transfer_overhead_s + b / rate for b in sizes]
        curved = with_curve(PROFILE, f"{direction}_pinned", sizes, line)
        probe = np.array([0, 1, 100, 4096, 77777, 2**22 + 5, 2**28, 2**30])
        got = get_mechanism("dma-per-block").copy_s(mechanisms.context(curved, SHAPE), direction, probe)
        want = costs.transfer_s(probe, rate, link.transfer_overhead_s)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-18)
        assert mechanisms.curve_intercept_s(curved.transfer.curve(f"{direction}_pinned")) == pytest.approx(
            link.transfer_overhead_s, rel=1e-9)


def test_copy_curve_interpolates_between_measured_points():
    curved = with_curve(PROFILE, "h2d_pinned", [1000, 3000], [10e-6, 14e-6])
    ctx = mechanisms.context(curved, SHAPE)
    got = get_mechanism("dma-batched").copy_s(ctx, "h2d", np.array([1000, 2000, 3000, 5000]))
    np.testing.assert_allclose(got, [10e-6, 12e-6, 14e-6, 18e-6], rtol=1e-12)


# ---------------------------------------------------------------- properties ---------------------------------


def faster(profile, factor, sms=1.0):
    """The profile with every link and kernel rate x factor and the copy kernel's SM share / sms."""
    link = profile.link
    t = profile.transfer
    link = dataclasses.replace(link, h2d_bytes_per_s=link.h2d_bytes_per_s * factor,
                               d2h_bytes_per_s=link.d2h_bytes_per_s * factor,
                               h2d_peak_bytes_per_s=link.h2d_peak_bytes_per_s * factor,
                               d2h_peak_bytes_per_s=link.d2h_peak_bytes_per_s * factor)
    t = dataclasses.replace(t, sm_copy_h2d_bytes_per_s=t.sm_copy_h2d_bytes_per_s * factor,
                            sm_copy_d2h_bytes_per_s=t.sm_copy_d2h_bytes_per_s * factor,
                            zero_copy_bytes_per_s=t.zero_copy_bytes_per_s * factor,
                            sm_copy_sm_share=t.sm_copy_sm_share / sms)
    host = dataclasses.replace(profile.host, ddr_bytes_per_s=profile.host.ddr_bytes_per_s * factor)
    return dataclasses.replace(profile, link=link, transfer=t, host=host)


def step_ends_s(name, arrays, profile, overlap="none", async_offload=True, batch=1) -> np.ndarray:
    work = work_for(name, arrays, profile, batch=batch, overlap=overlap, async_offload=async_offload)
    return run_des(work, profile, overlap, async_offload).step_end_s


def total_s(name, arrays, profile, overlap="none", async_offload=True, batch=1) -> float:
    return float(step_ends_s(name, arrays, profile, overlap, async_offload, batch)[-1])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), factor=st.floats(1.0, 20.0), sms=st.floats(1.0, 8.0),
       name=st.sampled_from(list(MECHANISMS)), overlap=st.sampled_from(["none", "layer-prefetch"]),
       async_offload=st.booleans())
def test_a_faster_link_or_more_sms_never_makes_a_run_slower(seed, factor, sms, name, overlap, async_offload):
    arrays = sample(n_steps=4, n_layers=6, seed=seed)
    slow = step_ends_s(name, arrays, PROFILE, overlap, async_offload)
    fast = step_ends_s(name, arrays, faster(PROFILE, factor, sms), overlap, async_offload)
    assert (fast <= slow * (1 + 1e-12)).all()  # every step's token comes no later


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6), async_offload=st.booleans())
def test_dma_batched_never_slower_than_dma_per_block(seed, batch, async_offload):
    arrays = sample(n_steps=4, n_layers=6, seed=seed)
    per_block = total_s("dma-per-block", arrays, PROFILE, async_offload=async_offload, batch=batch)
    batched = total_s("dma-batched", arrays, PROFILE, async_offload=async_offload, batch=batch)
    assert batched <= per_block * (1 + 1e-12)


@pytest.mark.parametrize("name", list(MECHANISMS))
@pytest.mark.parametrize("overlap,async_offload", [("none", True), ("none", False), ("layer-prefetch", True),
                                                    ("layer-prefetch", False)])
def test_fast_path_equals_des_for_every_mechanism(name, overlap, async_offload):
    for seed in range(4):
        arrays = sample(n_steps=8, seed=seed)
        work = work_for(name, arrays, overlap=overlap, async_offload=async_offload)
        assert fastpath.applies(work, PROFILE, overlap, async_offload)
        fast = fastpath.run_fast(work, PROFILE, overlap, async_offload)
        des = run_des(work, PROFILE, overlap, async_offload)
        np.testing.assert_allclose(fast.step_end_s, des.step_end_s, rtol=1e-9, atol=0)
        assert fast.last_d2h_end_s == pytest.approx(des.last_d2h_end_s, rel=1e-9)
        assert fast.h2d_bytes == des.h2d_bytes and fast.d2h_bytes == des.d2h_bytes


def test_the_options_offer_exactly_the_registry():
    from simulator.options import TRANSFERS, SimOptions

    assert TRANSFERS == tuple(MECHANISMS)
    assert SimOptions(transfer="zero-copy").transfer == "zero-copy"


def test_simulate_run_records_the_mechanism_and_dma_per_block_is_unchanged(tmp_path):
    from simulator import simulate_run
    from simulator.options import SimOptions
    from simulator.synth import synth_run

    run = synth_run(tmp_path / "h", model="tiny", prompt_tokens=64, decode_steps=20, policy="hierarchy",
                    hbm_budget=0.3, recall_k=2, samples=1, access=False)
    results = {name: simulate_run(run, "gh200-96gb", SimOptions(transfer=name)).summary for name in MECHANISMS}
    assert all(r["transfer"] == name for name, r in results.items())
    base = results["dma-per-block"]
    assert results["dma-batched"]["total_s"] == base["total_s"]  # one sequence: one copy per layer-step either way
    assert results["zero-copy"]["bytes_h2d"] == 0 < base["bytes_h2d"]
    assert results["zero-copy"]["peak_hbm_bytes"] < base["peak_hbm_bytes"]  # no staging buffers
    with pytest.raises(MechanismError, match="needs transfer"):
        simulate_run(run, "l40s", SimOptions(transfer="sm-copy"))
