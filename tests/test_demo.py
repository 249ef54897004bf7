"""`thoughtkv demo`: the whole pipeline on a tiny random model, its reuse of finished work, and its --out checks."""

import json
import os

import pandas as pd
import pytest

from analysis.report import best_per_profile
from thoughtkv import demo
from thoughtkv.cli import main
from traces import open_run

pytestmark = pytest.mark.slow  # the real LM or whole demo runs: the slow tier

TINY = ["--model", "random:tiny", "--n-samples", "1", "--max-new-tokens", "4", "--budgets", "0.5", "--evict-ratios", "0.2",
        "--calibrate", "smoke", "--serving-duration-s", "2", "--real-model-samples", "0"]


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    # Two trace processes here (the default is one): the process-pool path is exercised too.
    assert main(["demo", "--out", str(out), *TINY, "--trace-workers", "2"]) == 0
    return out


def test_demo_traces_the_grid_simulates_every_profile_and_reports(demo_out):
    from hwprofiles import list_profiles

    labels = sorted(p.name for p in (demo_out / "runs").iterdir())
    assert labels == ["evict-b50", "full", "hierarchy-b50-e20"]
    for label in labels:
        run = open_run(demo_out / "runs" / label)
        assert len(run.sample_ids()) == 1
        assert run.manifest["policy"]["name"] == label.split("-")[0]
    sim = pd.concat([pd.read_parquet(f) for f in sorted((demo_out / "sim").glob("*.parquet"))], ignore_index=True)
    traced = sim[sim["result_kind"] == "traced"]
    # every datasheet profile (in hf-eager mode) and this machine's in-run calibration, not the shipped example
    n_profiles = len([p for p in list_profiles() if p.provenance.get("kind") != "measured"]) + 1
    assert traced.groupby("run_label")["profile"].nunique().tolist() == [n_profiles] * 3
    assert "measured-here-cpu" in set(traced["profile"]) and "example-measured-cpu" not in set(traced["profile"])
    modes = traced.drop_duplicates("profile").set_index("profile")["overhead_mode"]
    assert modes.pop("measured-here-cpu") == "measured" and set(modes) == {"hf-eager"}
    projected = sim[sim["result_kind"] == "projected"]
    assert sorted(zip(projected["policy"], projected["hbm_budget"])) == [("evict", 0.5), ("hierarchy", 0.5)]
    # Each projection carries its traced twin's policy knobs, so the report can pair mass lost with accuracy.
    keys = ["policy", "hbm_budget", "evict_ratio", "block_size", "recall_k", "scorer"]
    for _, row in projected.iterrows():
        twin = traced[(traced["policy"] == row["policy"]) & (traced["run_label"] != "full")].iloc[0]
        assert row[keys].tolist() == twin[keys].tolist()
    # The in-run calibration timed the tiered decoders with the runs' own blocks and window (their cost depends on them).
    import yaml

    provenance = yaml.safe_load((demo_out / "profiles" / "measured-here-cpu.yaml").read_text())["provenance"]
    policy = open_run(demo_out / "runs" / "evict-b50").manifest["policy"]
    assert provenance["cache_geometry"] == {k: policy[k] for k in ("block_size", "sink_tokens", "window_tokens")}
    # The geometry is the model's (its trace_defaults.json; random:tiny has none, so the tool's), recorded per run.
    from tracer.model_defaults import resolve

    expected, _ = resolve("random:tiny", {"max_new_tokens": 4}, policy="evict")
    assert {k: policy[k] for k in ("block_size", "sink_tokens", "window_tokens")} == \
        {k: expected[k] for k in ("block_size", "sink_tokens", "window_tokens")}
    report = (demo_out / "report" / "report.md").read_text()
    assert "![Importance long tail]" in report and "![Projected latency]" in report
    assert json.loads((demo_out / demo.MARKER).read_text())["model"] == "random:tiny"


