"""Serving simulation: closed-form checks on constructed traces (queueing theory, capacity arithmetic) and the
one-request case against the single-sequence engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwprofiles import OverheadSpec, load_profile
from simulator import costs
from simulator.lengths import csv_classes, read_arrivals_csv
from simulator.options import SimOptions
from simulator.serving import ServingConfig, ServingError, load_run_work, simulate_serving
from traces import TraceWriter, make_manifest, model_manifest, open_run


def write_constructed_run(run_dir: Path, samples: list[dict], n_layers: int = 2, arch: str = "tiny",
                          budget: float = 0.3) -> Path:
    """A trace v1 run whose per-step bytes are given directly: each sample dict has prompt_tokens, n_steps and
    per-(step, layer) scalars h2d_bytes, d2h_bytes, hbm_kv_bytes, ddr_kv_bytes (constant over the sample)."""
    model = model_manifest(arch)
    model["kv_bytes_per_token"] = model["kv_bytes_per_token"] // model["n_layers"] * n_layers
    model["n_layers"] = n_layers
    manifest = make_manifest(
        kind="synthetic", model=model,
        task={"name": "constructed", "source": "tests", "split": "test",
              "sample_ids": [f"s{i}" for i in range(len(samples))]},
        policy={"name": "hierarchy", "hbm_budget": budget, "evict_ratio": 0.0, "block_size": 16,
                "scorer": "mass", "recall_k": 4, "recall_rule": "topk", "sink_tokens": 4, "window_tokens": 32,
                "params": {}},
        hardware={"device": "none", "torch": None, "cuda": None, "transformers": None}, seed=0, access=False,
    )
    writer = TraceWriter(run_dir, manifest)
    for i, s in enumerate(samples):
        n_steps, prompt = s["n_steps"], s["prompt_tokens"]
        step = np.repeat(np.arange(n_steps), n_layers)
        n = len(step)
        logical = prompt + step

        def col(value, dtype=np.int64, n=n):
            return np.full(n, value, dtype=dtype)

        rows = {
            "step": step.astype(np.int32), "layer": np.tile(np.arange(n_layers), n_steps).astype(np.int16),
            "query_tokens": np.where(step == 0, prompt, 1).astype(np.int32), "logical_len": logical.astype(np.int32),
            "hbm_tokens": logical.astype(np.int32), "ddr_tokens": col(0, np.int32),
            "evicted_tokens": col(0, np.int32), "recalled_tokens": col(0, np.int32),
            "hbm_blocks": (-(-logical // 16)).astype(np.int32), "ddr_blocks": col(0, np.int32),
            "evicted_blocks": col(0, np.int32),
            **{c: [[] for _ in range(n)] for c in ("recalled_block_ids", "promoted_block_ids",
                                                   "offloaded_block_ids", "evicted_block_ids")},
            "bytes_h2d": col(s.get("h2d_bytes", 0)), "bytes_d2h": col(s.get("d2h_bytes", 0)),
            "hbm_kv_bytes": col(s.get("hbm_kv_bytes", 0)), "ddr_kv_bytes": col(s.get("ddr_kv_bytes", 0)),
            "mass_hbm": col(1.0, np.float32), "mass_ddr": col(0.0, np.float32),
        }
        positions = np.arange(prompt + n_steps)
        tokens = {
            "position": positions.astype(np.int32), "token_id": np.zeros(len(positions), np.int32),
            "is_prompt": positions < prompt, "importance": np.zeros(len(positions), np.float32),
            "importance_max": np.zeros(len(positions), np.float32),
            "importance_by_layer": [[0.0] * n_layers for _ in positions],
            "final_tier_by_layer": [[0] * n_layers for _ in positions],
        }
        writer.write_sample({"sample_id": f"s{i}", "prompt_tokens": prompt, "generated_tokens": n_steps,
                             "stop_reason": "max_new_tokens", "wall_s": 0.0, "nonfinite": False}, rows, tokens)
    return run_dir


def weight_bytes(run: Path) -> int:
    return costs.ModelShape.from_manifest(open_run(run).manifest["model"]).weight_bytes


def link_bound_profile(engines_per_direction: int = 1, hbm_capacity_bytes: int | None = None,
                       transfer_overhead_s: float = 0.0):
    """h100-pcie with (practically) infinite compute and HBM bandwidth and no GPU overheads: only the host
    link takes time, so queueing on it can be checked against closed forms."""
    base = load_profile("h100-pcie")
    gpu = dataclasses.replace(base.gpu, hbm_peak_bytes_per_s=1e30, matmul_peak_flops_per_s=1e30,
                              hbm_capacity_bytes=hbm_capacity_bytes or base.gpu.hbm_capacity_bytes)
    link = dataclasses.replace(base.link, copy_engines=2 * engines_per_direction, full_duplex=True,
                               transfer_overhead_s=transfer_overhead_s)
    return dataclasses.replace(base, gpu=gpu, link=link, overheads=OverheadSpec(0.0, 0.0))


def write_arrivals(path: Path, times: list[float], output_tokens: int, prompt_tokens: int = 8) -> Path:
    lines = ["arrival_s,prompt_tokens,output_tokens"] + [f"{t!r},{prompt_tokens},{output_tokens}" for t in times]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- queueing on the link -----------------------


@pytest.mark.parametrize("engines,batch_copies", [(1, False), (8, False), (1, True)])
@pytest.mark.parametrize("n_requests", [1, 2, 4, 8])
def test_saturated_link_tbt_grows_as_the_queue_predicts(tmp_path, n_requests, engines, batch_copies):
    """n requests each recall B bytes before every layer, compute is free: the copies of one layer queue on the
    H2D channel. One copy engine serialises whole copies: TBT = L * n * (o + B/BW). With at least n engines the
    setups o overlap and only the wire is shared: TBT = L * (o + n * B/BW); so does one batched copy."""
    n_layers, recall_bytes, overhead_s = 2, 4_000_000, 10e-6
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 20, "h2d_bytes": recall_bytes,
                                                    "hbm_kv_bytes": 1000}], n_layers=n_layers)
    profile = link_bound_profile(engines, transfer_overhead_s=overhead_s)
    arrivals = write_arrivals(tmp_path / "a.csv", [0.0] * n_requests, output_tokens=20)
    result = simulate_serving(run, profile, ServingConfig(arrivals_csv=str(arrivals), max_batch=64,
                                                          batch_copies=batch_copies))
    wire_s = recall_bytes / costs.offload_tier(profile).h2d_bytes_per_s
    serial = engines == 1 and not batch_copies
    per_layer_s = n_requests * (overhead_s + wire_s) if serial else overhead_s + n_requests * wire_s
    assert result.tbt_s.size == n_requests * 19
    np.testing.assert_allclose(result.tbt_s, n_layers * per_layer_s, rtol=1e-9)
    queued_s = result.requests["link_wait_s"].sum()
    # Copies that share the link wait for each other; one batched copy waits for nothing.
    assert queued_s > 1e-6 if n_requests > 1 and not batch_copies else queued_s == pytest.approx(0.0, abs=1e-12)


def lindley_mean_wait(arrivals_s: np.ndarray, service_s: float) -> float:
    """Exact FIFO single-server waits on this very arrival sequence: W[n+1] = max(0, W[n] + D - gap[n])."""
    waits = np.zeros(len(arrivals_s))
    for n in range(1, len(arrivals_s)):
        waits[n] = max(0.0, waits[n - 1] + service_s - (arrivals_s[n] - arrivals_s[n - 1]))
    return float(waits.mean())


def test_poisson_arrivals_on_the_link_match_md1(tmp_path):
    """Poisson arrivals, one deterministic recall each, one copy engine, compute free: the link is an M/D/1
    queue. A request's wait = admission delay + time its copy queued for the engine. Its mean must equal
    (a) Lindley's recursion on the same arrival times (exact, 1e-6) and (b) rho / (2 mu (1 - rho)) within 4%
    (20,000 requests at rho = 0.5: the sampling error of the mean is ~1.5%)."""
    recall_bytes = 2_000_000
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 1, "h2d_bytes": recall_bytes,
                                                    "hbm_kv_bytes": 1000}], n_layers=1)
    profile = link_bound_profile(engines_per_direction=1)
    service_s = recall_bytes / costs.offload_tier(profile).h2d_bytes_per_s
    rho = 0.5
    rate_per_s = rho / service_s
    config = ServingConfig(rate_per_s=rate_per_s, duration_s=20_000 / rate_per_s, max_batch=1024, seed=3)
    result = simulate_serving(run, profile, config)
    requests = result.requests
    assert 19_000 < len(requests) < 21_000 and requests["finish_s"].notna().all()
    waits = requests["queue_delay_s"] + requests["link_wait_s"]
    assert waits.mean() == pytest.approx(lindley_mean_wait(requests["arrival_s"].to_numpy(), service_s), rel=1e-6)
    mu = 1.0 / service_s
    assert waits.mean() == pytest.approx(rho / (2 * mu * (1 - rho)), rel=0.04)
    assert result.summary["link_util_h2d"] == pytest.approx(rho, rel=0.03)


def test_littles_law_on_the_admission_queue(tmp_path):
    """HBM admits 3 requests at a time under a load that keeps a queue: time-average queue length L equals
    arrival rate x mean wait (L = lambda W) within 2%, with L integrated from the queue's trajectory and W from
    the requests' own timestamps."""
    peak_kv = 10_000_000
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 30, "h2d_bytes": 1_000_000,
                                                    "hbm_kv_bytes": peak_kv // 2}], n_layers=2)
    weights = weight_bytes(run)
    profile = link_bound_profile(hbm_capacity_bytes=weights + int(3.5 * peak_kv))
    service_s = 30 * 2 * 1_000_000 / costs.offload_tier(profile).h2d_bytes_per_s  # a request alone, link-bound
    result = simulate_serving(run, profile, ServingConfig(rate_per_s=0.9 / service_s, duration_s=400 * service_s,
                                                          max_batch=64, seed=1))
    s = result.summary
    assert s["max_concurrency"] == 3 and s["queue_delay_mean_s"] > 0
    assert s["littles_queue_length"] == pytest.approx(s["littles_arrival_rate_per_s"] * s["littles_mean_wait_s"],
                                                      rel=0.02)


