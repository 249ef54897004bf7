"""The serving fast path (simulator/serving_fast.py) against the serving DES (simulator/serving.py), the
reference: the same summary, per-request table and occupancy timeline to 1e-9 on random serving cases (every
transfer mechanism, rates, HBM pressure, batch limits, link duplex and engines, overlap, offload, coalescing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from _helpers import assert_same

from hwprofiles import load_profile
from simulator.options import ServingConfig, SimOptions
from simulator.serving import simulate_serving


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from simulator.synth import synth_run

    root = tmp_path_factory.mktemp("fast")
    return {
        "hierarchy": synth_run(root / "hier", model="tiny", prompt_tokens=48, decode_steps=24, policy="hierarchy",
                               hbm_budget=0.3, recall_k=2, recall_rule="score", samples=3, access=False),
        "full": synth_run(root / "full", model="tiny", prompt_tokens=32, decode_steps=16, policy="full", samples=2,
                          access=False),
    }


def machine(kind: str, pressure: float | None, peak_kv_bytes: float):
    """h100-pcie, or it with a half-duplex link / 2 copy engines per direction; `pressure` shrinks HBM to the
    weights + that many of the largest requests' reservations (admission then queues)."""
    profile = load_profile("h100-pcie")
    if kind == "half-duplex":
        profile = dataclasses.replace(profile, name="half", link=dataclasses.replace(profile.link, full_duplex=False))
    elif kind == "4-engines":
        profile = dataclasses.replace(profile, name="four", link=dataclasses.replace(profile.link, copy_engines=4))
    if pressure is not None:
        from simulator.costs import ModelShape
        from traces.manifest import model_manifest

        weights = ModelShape.from_manifest(model_manifest("tiny")).weight_bytes
        gpu = dataclasses.replace(profile.gpu, hbm_capacity_bytes=int(weights + pressure * peak_kv_bytes))
        profile = dataclasses.replace(profile, gpu=gpu)
    return profile


def peak_kv(run) -> float:
    from traces import open_run

    steps = open_run(run).steps(columns=["sample_id", "step", "hbm_kv_bytes"])
    return float(steps.groupby(["sample_id", "step"])["hbm_kv_bytes"].sum().max())


TRANSFERS = ("dma-per-block", "dma-batched", "sm-copy", "zero-copy", "cpu-attention")


