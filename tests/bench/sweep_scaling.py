"""Benchmark: the same 100-cell simulation grid with 1 and 2 workers, on the local process pool and on Ray.

Prints wall time per (executor, workers), the speed-up of 2 workers over 1 for each executor (goal >= 1.6x on
2 cores), and checks that all four runs give the same table. Times include starting the pool / the local Ray
(the 1-worker local run needs no pool at all, so its ratio is the conservative one). Each cell is a DES replay
of a synthetic 28-layer, 800-step trace (~0.4 s of CPU), heavy enough to amortise the start-up.

It also prints the CPU time the cells got per second of wall time ("cores used"): on a shared machine that, not
the executor, caps the speed-up. Measured for the pool (its workers are our children); estimated for Ray (its
workers are not) from the cells' CPU time on the 1-worker run.

    .venv/bin/python tests/bench/sweep_scaling.py
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from simulator.sweep import grid_from_dict, run_sweep
from simulator.synth import synth_run

PROFILES = ["h100-pcie", "h200-sxm", "a100-80gb-pcie", "gh200-96gb", "l40s"]
BUDGETS = [0.1, 0.2, 0.3, 0.5, 1.0]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        tmp = Path(tmp)
        run = synth_run(tmp / "hier", model="qwen2-1.5b", prompt_tokens=256, decode_steps=800, policy="hierarchy",
                        hbm_budget=0.3, recall_k=2, recall_rule="score", samples=1)
        grid = {"kind": "simulate", "runs": [str(run)], "profiles": PROFILES, "what_if": {"budget": BUDGETS},
                "overlap": ["none", "layer-prefetch"], "async_offload": [True, False], "engine": "des"}
        cells = grid_from_dict(grid, base_dir=tmp, where="bench grid").cells
        assert len(cells) == 100, len(cells)
        print(f"{len(cells)} cells, {os.cpu_count()} CPUs, load average before: {os.getloadavg()[0]:.1f}")
        wall_s: dict[tuple[str, int], float] = {}
        cells_cpu_s = 0.0  # CPU time of all cells, measured on the in-process 1-worker run
        tables: dict[tuple[str, int], pd.DataFrame] = {}
        for executor in ("local", "ray"):
            for workers in (1, 2):
                load = os.getloadavg()[0]
                cpu_before = _cpu_s()
                start = time.perf_counter()
                report = run_sweep(cells, tmp / f"{executor}-{workers}", executor=executor, workers=workers,
                                   progress=False)
                wall_s[executor, workers] = time.perf_counter() - start
                if (executor, workers) == ("local", 1):
                    cells_cpu_s = _cpu_s() - cpu_before
                # Cores the cells got: measured for the pool (its workers are our children), estimated for Ray
                # from the cells' CPU time on the 1-worker run.
                cores = ((_cpu_s() - cpu_before) if executor == "local" else cells_cpu_s) / wall_s[executor, workers]
                tables[executor, workers] = report.table
                assert not report.failed, report.failed
                print(f"{executor:<6} workers={workers}: {wall_s[executor, workers]:7.1f} s "
                      f"({wall_s[executor, workers] / len(cells) * 1e3:6.0f} ms/cell), load before {load:.1f}, "
                      f"cores used {cores:.2f}{' (est.)' if executor == 'ray' else ''}")
        reference = tables["local", 1]
        for key, table in tables.items():
            pd.testing.assert_frame_equal(table, reference, obj=f"table of {key}")
        print("all four tables identical")
        for executor in ("local", "ray"):
            ratio = wall_s[executor, 1] / wall_s[executor, 2]
            print(f"speed-up {executor} 2 vs 1 workers: {ratio:.2f}x (goal >= 1.6x)")
        print(f"ray vs local, 2 workers: {wall_s['local', 2] / wall_s['ray', 2]:.2f}x; "
              f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def _cpu_s() -> float:
    """User + system CPU time of this process and of its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    sys.exit(main())