# ---------------------------------------------------------------- admission ----------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(peaks=st.lists(st.integers(1, 40), min_size=1, max_size=4), capacity_units=st.integers(40, 120),
       rate_per_s=st.floats(20.0, 400.0), max_batch=st.integers(1, 16), seed=st.integers(0, 10))
def test_admission_never_exceeds_hbm_capacity(tmp_path_factory, peaks, capacity_units, rate_per_s, max_batch, seed):
    """Whatever the samples' footprints, load and batch limit: resident and reserved HBM (weights + KV) stay within
    capacity at every iteration, the batch limit holds, and every request is served."""
    unit = 1_000_000
    run = write_constructed_run(tmp_path_factory.mktemp("run") / "run", [
        {"prompt_tokens": 8, "n_steps": 5 + 3 * i, "h2d_bytes": 100_000, "hbm_kv_bytes": p * unit // 2}
        for i, p in enumerate(peaks)])
    weights = weight_bytes(run)
    profile = link_bound_profile(hbm_capacity_bytes=weights + capacity_units * unit)
    result = simulate_serving(run, profile, ServingConfig(rate_per_s=rate_per_s, duration_s=0.5, max_batch=max_batch,
                                                          seed=seed))
    timeline = result.timeline
    capacity = profile.gpu.hbm_capacity_bytes
    assert (timeline["hbm_bytes"] <= timeline["hbm_reserved_bytes"] + 1e-6).all()
    assert (timeline["hbm_reserved_bytes"] <= capacity).all()
    assert (timeline["running"] <= max_batch).all()
    assert result.requests["finish_s"].notna().all()


def test_admission_concurrency_is_capacity_over_peak(tmp_path):
    """Identical requests reserving P bytes each in K = 4.5 P of KV room: exactly 4 run at once; with a 30% budget
    (peak 0.3 P) 15 do — the arithmetic of "how many more requests does a smaller HBM budget admit"."""
    peak_kv = 8_000_000
    concurrency = {}
    for budget in (1.0, 0.3):
        run = write_constructed_run(tmp_path / f"run{budget}", [
            {"prompt_tokens": 8, "n_steps": 40, "h2d_bytes": 50_000, "hbm_kv_bytes": int(budget * peak_kv) // 2}],
            budget=budget)
        weights = weight_bytes(run)
        profile = link_bound_profile(hbm_capacity_bytes=weights + int(4.5 * peak_kv))
        arrivals = write_arrivals(tmp_path / "a.csv", [0.0] * 40, output_tokens=40)
        result = simulate_serving(run, profile, ServingConfig(arrivals_csv=str(arrivals), max_batch=256))
        concurrency[budget] = result.summary["max_concurrency"]
    assert concurrency == {1.0: 4, 0.3: 15}


def test_request_larger_than_hbm_is_rejected_not_run(tmp_path):
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 4, "hbm_kv_bytes": 10**9}])
    weights = weight_bytes(run)
    profile = link_bound_profile(hbm_capacity_bytes=weights + 10**9)  # needs 2e9 (2 layers x 1e9)
    arrivals = write_arrivals(tmp_path / "a.csv", [0.0, 1.0], output_tokens=4)
    result = simulate_serving(run, profile, ServingConfig(arrivals_csv=str(arrivals)))
    assert result.summary["n_rejected"] == 2 and result.summary["tokens"] == 0