def test_demo_serves_every_run_on_a_pcie_and_a_c2c_gpu(demo_out):
    """The serving section: every run projected to qwen2-7b with R1-7B GSM8K-like lengths on the demo's two
    profiles, each (run, profile) with a max sustainable rate bracket, the frontier drawn, the captions naming
    the shapes and the overhead mode with its host term; Figure 5 says it is a bound."""
    capacity = pd.read_csv(demo_out / "report" / "tables" / "capacity_served.csv")
    assert sorted(capacity["profile"].unique()) == sorted(demo.SERVING_PROFILES)
    assert capacity.groupby("profile")["run_dir"].nunique().tolist() == [3, 3]
    assert set(capacity["as_model"]) == {"qwen2-7b"} and set(capacity["lengths"]) == {"r1-7b/gsm8k"}
    assert ((capacity["max_rate_per_s"].notna()) | (capacity["first_failing_rate_per_s"].notna())).all()
    assert (demo_out / "report" / "figures" / "serving_frontier.png").is_file()
    report = (demo_out / "report" / "report.md").read_text()
    section = report[report.index("## Capacity as served"):]
    assert "projected to qwen2-7b" in section and "cuda-graphs (host term cited)" in section
    assert "![The serving frontier" in section
    assert "an upper bound (no queueing, no shared link)" in report


def test_rerun_reuses_runs_and_results(demo_out, capsys):
    sim_files = sorted((demo_out / "sim").glob("*.parquet"))
    before = {f: f.stat().st_mtime_ns for f in sim_files}
    assert main(["demo", "--out", str(demo_out), *TINY]) == 0
    err = capsys.readouterr().err
    assert "(this host, reused)" in err  # same host, model shapes and cache geometry: not calibrated again
    assert "trace: 3 of 3 runs already complete" in err
    assert "simulate: 3 of 3 runs' results up to date" in err
    assert {f: f.stat().st_mtime_ns for f in sim_files} == before


def test_results_are_redone_when_the_run_changed(demo_out, capsys):
    cells = demo.grid([0.5], [0.2])
    run_dirs = {c.label: demo_out / "runs" / c.label for c in cells}
    files = sorted((demo_out / "sim").glob("*.parquet"))
    before = {f.name: f.stat().st_mtime_ns for f in files}
    newer = max(f.stat().st_mtime for f in files) + 10
    os.utime(run_dirs["evict-b50"] / "run.json", (newer, newer))  # as if a sample was appended
    demo.simulate_all(cells, run_dirs, demo_out / "sim")
    assert "simulate: 2 of 3 runs' results up to date" in capsys.readouterr().err
    after = {f.name: f.stat().st_mtime_ns for f in files}
    assert [name for name in before if after[name] != before[name]] == ["evict-b50.parquet"]


