"""`traces synth` and `sweep` estimate size, memory and time before they start, print it, and refuse what the
machine cannot hold: the estimates are checked against what a small real run writes and allocates,
and the 10,000-cell sweep opens each run once before its first line.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from simulator.synth import (
    BASE_PEAK_BYTES,
    SynthError,
    check_estimate,
    estimate_synth,
    synth_run,
)
from thoughtkv.cli import main
from traces.architectures import get_architecture

SAMPLE_RUNS = [REPO / "traces" / "samples" / name for name in
               ("micro-full", "micro-evict-h2o-b30", "micro-hierarchy-b30-e0", "micro-hierarchy-b30-e10")]


def written_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- traces synth ----------------------------------------------------------------------------------------------


def test_the_issues_synth_is_refused_in_seconds_before_writing(tmp_path, capsys):
    """130,000 decode steps of qwen2-7b grew to 12 GB in two minutes at 0/1 samples; now: one line, at once."""
    out = tmp_path / "run"
    started = time.perf_counter()
    assert main(["traces", "synth", "--model", "qwen2-7b", "--prompt-tokens", "512", "--decode-steps", "130000",
                 "--policy", "hierarchy", "--hbm-budget", "0.3", "--out", str(out)]) == 2
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of memory" in err[0] and "--allow-large" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("access", [True, False])
def test_the_synth_estimate_matches_a_real_run(access, tmp_path, capsys):
    """Disk within 2x of the bytes written; the memory estimate (over the interpreter's base) within 3x of the
    peak numpy and Python allocations tracemalloc sees while writing one sample."""
    arch = get_architecture("qwen2-7b")
    prompt, steps = 512, 600
    estimate = estimate_synth(arch, prompt, steps, 16, 2, access)
    out = tmp_path / "run"
    tracemalloc.start()
    try:
        synth_run(out, model="qwen2-7b", prompt_tokens=prompt, decode_steps=steps, policy="hierarchy", hbm_budget=0.3,
                  recall_k=4, recall_rule="query", samples=2, access=access, progress=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert capsys.readouterr().out.startswith("estimate: 2 sample(s) x ")
    assert 0.5 < estimate.disk_bytes / written_bytes(out) < 2
    assert 1 / 3 < (estimate.memory_bytes - BASE_PEAK_BYTES) / peak < 3
    assert estimate.layer_steps == (steps + 1) * arch.n_layers


def test_allow_large_lets_the_user_overrule_the_estimate(tmp_path):
    arch = get_architecture("qwen2-7b")
    huge = estimate_synth(arch, 512, 130_000, 16, 1, True)
    with pytest.raises(SynthError, match="--allow-large"):
        check_estimate(huge, tmp_path / "run", allow_large=False)
    check_estimate(huge, tmp_path / "run", allow_large=True)


# -- sweep -------------------------------------------------------------------------------------------------------


def write_grid(path: Path, budgets: int, recall_ks: list[int]) -> Path:
    grid = {"kind": "simulate", "runs": [str(r) for r in SAMPLE_RUNS], "profiles": "all",
            "what_if": {"budget": [round(0.02 * i, 2) for i in range(1, budgets + 1)], "recall_k": recall_ks}}
    path.write_text(yaml.safe_dump(grid))
    return path


def test_a_10000_cell_sweep_opens_each_run_once_before_its_first_line(tmp_path, capsys, monkeypatch):
    """Every cell used to be validated by reopening its trace run (~30 ms a cell): 310 s of silence for 10,000.
    Each distinct run is opened once to validate and once to size the estimate, whatever the cell count:
    counted, not timed, so a loaded machine cannot fail it."""
    from collections import Counter

    import traces.reader

    grid = write_grid(tmp_path / "grid.yaml", 50, [1, 2, 4, 8])  # 4 runs x 14 profiles x 200 what-ifs
    opened = Counter()
    real_open_run = traces.reader.open_run

    def counting_open_run(run_dir, *args, **kwargs):
        opened[str(Path(run_dir).resolve())] += 1
        return real_open_run(run_dir, *args, **kwargs)

    monkeypatch.setattr(traces.reader, "open_run", counting_open_run)
    assert main(["sweep", "--grid", str(grid), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    first, second, *_ = capsys.readouterr().out.splitlines()
    n_cells = int(first.split(": ")[1].split()[0].replace(",", ""))
    assert n_cells >= 10_000, first
    assert len(opened) == 4 and max(opened.values()) <= 2, opened
    assert "already done; estimate:" in second and "on disk" in second and "peak memory" in second


def test_the_sweep_estimate_matches_a_small_real_sweep(tmp_path, capsys):
    from simulator.sweep import CELL_FILE_BYTES

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(SAMPLE_RUNS[2])],
                                    "profiles": ["h100-pcie", "l40s"], "what_if": {"budget": [0.2, 0.3]}}))
    out = tmp_path / "out"
    assert main(["sweep", "--grid", str(grid), "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("0 already done; estimate: 4 cells to compute on 1 worker(s)")
    cells = list((out / "cells").glob("*.parquet"))
    assert len(cells) == 4
    assert 0.5 < CELL_FILE_BYTES / (written_bytes(out / "cells") / len(cells)) < 2
    assert main(["sweep", "--grid", str(grid), "--out", str(out), "--dry-run"]) == 0
    assert "4 already done; estimate: 0 cells to compute" in capsys.readouterr().out


def test_a_sweep_beyond_the_machine_is_refused_unless_allowed(tmp_path):
    from simulator.sweep import SweepError, SweepEstimate, check_estimate
    from traces.host import available_memory_bytes

    too_big = SweepEstimate(cells=10**6, workers=2, seconds=1e6, untimed=0, disk_bytes=1,
                            memory_bytes=2 * available_memory_bytes())
    with pytest.raises(SweepError, match="of memory .* --allow-large"):
        check_estimate(too_big, tmp_path, allow_large=False)
    check_estimate(too_big, tmp_path, allow_large=True)


def test_the_disk_limit_is_read_at_the_nearest_existing_parent(tmp_path):
    from simulator.synth import exceeded_limit

    missing = tmp_path / "not" / "yet"
    assert exceeded_limit(0, 0, missing) is None
    refusal = exceeded_limit(0, 10**18, missing)
    assert refusal.startswith("~") and "of disk space" in refusal and f"free at {tmp_path}" in refusal
    assert "of memory" in exceeded_limit(10**18, 0, tmp_path)