# ---------------------------------------------------------------- arrival files and options ------------------


def test_azure_trace_csv_requests_replay_the_nearest_sample_at_their_own_lengths(tmp_path):
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 10},
                                                   {"prompt_tokens": 100, "n_steps": 50}])
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,90,20\n2023-11-16 18:15:46.1805900,5,400\n"
                   "2023-11-16 18:15:47.1805900,8,10\n")
    requests = read_arrivals_csv(csv)
    assert list(requests.arrival_s) == pytest.approx([0.0, 0.5, 1.0])
    classes, request_class = csv_classes(requests, open_run(run).samples()[["prompt_tokens", "generated_tokens"]])
    assert [classes[c] for c in request_class] == [(0, 5, 400), (1, 90, 20), (0, 8, 10)]
    # each request is served at the CSV's lengths: its prompt, its tokens, its KV at its own context
    served = simulate_serving(run, "h100-pcie", ServingConfig(arrivals_csv=str(csv))).requests
    assert list(zip(served["prompt_tokens"], served["tokens"])) == [(5, 400), (90, 20), (8, 10)]
    profile = load_profile("h100-pcie")
    works = load_run_work(run, profile, classes=classes)[2]
    traced = load_run_work(run, profile)[2]
    at_traced_lengths = works[classes.index((0, 8, 10))]  # the sample's own lengths: the sample unchanged
    for name in ("flops", "kv_read_bytes", "recall_bytes", "offload_bytes", "hbm_kv_bytes", "ddr_kv_bytes"):
        np.testing.assert_allclose(getattr(at_traced_lengths, name), getattr(traced[0], name), rtol=1e-12)


