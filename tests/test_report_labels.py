"""What the outputs tell a reader: which model shapes a projection priced, synthetic runs labelled as
such, times in units that fit, readable log ticks, a Pareto frontier that skips 0% points, re-plots that leave
no stale figure, and contended calibrations left out of `--all-profiles`.
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import REPO

from analysis import figures, frames
from analysis.report import priced_text, replace_owned_files
from thoughtkv.cli import main
from traces import open_run

SAMPLE_RUN = REPO / "traces" / "samples" / "micro-hierarchy-b30-e0"


# -- which model a projection priced --------------------------------------------------------------------------


def test_captions_name_the_traced_model_and_the_as_model_target(tmp_path, capsys):
    from analysis import load

    native, projected = tmp_path / "native", tmp_path / "projected"
    assert main(["simulate", str(SAMPLE_RUN), "--profile", "h100-pcie", "--out", str(native)]) == 0
    assert main(["simulate", str(SAMPLE_RUN), "--profile", "h100-pcie", "--as-model", "qwen2-7b", "--out",
                 str(projected)]) == 0
    runs = load.run_table([open_run(SAMPLE_RUN)])
    model = open_run(SAMPLE_RUN).manifest["model"]  # the reference: the run's own record of its shapes
    text = priced_text(pd.read_parquet(native / "results.parquet"), runs)
    assert text.startswith(f"priced at `micro` ({model['n_params'] / 1e6:.3g}M parameters, {model['n_layers']} "
                           f"layers, {model['dtype']} KV")
    text = priced_text(pd.read_parquet(projected / "results.parquet"), runs)
    assert text.startswith("projected to `qwen2-7b` (7.62B parameters, 28 layers, bfloat16 KV 57.3 kB/token) from "
                           "the `micro` run(s)")
    out = tmp_path / "report"
    assert main(["plot", str(SAMPLE_RUN), "--sim", str(native / "results.parquet"), str(projected / "results.parquet"),
                 "--out", str(out), "--quiet"]) == 0
    report = (out / "report.md").read_text()
    assert "Simulator results: projected to `qwen2-7b`" in report and "priced at `micro`" in report
    for section in report.split("\n## ")[1:]:
        drawn = "![" in section and not section.startswith(("Figure 1.", "Figure 2."))  # 1, 2: the run's own
        if drawn:
            assert "`micro`" in section, section[:120]


# -- synthetic runs ---------------------------------------------------------------------------------------------


def test_a_synthetic_run_is_labelled_synthetic_and_still_reported(tmp_path, capsys):
    run = tmp_path / "synth"
    assert main(["traces", "synth", "--model", "tiny", "--prompt-tokens", "32", "--decode-steps", "12", "--policy",
                 "hierarchy", "--hbm-budget", "0.5", "--recall-k", "2", "--out", str(run)]) == 0
    sim = tmp_path / "sim"
    assert main(["simulate", str(run), "--profile", "h100-pcie", "--out", str(sim)]) == 0
    table = capsys.readouterr().out
    assert " synthetic " in table and " traced " not in table
    results = pd.read_parquet(sim / "results.parquet")
    assert set(results["result_kind"]) == {"synthetic"}
    latency = frames.latency_frame(results)  # a replay of its own placement, as a traced run's
    assert len(latency) == 1


# -- units, ticks and the frontier ------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, text", [(41.23e-6, "41.2 µs"), (3.052e-3, "3.05 ms"), (1.27, "1.27 s"),
                                           (0.0, "0 s"), (float("nan"), "-")])
def test_serving_times_are_printed_in_units_that_fit(seconds, text):
    from simulator.serving_cli import time_text

    assert time_text(seconds) == text


def test_serve_sim_prints_a_fast_models_tbt_without_zeros(tmp_path, capsys):
    assert main(["serve-sim", str(SAMPLE_RUN), "--profile", "h100-pcie", "--duration-s", "2", "--out",
                 str(tmp_path / "s")]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    summary = pd.read_parquet(tmp_path / "s" / "serving_summary.parquet").iloc[0]
    assert summary["tbt_p50_s"] < 1e-3 and "µs" in row and "0.0/" not in row and "0.00/" not in row


@pytest.mark.parametrize("low, high", [(0.8, 1.3), (0.95, 1.05), (0.1, 10.0), (0.02, 100.0)])
def test_figure_6b_has_readable_ticks_across_the_range(low, high):
    """A 0.8x-1.3x histogram had one tick label ("1x") on its log axis."""
    rng = np.random.default_rng(0)
    measured = rng.uniform(1, 2, 40)
    ratio = np.exp(rng.uniform(np.log(low), np.log(high), 40))
    frame = pd.DataFrame({"profile": "p", "measured_s": measured, "simulated_s": measured * ratio})
    figure = figures.sim_vs_measured(frame, {"n": 40, "median_abs_rel_err": 0.1, "p95_abs_rel_err": 0.2})
    axis = figure.axes[1]
    figure.canvas.draw()
    x_low, x_high = axis.get_xlim()
    labels = [t.get_text() for t in axis.get_xticklabels() if x_low <= t.get_position()[0] <= x_high and t.get_text()]
    assert len(labels) >= 3, labels
    assert all(label.endswith("x") for label in labels)


def test_the_pareto_frontier_leaves_out_zero_accuracy_points():
    latency = pd.DataFrame({
        "run_dir": ["a", "b", "c"], "profile": "p", "method": ["full cache", "pure eviction", "hierarchy"],
        "hbm_budget": [1.0, 0.1, 0.3], "accuracy": [1.0, 0.0, 0.6], "ms_per_token": [3.0, 1.0, 2.0],
        "kv_hbm_bytes_per_seq": [100.0, 10.0, 30.0],
    })
    points = frames.pareto_frame(latency).set_index("run_dir")
    assert not points.loc["b", "on_frontier_latency"] and not points.loc["b", "on_frontier_bytes"]
    assert points.loc["c", "on_frontier_latency"] and points.loc["a", "on_frontier_latency"]
    from analysis.report import _zero_text

    assert "1 point at 0% accuracy left off the frontier" in _zero_text(points)


# -- re-plots ---------------------------------------------------------------------------------------------------


def test_a_report_removes_only_the_files_it_wrote_before(tmp_path):
    out = tmp_path / "report"
    (out / "figures").mkdir(parents=True)
    ours = [out / "figures" / "fig7.png", out / "figures" / "fig1.png"]
    for path in ours:
        path.write_bytes(b"png")
    (out / "figures" / "user.png").write_bytes(b"user")
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    replace_owned_files(out, ours)
    listed = out / "report_files.json"
    listed.write_text(listed.read_text().replace('"figures/fig1.png"', '"figures/fig1.png", "../outside.txt"'))
    removed = replace_owned_files(out, [ours[1]])
    assert removed == [ours[0].resolve()]
    assert ours[1].is_file() and (out / "figures" / "user.png").is_file() and outside.is_file()


def test_replotting_a_report_with_less_data_removes_its_stale_figures(tmp_path):
    sim = tmp_path / "sim"
    assert main(["simulate", str(SAMPLE_RUN), "--profile", "h100-pcie", "--out", str(sim)]) == 0
    out = tmp_path / "report"
    assert main(["plot", str(SAMPLE_RUN), "--sim", str(sim / "results.parquet"), "--out", str(out), "--quiet"]) == 0
    assert (out / "figures" / "fig3_latency.png").is_file()
    assert main(["plot", str(SAMPLE_RUN), "--out", str(out), "--quiet"]) == 0
    assert not (out / "figures" / "fig3_latency.png").exists()
    assert "*Not drawn" in (out / "report.md").read_text()


# -- contended calibrations -------------------------------------------------------------------------------------


def test_profiles_calibrated_under_contention_are_left_out_of_all_profiles(tmp_path, capsys):
    from hwprofiles import list_profiles, load_profile
    from hwprofiles.loader import contention_note, default_profiles

    contended = {p.name for p in list_profiles() if (p.provenance.get("host_facts") or {}).get("contended") is True}
    assert "measured-cpu" in contended  # the committed one: load 5.65 on 2 CPUs
    chosen, left_out = default_profiles()
    examples = {p.name for p in list_profiles() if p.name.startswith("example-")}  # left out too (test_user_inputs)
    assert set(left_out) == contended | examples and not (contended | examples) & {p.name for p in chosen}
    assert "load 5.65 on 2 CPUs" in contention_note(load_profile("measured-cpu"))
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    assert main(["simulate", str(run), "--all-profiles", "--out", str(tmp_path / "all")]) == 0
    assert "measured-cpu (calibrated under CPU contention)" in capsys.readouterr().err
    results = pd.read_parquet(tmp_path / "all" / "results.parquet")
    assert "measured-cpu" not in set(results["profile"])
    assert main(["simulate", str(run), "--profile", "measured-cpu", "--out", str(tmp_path / "one")]) == 0
    assert "warning: profile measured-cpu was calibrated under CPU contention" in capsys.readouterr().err
