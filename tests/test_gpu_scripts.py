"""The prepared device scripts (tests/gpu/) still run against the current code: a GPU is lent to few tasks, for
minutes, and a script that broke since the last one would waste them. CPU smoke runs: the throughput script with
a tiny model writes its files with every figure filled (and keeps what finished when its budget runs out); the
one command for the lent machine (tests/gpu/on_device.sh) runs every phase in its smoke mode and writes no more
files than the device tool brings back."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THROUGHPUT = [sys.executable, str(ROOT / "tests/gpu/tracer_throughput.py"), "--device", "cpu", "--model", "random:tiny",
              "--prompt", "96", "--steps", "6", "--rounds", "1", "--batches", "1,2", "--write-steps", "40"]


def run_script(command: list[str], out: Path, **env) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # (+ carried wheels)
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    env.pop("THOUGHTKV_DDR_COPY", None)
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_tracer_throughput_script_runs_on_a_cpu_and_writes_its_figures(tmp_path):
    done = run_script(THROUGHPUT, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "throughput.json").read_text())
    assert results["ddr_mapped_view"]["mapped"] is True
    assert results["ddr_mapped_view"]["round_trip_exact"] == {"kernel": True, "copy-engine": True}
    assert results["skipped"] == [] and results["load_s"] > 0
    for batch in ("1", "2"):
        entry = results["by_batch"][batch]
        assert entry["host_syncs_per_step"] == 1.0  # the sync-free step, as the device run will count it
        assert entry["traced_hierarchy_tok_s"] > 0 and entry["untraced_tok_s"] > 0
        assert len(entry["decode_layer_us_median"]) == 6  # random:tiny's layers, each timed
        for mode in ("kernel", "copy-engine"):  # each layer's DDR recalls and offloads, either way of moving
            moves = entry["ddr_moves"][mode]
            assert moves["traced_hierarchy_tok_s"] > 0
            assert len(moves["recall_us_median_by_layer"]) == len(moves["offload_us_per_step_by_layer"]) == 6
            assert moves["recall_calls_per_step"] > 0 and moves["offload_calls_per_step"] > 0
            assert sum(moves["recall_us_median_by_layer"]) > 0 and sum(moves["offload_us_per_step_by_layer"]) > 0
    written = results["sample_write_ms"]
    assert written["steps"] == 40 and written["layers"] == 6 and written["prepare"] > 0 and written["commit"] > 0
    shares = results["host_issue_share"]
    assert {"untraced B=1", "traced hierarchy B=2", "traced full B=1"} <= set(shares)
    assert all(0.3 < share <= 1 for share in shares.values())  # a CPU: the forward's return ends its work
    rows = (tmp_path / "layer_us.csv").read_text().splitlines()
    assert rows[0] == "batch,step,layer,measured_layer_us,measured_step_us" and len(rows) > 12
    assert (tmp_path / "log.txt").read_text().strip().endswith("s")
    assert not list(tmp_path.glob("*.tmp"))


def test_a_spent_budget_skips_the_rest_and_keeps_what_finished(tmp_path):
    done = run_script([*THROUGHPUT, "--budget-s", "0"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "throughput.json").read_text())
    assert results["skipped"] == ["B=1", "sample writing"] and results["by_batch"] == {}
    assert results["ddr_mapped_view"]["round_trip_exact"]["kernel"] is True  # (done before the first stage)


def test_the_commit_is_known_without_git(tmp_path, monkeypatch):
    """The lent machine may have no git: the commit comes from the COMMIT file beside the carried wheels."""
    sys.path.insert(0, str(ROOT / "tests/gpu"))
    try:
        import tracer_throughput
    finally:
        sys.path.remove(str(ROOT / "tests/gpu"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    monkeypatch.setattr(tracer_throughput, "ROOT", tmp_path)
    assert tracer_throughput.source_commit() is None
    (tmp_path / ".gpu-wheels").mkdir()
    (tmp_path / ".gpu-wheels" / "COMMIT").write_text("abc123\n")
    assert tracer_throughput.source_commit() == "abc123"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_device_command_runs_every_phase_in_its_smoke_mode(tmp_path):
    """tests/gpu/on_device.sh with SMOKE=1: the probe, the throughput script, calibration, the transfer tests and
    the crosscheck on a CPU, each inside its timeout; at most 8 files come back, none deeper than two folders."""
    done = run_script(["bash", str(ROOT / "tests/gpu/on_device.sh")], tmp_path, SMOKE="1", PYTHON=sys.executable,
                      WHEELS=str(tmp_path / "no-wheels"))
    log = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, log[-3000:]
    for phase in ("environment", "mapping probe", "throughput", "calibrate", "transfer tests", "crosscheck",
                  "done (status 0)"):
        assert f"== {phase}" in log or phase in log, phase
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(tmp_path).parts) <= 3 for p in files), files
    assert json.loads((tmp_path / "throughput" / "throughput.json").read_text())["by_batch"]
    assert json.loads((tmp_path / "summary.json").read_text())


def test_the_device_commands_phase_limits_fit_the_documented_call():
    """The phases' limits in on_device.sh add up within the `run` call's timeout_s in tests/gpu/README.md, with
    room for each phase's 10 s kill grace to matter once, and that call with a two-minute machine start fits 12
    minutes (the issue's budget for the first lent run)."""
    script = (ROOT / "tests/gpu/on_device.sh").read_text()
    device_limits = re.findall(r"^  (T_INSTALL=.*)$", script, re.M)[-1]  # (the second: the device's, not SMOKE's)
    limits = {name: int(value) for name, value in re.findall(r"(T_\w+)=(\d+)", device_limits)}
    assert set(limits) == {"T_INSTALL", "T_ENV", "T_PROBE", "T_THROUGHPUT", "T_CALIBRATE", "T_TESTS", "T_CROSSCHECK"}
    timeout_s = int(re.search(r"timeout_s: (\d+)", (ROOT / "tests/gpu/README.md").read_text()).group(1))
    assert sum(limits.values()) + 10 <= timeout_s <= 600  # (600: the tool's limit for one command)
    assert timeout_s + 120 <= 12 * 60
    budget = float(re.search(r"THROUGHPUT_ARGS=\(--budget-s (\d+)\)", script).group(1))
    assert budget + 45 <= limits["T_THROUGHPUT"]  # the last stage it starts has time to finish
    assert f"limits below add up to {sum(limits.values())} s" in script and f"timeout_s: {timeout_s})" in script
