"""`thoughtkv plot` end to end: real trace runs (TraceWriter), real simulator results, every figure and table.

The numbers in the report are checked against values recomputed here from the raw tables (samples'
`correct`, tokens' `importance_by_layer`, steps' `measured_step_us`, the simulator's `total_s`).
"""

import re

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from analysis import stats
from thoughtkv.cli import main
from traces import TraceWriter, open_run
from traces.example import example_manifest, example_sample

N_SAMPLES = 4
PROFILES = ("h100-sxm", "rtx-4090")
RUNS = {  # name: (policy, budget, evict ratio, correct samples)
    "full": ("full", 1.0, 0.0, 4),
    "evict-0.3": ("evict", 0.3, 0.0, 1),
    "hier-0.3": ("hierarchy", 0.3, 0.5, 3),
}


def write_run(path, policy, budget, ratio, n_correct, kind="traced", scored=True):
    ids = [f"chains/test/{i}" for i in range(N_SAMPLES)]
    manifest = example_manifest(sample_ids=ids, kind=kind)
    manifest["policy"].update(name=policy, hbm_budget=budget, evict_ratio=ratio,
                              scorer="h2o" if policy != "full" else "none")
    with TraceWriter(path, manifest) as writer:
        for i, sample_id in enumerate(ids):
            parts = example_sample(sample_id, prompt_tokens=40, generated_tokens=12 + 4 * i, n_layers=6, seed=i)
            if scored:
                parts["sample"].update(gold="7", predicted="7" if i < n_correct else "3", correct=i < n_correct)
            writer.write_sample(parts["sample"], parts["steps"], parts["tokens"], parts["access"])
    return path


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from simulator import simulate_run

    root = tmp_path_factory.mktemp("study")
    runs = {name: write_run(root / "runs" / name, *spec) for name, spec in RUNS.items()}
    results = []
    for path in runs.values():
        results += [simulate_run(path, profile).samples for profile in PROFILES]
    for policy, budget, ratio, _ in RUNS.values():  # what-if replays of the full run
        if policy != "full":
            what_if = {"policy": policy, "budget": budget, "evict": ratio, "scorer": "h2o"}
            results.append(simulate_run(runs["full"], PROFILES[0], what_if=what_if).samples)
    sim_file = root / "sim" / "results.parquet"
    sim_file.parent.mkdir()
    pd.concat(results, ignore_index=True).to_parquet(sim_file)
    out = root / "report"
    code = main(["plot", str(root / "runs"), "--sim", str(sim_file.parent), "--out", str(out),
                 "--measured-profile", PROFILES[0], "--quiet"])
    assert code == 0
    return {"root": root, "runs": runs, "sim_file": sim_file, "out": out}