def cases(n: int = 30):
    rng = np.random.default_rng(17)
    out = []
    for i in range(n):
        run = "hierarchy" if i % 4 else "full"
        out.append(dict(
            run=run,
            machine=["h100-pcie", "half-duplex", "4-engines"][i % 3],
            pressure=[None, 1.5, 3.0][(i // 3) % 3],
            rate_per_s=float(rng.uniform(20, 400)),
            duration_s=float(rng.uniform(0.2, 1.0)),
            max_batch=int(rng.choice([2, 8, 64])),
            seed=int(rng.integers(0, 1000)),
            batch_copies=bool(rng.integers(0, 2)),
            overlap="layer-prefetch" if run == "hierarchy" and rng.integers(0, 2) else "none",
            async_offload=bool(rng.integers(0, 2)),
            transfer=TRANSFERS[i % len(TRANSFERS)],
            # the host side of an iteration: none, a shipped mode, or a host model near tiny's GPU step
            host=[None, "hf-eager", "cuda-graphs", (float(rng.uniform(0, 1e-6)), float(rng.uniform(0, 1e-4)))][
                (i // 2) % 4],
            # paged admission (preempting under pressure) with both preempt modes, or peak; chunked prefills
            # under a small token budget (prompts of 32 and 48 tokens) or vLLM's default
            admission="peak" if i % 5 == 4 else "paged",
            preempt=["recompute", "swap"][(i // 5) % 2],
            max_batched_tokens=[None, 20, 36][i % 3],
        ))
    return out


def with_host(profile, host):
    """The profile under an overhead mode (a name) or a scaled host model (op_s, step_s); None: as it is."""
    from hwprofiles.overhead_modes import apply_mode
    from hwprofiles.schema import HostModel

    if host is None or isinstance(host, str):
        return apply_mode(profile, host)
    return dataclasses.replace(profile, host_model=HostModel(36, 32, 14, host[0], host[1], "test"))


def simulate_serving_fast(run, profile, config):
    """serve-sim on the fast path (engine fast)."""
    return simulate_serving(run, profile, dataclasses.replace(config, options=dataclasses.replace(config.options,
                                                                                                engine="fast")))


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c['transfer']}-{c['run']}-{c['machine']}-{c['pressure']}"
                         f"-{c['overlap']}"
                         f"-{'async' if c['async_offload'] else 'sync'}-{'coalesced' if c['batch_copies'] else 'each'}"
                         f"-{c['host'] if not isinstance(c['host'], tuple) else 'host-model'}"
                         f"-{c['admission']}-{c['preempt']}-{c['max_batched_tokens']}")
def test_fast_path_equals_the_des(runs, case):
    run = runs[case["run"]]
    profile = with_host(machine(case["machine"], case["pressure"], peak_kv(run)), case["host"])
    budget = case["max_batched_tokens"]
    config = ServingConfig(rate_per_s=case["rate_per_s"], duration_s=case["duration_s"], max_batch=case["max_batch"],
                           seed=case["seed"], batch_copies=case["batch_copies"], admission=case["admission"],
                           preempt=case["preempt"], max_batched_tokens=None if budget is None else max(budget, case["max_batch"]),
                           options=SimOptions(overlap=case["overlap"], async_offload=case["async_offload"],
                                              transfer=case["transfer"]))
    des = simulate_serving(run, profile, dataclasses.replace(config, options=dataclasses.replace(config.options,
                                                                                             engine="des")))
    fast = simulate_serving_fast(run, profile, config)
    assert des.summary["n_requests"] > 3 and des.summary["tokens"] > 0
    assert_same(des.summary, fast.summary, "summary")
    pd.testing.assert_frame_equal(des.requests, fast.requests, rtol=1e-9, atol=1e-12)
    pd.testing.assert_frame_equal(des.timeline, fast.timeline, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(des.tbt_s, fast.tbt_s, rtol=1e-9, atol=1e-12)


def test_preemption_and_chunking_are_exercised(runs):
    """The random cases preempt, in both modes, and chunk prefills: the paged cases under HBM pressure preempt
    (recompute and swap), and a 20-token budget splits the 48-token prompts."""
    seen = {"recompute": 0, "swap": 0}
    for case in cases():
        if case["admission"] != "paged" or case["pressure"] is None or case["run"] != "hierarchy":
            continue
        run = runs[case["run"]]
        profile = machine(case["machine"], case["pressure"], peak_kv(run))
        budget = case["max_batched_tokens"]
        config = ServingConfig(rate_per_s=case["rate_per_s"], duration_s=case["duration_s"], max_batch=case["max_batch"],
                               seed=case["seed"], preempt=case["preempt"],
                               max_batched_tokens=None if budget is None else max(budget, case["max_batch"]))
        seen[case["preempt"]] += simulate_serving_fast(run, profile, config).summary["n_preemptions"]
    assert seen["recompute"] > 0 and seen["swap"] > 0
    chunked = simulate_serving_fast(runs["hierarchy"], "h100-pcie", ServingConfig(rate_per_s=50, duration_s=0.2,
                                                                                  max_batch=8, max_batched_tokens=20))
    whole = simulate_serving_fast(runs["hierarchy"], "h100-pcie", ServingConfig(rate_per_s=50, duration_s=0.2, max_batch=8))
    assert chunked.summary["ttft_p50_s"] > whole.summary["ttft_p50_s"]


def test_admission_pressure_is_exercised(runs):
    """The cases are not all trivially uncontended: with HBM for 2.5 requests' peaks, requests queue for admission
    (peak reservation: at most 2 run)."""
    run = runs["hierarchy"]
    profile = machine("h100-pcie", 2.5, peak_kv(run))
    config = ServingConfig(rate_per_s=300, duration_s=0.5, max_batch=64, admission="peak")
    fast = simulate_serving_fast(run, profile, config)
    assert fast.summary["max_concurrency"] <= 2 and fast.summary["queue_delay_p90_s"] > 0


def test_serve_sim_engine_auto_is_the_fast_path_and_des_stays_selectable(runs):
    run = runs["hierarchy"]
    config = ServingConfig(rate_per_s=100, duration_s=0.3)
    auto = simulate_serving(run, "h100-pcie", config)
    des = simulate_serving(run, "h100-pcie", dataclasses.replace(config, options=SimOptions(engine="des")))
    assert_same(des.summary, auto.summary, "auto vs des")



def test_ddr_full_spills_to_nvme_within_both_capacities(runs):
    """--offload-tier ddr+nvme with DDR for ~2 requests' offloaded KV: later requests spill to the NVMe tier
    (their copies at its rate and latency), neither tier's reservations ever exceed its capacity, the fast
    path equals the DES; with ample DDR nothing spills and the run is the plain DDR one."""
    from simulator import costs
    from simulator.serving import load_run_work

    run = runs["hierarchy"]
    profile = load_profile("h100-pcie")
    peak_ddr = max(w.peak_ddr_kv_bytes for w in load_run_work(run, profile)[2])
    small = dataclasses.replace(profile, host=dataclasses.replace(profile.host, ddr_capacity_bytes=int(2.5 * peak_ddr)))
    nvme = costs.offload_tier(small, "nvme")
    small = dataclasses.replace(small, extra_tiers=(dataclasses.replace(small.extra_tiers[0],
                                                                        capacity_bytes=int(3.5 * peak_ddr)),))
    config = ServingConfig(rate_per_s=400, duration_s=0.3, max_batch=64, options=SimOptions(offload_tier="ddr+nvme"))
    des = simulate_serving(run, small, dataclasses.replace(config, options=dataclasses.replace(config.options,
                                                                                              engine="des")))
    fast = simulate_serving(run, small, config)
    assert_same(des.summary, fast.summary, "spill")
    pd.testing.assert_frame_equal(des.requests, fast.requests, rtol=1e-9, atol=1e-12)
    summary, requests = fast.summary, fast.requests
    assert summary["spill_tier"] == "nvme" and 0 < summary["n_spilled"] < summary["n_requests"]
    assert (fast.timeline["ddr_reserved_bytes"] <= small.host.ddr_capacity_bytes * (1 + 1e-12)).all()
    served = requests[~requests["rejected"]]
    for tier_spilled, capacity in ((False, small.host.ddr_capacity_bytes), (True, 3.5 * peak_ddr)):
        rows = served[served["spilled"] == tier_spilled]
        for t in rows["admitted_s"]:  # at each admission, what that tier holds
            live = rows[(rows["admitted_s"] <= t) & (rows["finish_s"] > t)]
            assert live["peak_ddr_kv_bytes"].sum() <= capacity * (1 + 1e-12)
    slower = nvme.h2d_bytes_per_s < costs.offload_tier(small, "ddr").h2d_bytes_per_s
    assert slower and nvme.transfer_overhead_s > small.link.transfer_overhead_s
    ample = simulate_serving(run, profile, config)
    plain = simulate_serving(run, profile, dataclasses.replace(config, options=SimOptions()))
    assert ample.summary["n_spilled"] == 0
    assert ample.summary["end_s"] == plain.summary["end_s"] and ample.summary["tbt_p99_s"] == plain.summary["tbt_p99_s"]


def test_spill_chains_refused_where_not_modelled(runs):
    from simulator.errors import OptionError, ServingError
    from thoughtkv_base import UserError

    run = runs["hierarchy"]
    # A tier the profile lacks is the profile's problem (UserError); a chain the simulator does not model is
    # the serving options' (ServingError, an OptionError where it is the option's spelling).
    for offload_tier, transfer, error_type, match in (
            ("ddr+cxl", "dma-per-block", UserError, "no memory tier 'cxl'"),
            ("nvme+ddr", "dma-per-block", OptionError, "a spill chain is ddr\\+TIER"),
            ("ddr+nvme", "zero-copy", ServingError, "reads recalled blocks in place"),
            ("ddr+nvme", "dma-batched", ServingError, "would mix tiers")):
        with pytest.raises(error_type, match=match):
            simulate_serving(run, "h100-pcie", ServingConfig(rate_per_s=50, duration_s=0.1, options=SimOptions(
                offload_tier=offload_tier, transfer=transfer)))


def test_simulate_spills_a_sample_that_does_not_fit_in_ddr(runs):
    """simulate --offload-tier ddr+nvme: a sample whose offloaded KV exceeds DDR runs from the NVMe tier (the
    same times as --offload-tier nvme), nothing overflows, and the capacity counts both tiers."""
    from simulator import simulate_run

    run = runs["hierarchy"]
    profile = load_profile("h100-pcie")
    base = simulate_run(run, profile).summary
    per_seq = base["kv_ddr_bytes_per_seq"]
    small = dataclasses.replace(profile, host=dataclasses.replace(profile.host, ddr_capacity_bytes=int(per_seq // 2)))
    spilled = simulate_run(run, small, SimOptions(offload_tier="ddr+nvme")).summary
    in_nvme = simulate_run(run, small, SimOptions(offload_tier="nvme")).summary
    only_ddr = simulate_run(run, small, SimOptions(offload_tier="ddr")).summary
    assert only_ddr["ddr_overflow"] and not spilled["ddr_overflow"]
    assert spilled["total_s"] == in_nvme["total_s"] > base["total_s"]  # NVMe copies are slower than DDR's
    nvme_capacity = small.extra_tiers[0].capacity_bytes
    assert spilled["max_concurrency_ddr"] == int(nvme_capacity // per_seq)  # DDR holds none of them
    ample = simulate_run(run, profile, SimOptions(offload_tier="ddr+nvme")).summary
    assert ample["total_s"] == base["total_s"]
    assert ample["max_concurrency_ddr"] == base["max_concurrency_ddr"] + int(nvme_capacity // per_seq)
