"""The host model (simulator/costs.py `host_times`): a step costs max(lead + GPU, host) in the DES and the fast
path alike, and every result row, table and serving summary names the overhead mode and its host term."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from hwprofiles import load_profile
from hwprofiles.overhead_modes import apply_mode, load_mode
from hwprofiles.schema import HostModel
from simulator import SimOptions, simulate_run
from simulator.costs import NO_HOST, ModelShape, host_times
from simulator.engine import run_des
from simulator.fastpath import run_fast
from simulator.workload import StepArrays, build_workload
from traces.manifest import model_manifest


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from simulator.synth import synth_run

    return synth_run(tmp_path_factory.mktemp("host") / "full", model="tiny", prompt_tokens=40, decode_steps=12,
                     policy="full", samples=1, access=False)


def test_host_times_follow_the_mode_figures():
    shape = ModelShape.from_manifest(model_manifest("qwen2-7b"))
    eager = apply_mode(load_profile("h200-sxm"), "hf-eager")
    spec = load_mode("hf-eager")
    host = host_times(shape, eager)
    assert host.step_s == pytest.approx((28 * spec.ops_per_layer + spec.ops_per_step) * spec.op_s)
    assert host.lead_s == pytest.approx(spec.lead_ops * spec.op_s)
    graphs = host_times(shape, apply_mode(load_profile("h200-sxm"), "cuda-graphs"))
    assert graphs.lead_s == graphs.step_s == load_mode("cuda-graphs").step_s
    assert host_times(shape, load_profile("h200-sxm")) == NO_HOST  # kernel-only: no host model


@pytest.mark.parametrize("op_s", [0.0, 2e-8, 2e-7, 2e-6])  # GPU-bound, near the crossover, host-bound
def test_a_step_without_copies_costs_max_of_lead_plus_gpu_and_host(op_s):
    """Independent of the engines: the formula on the workload's own per-step GPU time."""
    shape = ModelShape.from_manifest(model_manifest("tiny"))
    profile = dataclasses.replace(load_profile("h100-pcie"), host_model=HostModel(36, 32, 14, op_s, 1e-6, "test"))
    steps, layers = 6, shape.n_layers
    query = np.ones((steps, layers))
    query[0] = 40
    attended = 40 + np.arange(steps)[:, None] * np.ones((1, layers))
    zeros = np.zeros((steps, layers))
    work = build_workload("s", shape, profile, StepArrays(query_tokens=query, hbm_tokens=attended, recalled_tokens=zeros,
                                                          bytes_h2d=zeros, bytes_d2h=zeros,
                                                          hbm_kv_bytes=attended * 1.0, ddr_kv_bytes=zeros))
    gpu = work.compute_s.reshape(steps, -1).sum(1)
    host = host_times(shape, profile)
    expected = np.maximum(host.lead_s + gpu, host.step_s)
    for timing in (run_des(work, profile), run_des(work, profile, lean=False), run_fast(work, profile)):
        np.testing.assert_allclose(np.diff(np.concatenate([[0.0], timing.step_end_s])), expected, rtol=1e-12)


def test_result_rows_and_the_console_table_name_the_mode_and_host_term(full_run, tmp_path, capsys):
    from thoughtkv.cli import main

    eager = simulate_run(full_run, "h100-sxm", SimOptions(overhead_mode="hf-eager"))
    row = eager.summary
    assert (row["overhead_mode"], row["host_term"]) == ("hf-eager", "cited")
    assert row["host_s"] == pytest.approx(row["steps"] * host_times(ModelShape.from_manifest(model_manifest("tiny")),
                                                                      apply_mode(load_profile("h100-sxm"),
                                                                                 "hf-eager")).step_s)
    parts = row["compute_s"] + row["hbm_s"] + row["overhead_s"] + row["link_stall_s"]
    assert parts == pytest.approx(row["total_s"], rel=1e-9) and row["overhead_s"] > 0.9 * row["total_s"]
    kernel = simulate_run(full_run, "h100-sxm").summary
    assert (kernel["overhead_mode"], kernel["host_term"], kernel["host_s"]) == ("kernel-only", "none", 0.0)
    assert main(["simulate", str(full_run), "--profile", "h100-sxm", "--overhead-mode", "cuda-graphs",
                 "--out", str(tmp_path / "sim")]) == 0
    assert "cuda-graphs (cited)" in capsys.readouterr().out
    rows = pd.read_parquet(tmp_path / "sim" / "results.parquet")
    assert set(rows["overhead_mode"]) == {"cuda-graphs"} and set(rows["host_term"]) == {"cited"}


def test_serve_sim_summary_names_the_mode_and_host_term(full_run, tmp_path, capsys):
    """The summary CSV's overhead_mode was NaN (the option left unset): it is now the mode charged, resolved."""
    from thoughtkv.cli import main

    for argv, mode, term in (([], "kernel-only", "none"), (["--overhead-mode", "hf-eager"], "hf-eager", "cited")):
        out = tmp_path / mode
        assert main(["serve-sim", str(full_run), "--profile", "h100-sxm", "--rate-per-s", "20", "--duration-s", "0.5",
                     *argv, "--out", str(out)]) == 0
        summary = pd.read_csv(out / "serving_summary.csv")
        assert (summary["overhead_mode"].tolist(), summary["host_term"].tolist()) == ([mode], [term])
        assert f"{mode} ({term})" in capsys.readouterr().out


def test_serving_charges_one_host_step_per_iteration_whatever_the_batch(full_run):
    """With the host the bound, a decode iteration of any batch takes the host's step: TBT = host step."""
    from simulator.options import ServingConfig
    from simulator.serving import simulate_serving

    profile = apply_mode(load_profile("h100-sxm"), "hf-eager")
    host = host_times(ModelShape.from_manifest(model_manifest("tiny")), profile).step_s
    for rate in (3.0, 400.0):  # one request at a time, and batches of many
        result = simulate_serving(full_run, profile, ServingConfig(rate_per_s=rate, duration_s=3.0 if rate < 10 else 0.5, seed=1))
        assert result.summary["tbt_p50_s"] == pytest.approx(host, rel=1e-9)
        assert result.summary["host_s_per_iteration"] == pytest.approx(host)
    assert result.summary["max_concurrency"] > 4
