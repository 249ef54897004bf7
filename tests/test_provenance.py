"""Measurements that say where they came from: a measured profile applied to a run traced on another host warns
in one line; on the same host it does not. Overhead modes are recorded in every result row."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from thoughtkv.cli import main

WARNING = "warning: measured profile"


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """A profile calibrated on this machine and a run traced on it, in the same pytest run."""
    root = tmp_path_factory.mktemp("here")
    profile = root / "here-cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(profile)]) == 0
    run = root / "run"
    # The calibration's cache geometry (the contract's defaults), not micro's trace defaults: this test is about
    # hosts, and a geometry mismatch has its own warning.
    assert main(["trace", "--model", "micro", "--task", "chains", "--n-samples", "1", "--max-new-tokens", "8",
                 "--block-size", "16", "--window-tokens", "32", "--device", "cpu", "--out", str(run), "--quiet"]) == 0
    return profile, run


def _simulate(run, profile, out, capsys, *extra):
    capsys.readouterr()
    assert main(["simulate", str(run), "--profile", str(profile), "--out", str(out), *extra]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if WARNING in line]


def test_same_host_no_warning_other_host_one_line(here, tmp_path, capsys):
    profile, run = here
    assert _simulate(run, profile, tmp_path / "same", capsys) == []
    rows = pd.read_parquet(next((tmp_path / "same").glob("*.parquet")))
    assert rows["same_host"].eq(True).all() and rows["overhead_mode"].eq("measured").all()

    data = yaml.safe_load(profile.read_text())
    data["name"] = "elsewhere-cpu"
    data["provenance"]["host_facts"]["hostname"] = "another-machine"
    other = tmp_path / "elsewhere-cpu.yaml"
    other.write_text(yaml.safe_dump(data, sort_keys=False))
    warnings = _simulate(run, other, tmp_path / "other", capsys)
    assert len(warnings) == 1 and "another-machine" in warnings[0] and "calibrate on the tracing machine" in warnings[0]
    rows = pd.read_parquet(next((tmp_path / "other").glob("*.parquet")))
    assert rows["same_host"].eq(False).all()


def test_datasheet_profiles_never_warn_and_name_their_overhead_mode(here, tmp_path, capsys):
    _, run = here
    assert _simulate(run, "h200-sxm", tmp_path / "kernel", capsys) == []
    assert _simulate(run, "h200-sxm", tmp_path / "eager", capsys, "--overhead-mode", "hf-eager") == []
    kernel = pd.read_parquet(next((tmp_path / "kernel").glob("*.parquet")))
    eager = pd.read_parquet(next((tmp_path / "eager").glob("*.parquet")))
    assert kernel["overhead_mode"].eq("kernel-only").all() and (kernel["overhead_s"] == 0).all()
    assert eager["overhead_mode"].eq("hf-eager").all()
    assert (eager["overhead_s"] > 0).all() and (eager["total_s"] > kernel["total_s"]).all()


def test_plot_warns_once_for_a_profile_from_another_host(here, tmp_path, capsys):
    profile, run = here
    data = yaml.safe_load(profile.read_text())
    data["name"] = "away-cpu"
    data["provenance"]["host_facts"]["cpu_model"] = "another CPU"
    other = tmp_path / "away-cpu.yaml"
    other.write_text(yaml.safe_dump(data, sort_keys=False))
    _simulate(run, other, tmp_path / "sim", capsys)
    _simulate(run, profile, tmp_path / "sim-here", capsys)
    assert main(["plot", str(run), "--sim", str(tmp_path / "sim"), str(tmp_path / "sim-here"),
                 "--out", str(tmp_path / "report"), "--quiet"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "away-cpu" in warnings[0]
