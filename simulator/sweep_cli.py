"""`thoughtkv sweep --grid FILE.yaml [--executor local|ray] [--address ADDR] [--workers N] [--out DIR]`.

Runs every cell of the grid that has no cached result under OUT/cells/, shows progress, and writes the merged
table to OUT/results.parquet and OUT/results.csv. Rerunning skips finished cells (an interrupted sweep
resumes). Examples: examples/sweeps/*.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grid", required=True, help="grid YAML file (see examples/sweeps/)")
    parser.add_argument("--executor", choices=("local", "ray"), default="local",
                        help="local process pool (default) or Ray (a local Ray, or a cluster with --address)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join: `auto` on a cluster node, or ray://HEAD:10001 (Ray only)")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel cells (default: CPU count; with Ray: CPUs of the local Ray it starts)")
    parser.add_argument("--out", default=None, help="output directory (default: sweeps/<grid file stem>)")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and which are cached; run none")
    parser.add_argument("--allow-large", action="store_true",
                        help="run even when the estimate says the sweep will not fit in this machine's memory or "
                             "disk (default: refuse)")


def run(args: argparse.Namespace) -> int:
    from simulator.sweep import inputs_snapshot

    with inputs_snapshot():  # each run and profile digested once, each cell's key computed once
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import os

    from simulator.sweep import (
        SweepError,
        cell_key,
        check_distinct_cells,
        check_estimate,
        estimate_sweep,
        is_cached,
        load_grid,
        run_sweep,
    )

    if args.address is not None and args.executor != "ray":
        raise SweepError("--address joins a Ray cluster; add --executor ray or drop --address")
    if args.workers is not None and args.workers < 1:
        raise SweepError(f"--workers must be >= 1, got {args.workers}")
    out_dir = Path(args.out) if args.out else Path("sweeps") / Path(args.grid).stem
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepError(f"--out {out_dir} exists and is not a directory; pass a directory")
    grid = load_grid(args.grid, out_dir=out_dir)  # every cell validated, each distinct check once
    check_distinct_cells(grid.cells, {cell: cell_key(cell) for cell in grid.cells})  # the dry run too
    print(f"{grid.source}: {len(grid.cells):,} {grid.kind} cells, out={out_dir}", flush=True)
    done = {cell: is_cached(out_dir, cell) for cell in grid.cells}
    todo = [cell for cell in grid.cells if not done[cell]]
    estimate = estimate_sweep(grid.cells, todo, args.workers or os.cpu_count() or 1)
    print(f"{len(grid.cells) - len(todo):,} already done; estimate: {estimate.text()}", flush=True)
    if not args.dry_run:
        check_estimate(estimate, out_dir, args.allow_large)  # before any cell runs
    if args.dry_run:
        for cell in grid.cells:
            print(f"  {cell_key(cell)} {'done' if done[cell] else 'todo'} {cell}")
        return 0
    report = run_sweep(grid.cells, out_dir, executor=args.executor, workers=args.workers, address=args.address)
    where = f"{len(report.table)} rows -> {report.results_path}" if report.results_path else \
        "no cell has a result, nothing written"
    print(f"computed {report.computed}, cached {report.cached}, failed {len(report.failed)}; {where}")
    for key, error in sorted(report.failed.items()):
        print(f"  failed {key}: {error}")
    return 1 if report.failed else 0