def test_out_must_be_new_empty_or_a_demo(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "file"), *TINY]) == 2
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("keep")
    assert main(["demo", "--out", str(tmp_path / "busy"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not a demo's" in err[1]
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["thesis.tex"]
    assert main(["demo", "--out", str(tmp_path / "new"), "--budgets", "0.5,1.5"]) == 2
    assert "must be a fraction in (0, 1]" in capsys.readouterr().err  # traces.policy.parse_budget says it


def test_grid_labels_and_what_if_of_a_traced_run(demo_out):
    cells = demo.grid([0.5, 0.25], [0.2])
    assert [c.label for c in cells] == ["full", "evict-b50", "hierarchy-b50-e20", "evict-b25", "hierarchy-b25-e20"]
    policy = open_run(demo_out / "runs" / "hierarchy-b50-e20").manifest["policy"]
    what_if = demo.what_if_of(demo_out / "runs" / "hierarchy-b50-e20")
    assert what_if == {"policy": "hierarchy", "budget": 0.5, "evict": 0.2, "block": policy["block_size"],
                       "recall_k": policy["recall_k"], "scorer": policy["scorer"], "sink": policy["sink_tokens"],
                       "window": policy["window_tokens"],
                       **{k: v for k, v in policy["params"].items() if k == "recall_budget"}}  # when the run had one


def test_the_report_names_the_priced_model_once_and_every_other_where_it_is(demo_out, capsys):
    """A 1.45M-parameter model's ms/token read as a real model's: the report's opening names the shapes every
    simulator row priced, once (not in every caption), and a caption pricing other shapes names them (the
    mechanisms figure: projected to qwen2-7b)."""
    report = (demo_out / "report" / "report.md").read_text()
    assert "Simulator results: priced at `random:tiny` (" in report
    assert "unless its caption names other shapes" in report
    assert report.count("priced at `random:tiny`") == 1  # said once
    sections = report.split("\n## ")
    projected = [s for s in sections if s.startswith(("Figure 3.", "Figure 4.", "Figure 5.", "Figure 6."))
                 and "Not drawn" not in s]
    assert len(projected) >= 3  # latency, capacity, sim vs measured draw without accuracy
    for section in (s for s in sections if s.startswith("Transfer mechanisms")):  # drawn for a hierarchy at e=0
        assert "qwen2-7b" in section  # other shapes than the opening's: named
    assert "Traced model: `random:tiny` (" in report
    assert main(["demo", "--out", str(demo_out), *TINY]) == 0  # a rerun reuses everything and prints the summary
    printed = capsys.readouterr().out
    assert "random:tiny" in printed or "No accuracy to rank policies by" in printed


def test_a_replot_into_the_demos_report_leaves_no_stale_figure(demo_out, tmp_path):
    """`plot RUN --out EXISTING_REPORT` used to replace report.md but keep figures it did not redraw
    (fig7, mechanisms.png) beside a report saying "not drawn"; files it never wrote stay."""
    import shutil

    report = tmp_path / "report"
    shutil.copytree(demo_out / "report", report)
    # The demo draws the mechanisms figure for a hierarchy with nothing evicted (this grid evicts 20%): draw it
    # here from the hierarchy run, as the demo does after its report.
    hierarchy = demo.Cell("hierarchy", 0.5, 0.0)
    demo.mechanisms_figure([hierarchy], {hierarchy.label: demo_out / "runs" / "hierarchy-b50-e20"}, report, "hf-eager")
    mechanisms = (report / "report.md").read_text().split("## Transfer mechanisms")[1]
    assert "of `random:tiny` projected to qwen2-7b shapes" in mechanisms
    before = {p.name for p in (report / "figures").iterdir()}
    assert {"mechanisms.png", "fig3_latency.png"} <= before
    (report / "figures" / "my-notes.png").write_bytes(b"not ours")
    (report / "mine.txt").write_text("keep me")
    assert main(["plot", str(demo_out / "runs" / "full"), "--out", str(report), "--quiet"]) == 0  # no results
    after = {p.name for p in (report / "figures").iterdir()}
    text = (report / "report.md").read_text()
    for stem in ("fig3_latency", "fig5_capacity", "mechanisms"):
        assert f"{stem}.png" not in after and f"{stem}.pdf" not in after
    assert "Not drawn" in text and "mechanisms.png" not in text
    assert {"my-notes.png", "fig1_importance.png"} <= after and (report / "mine.txt").read_text() == "keep me"
    assert not any(p.name.startswith("table_latency") for p in (report / "tables").iterdir())


def test_best_policy_is_the_fastest_within_five_points_of_the_best():
    latency = pd.DataFrame({
        "profile": ["p"] * 3 + ["q"] * 2,
        "method": ["full cache", "hierarchy", "pure eviction", "full cache", "pure eviction"],
        "hbm_budget": [1.0, 0.25, 0.25, 1.0, 0.25],
        "accuracy": [0.90, 0.86, 0.50, 0.90, 0.80],
        "ci_low": 0.0, "ci_high": 1.0, "n_scored": 20,
        "ms_per_token": [10.0, 6.0, 4.0, 3.0, 2.0],
    })
    best = best_per_profile(latency).set_index("profile")
    assert best.loc["p", "method"] == "hierarchy"  # 86% is within 5 points of 90%; eviction's 50% is not
    assert best.loc["q", "method"] == "full cache"  # 80% is 10 points down
    assert best_per_profile(latency.assign(accuracy=float("nan"))).empty


def test_the_summary_says_when_n_cannot_separate_the_policies():
    """At n = 8 the full cache (100% [68, 100]) was named best on every profile although another policy's CI
    (62% [31, 86]; in the demo, the 50% hierarchy's 75% [41, 93]) overlapped it: the summary now says the samples
    cannot tell them apart."""
    from traces.stats import wilson_interval

    def row(profile, method, correct, n, ms):
        low, high = wilson_interval(correct, n)
        return {"profile": profile, "method": method, "hbm_budget": 1.0 if method == "full cache" else 0.3,
                "accuracy": correct / n, "ci_low": low, "ci_high": high, "n_scored": n, "ms_per_token": ms}

    small = pd.DataFrame([row("p", "full cache", 8, 8, 10.0), row("p", "pure eviction", 5, 8, 4.0)])
    best = best_per_profile(small)
    assert best.loc[0, "method"] == "full cache" and best.loc[0, "not_separated_from"] == ["pure eviction @ 30%"]
    assert demo.separation_note(best).startswith("not separated: on 1 of 1 profiles")
    large = pd.DataFrame([row("p", "full cache", 500, 500, 10.0), row("p", "pure eviction", 310, 500, 4.0)])
    best = best_per_profile(large)
    assert best.loc[0, "not_separated_from"] == [] and demo.separation_note(best).startswith("separated:")
