"""One options object for every simulator command, one schedule, one results schema:

- SimOptions / ServingConfig validate once (one-line errors every command's callers catch), and simulate,
  serve-sim, crosscheck and sweep grids spell each option the same way (flags generated from the fields);
- serve-sim charges the per-policy overheads simulate charges: one request on the measured CPU profile equals
  simulate_run to 1e-9, and differs from the same run without per-policy calibration;
- the DES's two shortcuts (a transfer-free step as one timeout, the inline one-sequence hot path) give the
  schedule's own times (schedule.StepSchedule) on random workloads;
- results rows have exactly the columns of simulator/columns.py, which analysis reads.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pandas as pd
import pytest

from hwprofiles import load_profile
from simulator import columns
from simulator.engine import run_des
from simulator.errors import OptionError, ServingError, SimulationError
from simulator.options import KEY_FIELDS, Projection, ServingConfig, SimOptions, from_args
from simulator.synth import synth_run
from simulator.workload import step_arrays
from traces import TraceFormatError


@pytest.mark.parametrize("change, message", [
    ({"overlap": "sideways"}, "overlap 'sideways' is unknown"),
    ({"engine": "gpu"}, "engine 'gpu' is unknown"),
    ({"batch": 0}, "batch must be a positive integer"),
    ({"batch": 1.5}, "batch must be a positive integer"),
    ({"batch": True}, "batch must be a positive integer"),
    ({"batch": 10**9}, "more than 65,536 sequences"),
    ({"async_offload": "yes"}, "async_offload must be true or false"),
    ({"offload_tier": ""}, "offload_tier must be a tier name"),
    ({"transfer": "carrier-pigeon"}, "transfer 'carrier-pigeon' is unknown"),
])
def test_bad_options_are_one_line_errors_of_every_command(change, message):
    with pytest.raises(OptionError, match=message) as info:
        SimOptions(**change)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, SimulationError) and isinstance(info.value, ServingError)


@pytest.mark.parametrize("change, flag", [
    ({"rate_per_s": float("nan")}, "--rate-per-s"),
    ({"rate_per_s": float("inf")}, "--rate-per-s"),
    ({"rate_per_s": 0}, "--rate-per-s"),
    ({"duration_s": -1.0}, "--duration-s"),
    ({"max_batch": 0}, "--max-batch"),
    ({"tbt_slo_s": -0.001}, "--tbt-slo-s"),
    ({"tbt_slo_s": float("nan")}, "--tbt-slo-s"),
    ({"ttft_slo_s": 0.0}, "--ttft-slo-s"),
    ({"seed": -1}, "--seed"),
    ({"rate_per_s": 1e6, "duration_s": 1e6}, "--rate-per-s, --duration-s"),
    ({"options": SimOptions(batch=2)}, "--max-batch"),
])
def test_serving_config_names_the_wrong_option(change, flag):
    with pytest.raises(ServingError, match=flag) as info:
        ServingConfig(**change)
    assert "\n" not in str(info.value)


def _parser(add) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser


def test_every_command_spells_the_options_the_same_way():
    """The same option flags give the same SimOptions in simulate, serve-sim and crosscheck; unset flags keep
    SimOptions' own defaults; sweep grids take the field names as keys."""
    from simulator import cli, serving_cli, sweep
    from thoughtkv import crosscheck

    common = ["--overlap", "layer-prefetch", "--no-async-offload"]
    expected = SimOptions(overlap="layer-prefetch", async_offload=False)
    simulate = _parser(cli.add_arguments).parse_args(["RUN", *common])
    serve = _parser(serving_cli.add_arguments).parse_args(["RUN", *common])
    cross = _parser(crosscheck.add_arguments).parse_args(["--model", "tiny", "--out", "o", *common])
    assert from_args(simulate) == from_args(serve) == from_args(cross) == expected
    assert from_args(_parser(cli.add_arguments).parse_args(["RUN"])) == SimOptions()
    tier = ["--offload-tier", "cxl-expander", "--transfer", "dma-per-block"]
    assert from_args(_parser(cli.add_arguments).parse_args(["RUN", *tier])) == \
        from_args(_parser(serving_cli.add_arguments).parse_args(["RUN", *tier]))
    option_fields = {f.name for f in dataclasses.fields(SimOptions)}
    assert option_fields <= set(sweep.GRID_KEYS["simulate"])
    assert option_fields - {"batch", "engine"} <= set(sweep.GRID_KEYS["serve"])
    assert {f.name for f in dataclasses.fields(ServingConfig)} - {"options", "projection", "arrivals_csv"} <= \
        set(sweep.GRID_KEYS["serve"])
    # --as-model & co.: one Projection, the same flags in simulate and serve-sim, grid keys in both kinds
    projected = ["--as-model", "qwen2-7b", "--as-dtype", "float16", "--context-scale", "2", "--recalls", "count"]
    expected_projection = Projection("qwen2-7b", "float16", 2.0, "count")
    assert from_args(_parser(cli.add_arguments).parse_args(["RUN", *projected]), Projection) == expected_projection
    assert serving_cli.serving_config(_parser(serving_cli.add_arguments).parse_args(
        ["RUN", *projected])).projection == expected_projection
    projection_fields = {f.name for f in dataclasses.fields(Projection)}
    assert projection_fields <= set(sweep.GRID_KEYS["simulate"]) and projection_fields <= set(sweep.GRID_KEYS["serve"])
    # serve-sim's own flags are ServingConfig's fields; the old unit-less prefixes still parse (argparse)
    args = _parser(serving_cli.add_arguments).parse_args(["RUN", "--rate", "3", "--duration-s", "2",
                                                          "--tbt-slo-s", "0.05", "--batch-copies"])
    config = serving_cli.serving_config(args)
    assert (config.rate_per_s, config.duration_s, config.tbt_slo_s, config.batch_copies) == (3.0, 2.0, 0.05, True)


