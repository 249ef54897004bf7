"""`thoughtkv demo`: the whole pipeline on a tiny random model, its reuse of finished work, and its --out checks."""

import json
import os

import pandas as pd
import pytest

from analysis.report import best_per_profile
from thoughtkv import demo
from thoughtkv.cli import main
from traces import open_run

TINY = ["--model", "random:tiny", "--n-samples", "1", "--max-new-tokens", "4", "--budgets", "0.5", "--evict-ratios", "0.2",
        "--calibrate", "smoke", "--serving-duration-s", "2"]


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
    assert policy["block_size"] == 4 and policy["window_tokens"] == 16  # the demo's, not the contract's defaults
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
                       "window": policy["window_tokens"], "recall_budget": policy["params"]["recall_budget"]}


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
