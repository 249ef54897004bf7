"""Issue 19, figures and report text: tick labels at one budget, the link named after the profile's own link,
counts that agree with their noun, the long-tail measure named (both measures, each recomputed here), and
`plot --measured-profile` with a name that is no profile.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis import figures, report
from hwprofiles import load_profile
from thoughtkv.cli import main
from traces import TraceWriter, open_run
from traces.example import example_manifest, example_sample


def write_run(path, policy, budget, n_samples=3, n_correct=2):
    ids = [f"chains/test/{i}" for i in range(n_samples)]
    manifest = example_manifest(sample_ids=ids, kind="traced")  # traced: its measured timings count
    manifest["policy"].update(name=policy, hbm_budget=budget, evict_ratio=0.0, scorer="h2o" if policy != "full" else "none")
    with TraceWriter(path, manifest) as writer:
        for i, sample_id in enumerate(ids):
            parts = example_sample(sample_id, prompt_tokens=40, generated_tokens=12 + 4 * i, n_layers=6, seed=i)
            parts["sample"].update(gold="7", predicted="7" if i < n_correct else "3", correct=i < n_correct)
            writer.write_sample(parts["sample"], parts["steps"], parts["tokens"], parts["access"])
    return path


def drawn_tick_labels(ax) -> list[str]:
    ax.figure.canvas.draw()
    low, high = ax.get_xlim()
    return [t.get_text() for t, v in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= v <= high and t.get_text()]


def test_capacity_figure_has_distinct_ticks_at_a_single_budget():
    frame = pd.DataFrame({
        "method": ["hierarchy", "hierarchy"], "is_full": [False, False], "hbm_budget": [0.3, 0.3],
        "profile": ["h100-sxm", "rtx-4090"], "max_concurrency": [120, 40],
        "throughput_tokens_per_s": [5e4, 1e4], "throughput_source": ["bound", "bound"],
    })
    figure = figures.capacity(frame, "hierarchy")
    for ax in figure.axes[:2]:
        labels = drawn_tick_labels(ax)
        assert labels == ["30%"], labels


@pytest.mark.parametrize("profiles", [["gh200-96gb"], ["h100-pcie"], ["gh200-96gb", "h100-pcie"], ["nosuch-profile"]])
def test_link_stall_is_named_after_the_profiles_link(profiles):
    from hwprofiles import loader

    kinds = set()
    for name in profiles:  # the link kind read from the YAML itself, not through the schema objects
        try:
            path = next(p for d in loader.search_dirs(None) for p in d.glob(f"{name}.yaml"))
        except StopIteration:
            kinds.add(None)
            continue
        kinds.add(yaml.safe_load(path.read_text())["link"]["kind"])
    label = report.link_stall_label(profiles)
    if kinds == {"nvlink-c2c"}:
        assert label == "NVLink-C2C link stall"
    elif kinds and all(k and k.startswith("pcie") for k in kinds):
        assert label == "PCIe link stall"
    else:
        assert label.startswith("host-link stall") or label == "host link stall"
    assert ("PCIe" in label) == any(k and k.startswith("pcie") for k in kinds)


def test_counts_agree_with_their_noun():
    assert report.plural(1, "point") == "1 point"
    assert report.plural(2, "point") == "2 points"
    assert report.plural(1, "policy", "policies") == "1 policy"
    assert report.plural(3, "policy", "policies") == "3 policies"


def test_report_with_one_point_and_both_long_tail_measures(tmp_path):
    run_dir = write_run(tmp_path / "runs" / "evict-0.3", "evict", 0.3)
    out = tmp_path / "report"
    assert main(["plot", str(run_dir), "--out", str(out), "--quiet"]) == 0
    text = (out / "report.md").read_text()
    assert "1 point," in text and "1 points" not in text

    run = open_run(run_dir)
    # Accumulated measure: per layer, the ceil(20%) heaviest tokens' share of the summed importance, mean.
    tokens = run.tokens()
    shares = []
    for _, group in tokens.groupby("sample_id"):
        matrix = np.vstack(group.sort_values("position")["importance_by_layer"].to_numpy()).T
        for mass in matrix:
            k = max(1, math.ceil(0.2 * len(mass) - 1e-9))
            shares.append(np.sort(mass)[::-1][:k].sum() / mass.sum())
    accumulated = np.mean(shares)
    # Per-step measure, from the access table (the prefill left out).
    access = run.access()
    step_shares = []
    for mass in access.loc[access["step"] > 0, "block_mass"]:
        mass = np.asarray(mass, dtype=np.float64)
        if mass.sum() > 0:
            k = max(1, math.ceil(0.2 * len(mass) - 1e-9))
            step_shares.append(np.sort(mass)[::-1][:k].sum() / mass.sum())
    per_step = np.mean(step_shares)
    assert f"receive {accumulated:.0%} of the attention mass accumulated over the whole decode" in text
    assert f"hold {per_step:.0%} of that step's attention" in text


def test_measured_profile_that_is_no_profile_is_refused(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", "full", 1.0)
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "report"), "--measured-profile", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--measured-profile" in err and "nosuch" in err
    assert not (tmp_path / "report").exists()


def test_measured_profile_not_simulated_says_so(tmp_path):
    from simulator import simulate_run

    run_dir = write_run(tmp_path / "run", "full", 1.0)
    sim = tmp_path / "sim" / "results.parquet"
    sim.parent.mkdir()
    simulate_run(run_dir, "h100-sxm").samples.to_parquet(sim)
    other = load_profile("rtx-4090").name
    out = tmp_path / "report"
    assert main(["plot", str(run_dir), "--sim", str(sim), "--out", str(out), "--measured-profile", other,
                 "--quiet"]) == 0
    text = (out / "report.md").read_text()
    assert f"--measured-profile {other} is not among the simulated profiles (h100-sxm)" in text