def test_crosscheck_leaves_async_offload_to_the_measured_run_when_not_given():
    from thoughtkv import crosscheck

    args = _parser(crosscheck.add_arguments).parse_args(["--model", "tiny", "--out", "o"])
    assert args.async_offload is None and args.overlap is None
    assert from_args(args, async_offload=False) == SimOptions(async_offload=False)


# ---------------------------------------------------------------- serve-sim = simulate, per-policy overheads --


@pytest.fixture(scope="module")
def hierarchy_run(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("opt") / "hier", model="tiny", prompt_tokens=64, decode_steps=30,
                     policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score", samples=1)


def test_one_request_equals_simulate_on_a_measured_profile_with_per_policy_overheads(tmp_path, hierarchy_run):
    from simulator import simulate_run
    from simulator.serving import simulate_serving

    measured = load_profile("example-measured-cpu")
    assert "tiered/hierarchy" in measured.provenance["overheads_by_decoder"]
    csv = tmp_path / "one.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,64,31\n")
    served = simulate_serving(hierarchy_run, measured, ServingConfig(arrivals_csv=str(csv)))
    replay = simulate_run(hierarchy_run, measured, SimOptions(engine="des"))
    token_times_s = served.requests["first_token_s"].iloc[0] + np.concatenate([[0.0], np.cumsum(served.tbt_s)])
    np.testing.assert_allclose(token_times_s, np.cumsum(replay.steps["latency_s"].to_numpy()), rtol=1e-9)
    assert served.summary["overhead_source"] == replay.summary["overhead_source"] == "tiered/hierarchy"
    # Not vacuous: the profile's own (default-path) overheads give other times.
    plain = dataclasses.replace(measured, provenance={})
    other = simulate_serving(hierarchy_run, plain, ServingConfig(arrivals_csv=str(csv)))
    assert other.summary["overhead_source"].startswith("profile overheads")
    assert abs(other.summary["end_s"] - served.summary["end_s"]) > 1e-6 * served.summary["end_s"]


# ---------------------------------------------------------------- the DES's shortcuts = its schedule ---------


def random_case(rng):
    """A random link (duplex, engines, rates, overhead) and a random workload with sparse copies."""
    from simulator.costs import ModelShape
    from simulator.workload import StepArrays, build_workload
    from traces.manifest import model_manifest

    base = load_profile("h100-pcie")
    link = dataclasses.replace(base.link, full_duplex=bool(rng.integers(2)), copy_engines=int(rng.integers(1, 5)),
                               h2d_bytes_per_s=float(rng.uniform(1e9, 60e9)),
                               transfer_overhead_s=float(rng.choice([0.0, rng.uniform(0, 50e-6)])))
    profile = dataclasses.replace(base, link=link)
    shape = ModelShape.from_manifest(model_manifest("tiny"))
    n_steps, n_layers, prompt = int(rng.integers(2, 10)), int(rng.integers(1, 5)), int(rng.integers(1, 300))
    query = np.ones((n_steps, n_layers))
    query[0] = prompt
    attended = prompt + np.arange(n_steps)[:, None] + np.zeros((1, n_layers))
    block = 16 * shape.kv_bytes_per_token // shape.n_layers
    copies = [np.where(rng.random((n_steps, n_layers)) < rng.random(),
                       rng.integers(1, 200, (n_steps, n_layers)) * block, 0) for _ in range(2)]
    steps = StepArrays(query_tokens=query, hbm_tokens=attended, recalled_tokens=0 * attended, bytes_h2d=copies[0],
                       bytes_d2h=copies[1], hbm_kv_bytes=attended, ddr_kv_bytes=attended)
    work = build_workload("s", shape, profile, steps, batch=int(rng.choice([1, 1, 2])))
    return profile, work