def test_bad_inputs_are_one_line_user_errors(tmp_path):
    run = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 3}])
    bad = tmp_path / "bad.csv"
    bad.write_text("when,prompt_tokens,output_tokens\n0,1,1\n")
    with pytest.raises(ServingError, match="no column for arrival_s"):
        simulate_serving(run, "h100-pcie", ServingConfig(arrivals_csv=str(bad)))
    with pytest.raises(ServingError, match="overlap"):
        simulate_serving(run, "h100-pcie", ServingConfig(options=SimOptions(overlap="sideways")))


# ---------------------------------------------------------------- one request = the single-sequence replay ---


@pytest.fixture(scope="module")
def synth_hierarchy_run(tmp_path_factory) -> Path:
    from simulator.synth import synth_run

    return synth_run(tmp_path_factory.mktemp("synth") / "hier", model="tiny", prompt_tokens=64, decode_steps=40,
                     policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score", samples=2)


def profile_variant(name: str):
    """A shipped profile by name, or "half-duplex": h100-pcie whose link carries one direction at a time."""
    if name != "half-duplex":
        return load_profile(name)
    base = load_profile("h100-pcie")
    return dataclasses.replace(base, name="h100-pcie-half-duplex",
                               link=dataclasses.replace(base.link, full_duplex=False))


@pytest.mark.parametrize("profile_name", ["h100-pcie", "gh200-96gb", "half-duplex"])
@pytest.mark.parametrize("overlap,async_offload", [("none", True), ("none", False), ("layer-prefetch", True),
                                                   ("layer-prefetch", False)])
@pytest.mark.parametrize("n_requests", [1, 3])
def test_simultaneous_requests_equal_the_engines_lockstep_batch(tmp_path, synth_hierarchy_run, profile_name,
                                                                 overlap, async_offload, n_requests):
    """One request alone: its token times are simulate_run's step end times for that sample (the
    single-sequence replay). n identical requests arriving together: they are simulate_run's lockstep
    `batch=n` (weights read once, KV and copies per sequence). The serving loop adds batching, not a new cost."""
    from simulator import simulate_run

    profile = profile_variant(profile_name)
    arrivals = write_arrivals(tmp_path / "one.csv", [0.0] * n_requests, output_tokens=41, prompt_tokens=64)
    config = ServingConfig(arrivals_csv=str(arrivals), options=SimOptions(overlap=overlap, async_offload=async_offload))
    served = simulate_serving(synth_hierarchy_run, profile, config)
    replay = simulate_run(synth_hierarchy_run, profile, SimOptions(overlap=overlap, async_offload=async_offload,
                                                                   batch=n_requests, engine="des"))
    for _, request in served.requests.iterrows():
        assert request["sample_id"] == "synth/0000"
        steps = replay.steps[replay.steps["sample_id"] == request["sample_id"]].sort_values("step")
        tbt = served.tbt_s[request["request"] * 40:(request["request"] + 1) * 40]
        token_times_s = request["first_token_s"] + np.concatenate([[0.0], np.cumsum(tbt)])
        np.testing.assert_allclose(token_times_s, np.cumsum(steps["latency_s"].to_numpy()), rtol=1e-9)
    assert served.summary["bytes_h2d"] == pytest.approx(
        replay.samples.set_index("sample_id").loc["synth/0000", "bytes_h2d"], rel=1e-12)


# ---------------------------------------------------------------- command line -------------------------------


def parse_serve_sim(argv: list[str]):
    import argparse

    from simulator import serving_cli

    parser = argparse.ArgumentParser(prog="thoughtkv serve-sim")
    serving_cli.add_arguments(parser)
    return serving_cli, parser.parse_args(argv)


def test_serve_sim_compares_runs_and_writes_tables_and_a_timeline(tmp_path, synth_hierarchy_run, capsys):
    import json

    import pandas as pd

    from simulator.synth import synth_run

    full = synth_run(tmp_path / "full", model="tiny", prompt_tokens=64, decode_steps=40, policy="full", samples=2)
    cli, args = parse_serve_sim([str(full), str(synth_hierarchy_run), "--profile", "h100-pcie", "--rate", "20",
                                 "--duration", "3", "--max-batch", "8", "--out", str(tmp_path / "out"),
                                 "--timeline", str(tmp_path / "t.json")])
    assert cli.run(args) == 0
    summary = pd.read_parquet(tmp_path / "out" / "serving_summary.parquet")
    assert list(summary["policy"]) == ["full", "hierarchy"] and (summary["max_concurrency"] <= 8).all()
    requests = pd.read_parquet(tmp_path / "out" / "serving_requests.parquet")
    assert len(requests) == summary["n_requests"].sum()
    # The CLI's progress bar steps the simulation in 1 s slices: the same schedule as one uninterrupted run.
    direct = simulate_serving(full, "h100-pcie", cli.serving_config(args))
    assert direct.summary == pytest.approx(summary.iloc[0].to_dict(), nan_ok=True)
    tracks = {e["args"]["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "GPU" in tracks
    assert "hierarchy" in capsys.readouterr().out


def test_serve_sim_refuses_bad_options_in_one_line(tmp_path, synth_hierarchy_run):
    cli, args = parse_serve_sim([str(synth_hierarchy_run), "--rate", "1"])
    with pytest.raises(ServingError, match="--profile"):
        cli.run(args)
    cli, args = parse_serve_sim([str(synth_hierarchy_run), "--profile", "h100-pcie", "--rate", "-1"])
    with pytest.raises(ServingError, match="--rate"):
        cli.run(args)
    full = write_constructed_run(tmp_path / "run", [{"prompt_tokens": 8, "n_steps": 3}])
    with pytest.raises(Exception, match="layer-prefetch"):  # recalls picked by the current query: no prefetch
        simulate_serving(full, "h100-pcie", ServingConfig(options=SimOptions(overlap="layer-prefetch"), rate_per_s=10, duration_s=1))