def test_every_figure_is_written_as_png_and_pdf(study):
    figures = study["out"] / "figures"
    stems = sorted(p.stem for p in figures.glob("*.png"))
    assert stems == ["fig1_importance", "fig2_capacity_accuracy", "fig3_latency", "fig4_pareto", "fig5_capacity",
                     "fig6_sim_vs_measured", "fig7_mass_lost"]
    for stem in stems:
        image = matplotlib.image.imread(figures / f"{stem}.png")
        assert image.shape[0] > 300 and image.shape[1] > 500  # drawn at print resolution
        assert (figures / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
    report = (study["out"] / "report.md").read_text()
    assert "Not drawn" not in report
    assert report.count("![") == 7


def test_accuracy_table_matches_the_samples(study):
    table = (study["out"] / "tables" / "table_capacity_accuracy.md").read_text()
    for name, (_, budget, _, _) in RUNS.items():
        correct = open_run(study["runs"][name]).samples()["correct"]
        k, n = int(correct.sum()), len(correct)
        low, high = stats.wilson_interval(k, n)
        cell = f"{100 * k / n:.1f} [{100 * low:.1f}, {100 * high:.1f}]"
        assert re.search(rf"\| {budget:.0%} \| [0-9.]+% \| {re.escape(cell)} \| {n} \|", table), (name, cell, table)
    assert "\\toprule" in (study["out"] / "tables" / "table_capacity_accuracy.tex").read_text()


def test_importance_caption_matches_the_tokens(study):
    tokens = open_run(study["runs"]["full"]).tokens()
    shares = []
    for _, sample in tokens.sort_values("position").groupby("sample_id"):
        by_layer = np.vstack(sample["importance_by_layer"].to_numpy())  # [position, layer]
        for layer_mass in by_layer.T:
            ordered = np.sort(layer_mass)[::-1]
            shares.append(ordered[: int(np.ceil(0.2 * len(ordered)))].sum() / ordered.sum())
    report = (study["out"] / "report.md").read_text()
    assert f"the top 20% of tokens receive {np.mean(shares):.0%} of the attention mass" in report
    table = (study["out"] / "tables" / "table_importance.md").read_text()
    assert f"| mean | {100 * np.mean(shares):.1f}% |" in table


def test_sim_vs_measured_table_matches_the_timings(study):
    sim = pd.read_parquet(study["sim_file"])
    errors = []
    for path in study["runs"].values():
        steps = open_run(path).steps(columns=["sample_id", "step", "measured_step_us"])
        measured = steps.drop_duplicates(["sample_id", "step"]).groupby("sample_id")["measured_step_us"].sum() / 1e6
        simulated = sim[(sim["run_dir"] == str(path)) & (sim["profile"] == PROFILES[0]) &
                        (sim["result_kind"] == "traced")].set_index("sample_id")["total_s"]
        errors += list(((simulated - measured) / measured).abs())
    table = (study["out"] / "tables" / "table_sim_vs_measured.md").read_text()
    assert f"| {PROFILES[0]} | {len(errors)} | {100 * np.median(errors):.1f}% |" in table


def test_latency_table_and_caption_name_every_profile(study):
    table = (study["out"] / "tables" / "table_latency.md").read_text()
    for profile in PROFILES:
        assert f"| {profile} |" in table
    assert "hierarchy, evict 50% @ 30% (ms/token)" in table


def test_single_run_without_accuracy_or_simulation_skips_with_reasons(tmp_path, capsys):
    run = write_run(tmp_path / "lone", "hierarchy", 0.3, 0.5, 0, kind="synthetic", scored=False)  # random weights
    out = tmp_path / "out"
    assert main(["plot", str(run), "--out", str(out), "--quiet"]) == 0
    report = (out / "report.md").read_text()
    assert (out / "figures" / "fig1_importance.png").is_file()
    assert "*Not drawn: no run has scored samples" in report
    assert report.count("*Not drawn: no simulator results") == 5
    assert capsys.readouterr().out.strip().endswith("1 of 7 figures, 1 tables")


def test_bad_paths_fail_in_one_line_and_leave_files_alone(tmp_path, capsys, study):
    run = str(study["runs"]["full"])
    assert main(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    assert main(["plot", run, "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-empty directory" in err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]
    bad_sim = tmp_path / "bad.csv"
    bad_sim.write_text("a,b\n1,2\n")
    assert main(["plot", run, "--sim", str(bad_sim), "--out", str(tmp_path / "o2")]) == 2
    assert "not a simulator results table" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_a_directory_of_results_files_is_read_whole(study, tmp_path):
    from analysis.load import classify_paths, load_sim_results

    sim = pd.read_parquet(study["sim_file"])
    for index, (_, rows) in enumerate(sim.groupby("run_label")):  # like the demo's layout: one file per run
        rows.to_parquet(tmp_path / f"part{index}.parquet")
    pd.DataFrame({"step": [0], "latency_s": [1.0]}).to_parquet(tmp_path / "steps.parquet")  # not a results table
    inputs = classify_paths([], [tmp_path])
    assert "steps.parquet" not in {p.name for p in inputs.sim_files}
    assert len(load_sim_results(inputs.sim_files)) == len(sim)


def test_a_run_without_committed_samples_still_gets_a_report(tmp_path):
    manifest = example_manifest(sample_ids=["chains/test/0"])
    TraceWriter(tmp_path / "empty", manifest)  # created, nothing committed yet
    assert main(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.count("*Not drawn:") == 7 and "empty has no committed samples" in report
