"""The prepared device scripts (tests/gpu/) still run against the current code: a GPU is lent to few sessions,
and a script that broke since the last one would waste its minutes. A CPU smoke run of the throughput script
with a tiny model writes its three files with every figure filled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tracer_throughput_script_runs_on_a_cpu_and_writes_its_figures(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "tests/gpu/tracer_throughput.py"), "--device", "cpu", "--model",
               "random:tiny", "--prompt", "24", "--steps", "6", "--rounds", "1", "--batches", "1,2", "--write-steps", "40"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "throughput.json").read_text())
    assert results["ddr_mapped_view"] == {"mapped": True, "round_trip_exact": True,
                                          "bytes_per_get": results["ddr_mapped_view"]["bytes_per_get"]}
    for batch in ("1", "2"):
        entry = results["by_batch"][batch]
        assert entry["host_syncs_per_step"] == 1.0  # the sync-free step, as the device run will count it
        assert entry["traced_hierarchy_tok_s"] > 0 and entry["untraced_tok_s"] > 0
        assert len(entry["decode_layer_us_median"]) == 6  # random:tiny's layers, each timed
    written = results["sample_write_ms"]
    assert written["steps"] == 40 and written["layers"] == 6 and written["prepare"] > 0 and written["commit"] > 0
    shares = results["host_issue_share"]
    assert {"untraced B=1", "traced hierarchy B=2", "traced full B=1"} <= set(shares)
    assert all(0.3 < share <= 1 for share in shares.values())  # a CPU: the forward's return ends its work
    rows = (tmp_path / "layer_us.csv").read_text().splitlines()
    assert rows[0] == "batch,step,layer,measured_layer_us,measured_step_us" and len(rows) > 12
    assert (tmp_path / "log.txt").read_text().strip().endswith("s")
