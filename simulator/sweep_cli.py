"""`thoughtkv sweep --grid FILE.yaml [--executor local|ray] [--address ADDR] [--workers N] [--out DIR]`.

Runs every cell of the grid that has no cached result under OUT/cells/, shows progress, and writes the merged
table to OUT/results.parquet and OUT/results.csv. Rerunning skips finished cells (an interrupted sweep
resumes). Examples: examples/sweeps/*.yaml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtkv_base.options import PATH, SHARED, Flag, add_flags

OWN = (Flag("--grid", "grid YAML file (see examples/sweeps/)", PATH, metavar="FILE", required=True),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, *OWN, "executor", "address",
              SHARED["workers"].use(default_text="CPU count; with Ray: CPUs of the local Ray it starts"),
              SHARED["out"].use(help="output directory (default: sweeps/<grid file stem>)"),
              SHARED["dry_run"].use(help="list the cells and which are cached; run none"),
              SHARED["allow_large"].use(help="run even when the estimate says the sweep will not fit in this "
                                             "machine's memory or disk (default: refuse)"))


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
    out_dir = args.out if args.out is not None else Path("sweeps") / args.grid.stem
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