@pytest.mark.parametrize("seed", range(30))
def test_the_des_shortcuts_give_the_schedules_times(seed):
    profile, work = random_case(np.random.default_rng(seed))
    for overlap in ("none", "layer-prefetch"):
        for async_offload in (True, False):
            lean = run_des(work, profile, overlap, async_offload, lean=True)
            general = run_des(work, profile, overlap, async_offload, lean=False)
            np.testing.assert_allclose(lean.step_end_s, general.step_end_s, rtol=1e-12, atol=0)
            for name in ("h2d_busy_s", "d2h_busy_s", "last_d2h_end_s", "h2d_bytes", "d2h_bytes"):
                assert getattr(lean, name) == pytest.approx(getattr(general, name), rel=1e-12), name


# ---------------------------------------------------------------- results schema -----------------------------


def test_results_rows_have_exactly_the_schema_columns_and_analysis_reads_them(hierarchy_run, tmp_path):
    from analysis.load import SIM_REQUIRED, load_sim_results
    from simulator import simulate_run
    from simulator.cli import write_results

    result = simulate_run(hierarchy_run, "h100-pcie")
    assert list(result.samples.columns) == list(columns.RESULT_COLUMNS)
    assert result.summary["sample_id"] == columns.SUMMARY_SAMPLE_ID
    assert set(KEY_FIELDS) == set(columns.OPTION_COLUMNS) and "engine" not in KEY_FIELDS
    assert set(columns.KEY_COLUMNS) | set(SIM_REQUIRED) <= set(columns.RESULT_COLUMNS)
    assert set(columns.STEP_RESULT_COLUMNS) <= set(result.steps.columns)
    written = write_results([result], tmp_path / "sim")
    table = load_sim_results([p for p in written if p.name == "results.parquet"])
    assert len(table) == len(result.samples)


def test_rows_written_before_an_option_existed_are_kept_with_its_default(hierarchy_run, tmp_path):
    """A results file from before `transfer` was a column: a new write merges into it (old rows are kept,
    read as the default mechanism, and replaced only by an equal key)."""
    from simulator import simulate_run
    from simulator.cli import write_results

    out = tmp_path / "sim"
    old = simulate_run(hierarchy_run, "h100-pcie")
    write_results([old], out)
    for name in ("results", "summary"):
        path = out / f"{name}.parquet"
        pd.read_parquet(path).drop(columns=["transfer"]).to_parquet(path, index=False)
    write_results([simulate_run(hierarchy_run, "h200-sxm")], out)
    merged = pd.read_parquet(out / "results.parquet")
    assert sorted(merged["profile"]) == ["h100-pcie", "h200-sxm"] and set(merged["transfer"]) == {"dma-per-block"}
    write_results([old], out)  # the same key again: replaced, not duplicated
    assert len(pd.read_parquet(out / "results.parquet")) == 2


def test_step_arrays_refuse_rows_that_are_not_one_per_step_and_layer(hierarchy_run):
    from traces import open_run

    run = open_run(hierarchy_run)
    n_layers = run.manifest["model"]["n_layers"]
    steps = run.steps(run.sample_ids()[0])
    arrays = step_arrays(steps.sample(frac=1.0, random_state=0), n_layers)  # any row order
    assert arrays.query_tokens.shape == (31, n_layers) and arrays.query_tokens[0, 0] == 64
    for broken in (steps.iloc[1:], steps.assign(layer=steps["layer"].where(steps.index != 3, 0)),
                   steps.assign(step=steps["step"] + 1)):
        with pytest.raises(TraceFormatError, match="one per \\(step, layer\\)"):
            step_arrays(broken, n_layers)
