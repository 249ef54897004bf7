"""run_sweep: the cells not cached computed by an executor, then every cell's table merged."""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from simulator.sweep.cells import SweepError, inputs_snapshot
from simulator.sweep.executors import execute_local, execute_ray
from simulator.sweep.merge import cell_result_path, merge_results, readable_result
from traces.layout import write_bytes_atomic


@dataclass
class SweepReport:
    table: pd.DataFrame
    computed: int
    cached: int
    failed: dict[str, str]  # cell key -> one-line error
    results_path: Path | None = None  # the merged table, None when no cell has a result (nothing written)


def run_sweep(
    cells: list, out_dir: str | Path, executor: str = "local", workers: int | None = None,
    address: str | None = None, progress: bool = True,
) -> SweepReport:
    """Run the cells not cached under `out_dir/cells/`, then merge every cell's table into `results.parquet`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepError(f"--out {out_dir} is a file; pass a directory")
    if executor not in ("local", "ray"):
        raise SweepError(f"executor {executor!r} is unknown; use local or ray")
    workers = workers or os.cpu_count() or 1
    with inputs_snapshot():
        paths = {cell: cell_result_path(out_dir, cell) for cell in cells}  # keys from the inputs as they are now
    check_distinct_cells(cells, {cell: path.stem for cell, path in paths.items()})
    (out_dir / "cells").mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not readable_result(paths[c])]  # a damaged cached result is computed again
    keys = {cell: path.stem for cell, path in paths.items()}
    finished = execute_local(todo, workers, keys) if executor == "local" else execute_ray(todo, workers, address, keys)
    failed: dict[str, str] = {}
    from tqdm import tqdm

    # closing: a Ctrl-C raised here, between two results, still stops the executor's workers now (an unclosed
    # generator would run its cleanup only when collected, after the command has exited)
    with closing(finished), tqdm(total=len(cells), initial=len(cells) - len(todo), unit="cell",
                                 disable=not progress, desc=f"sweep ({executor})") as bar:
        for cell, result in finished:
            if isinstance(result, BaseException):
                lines = str(result).strip().splitlines() or [""]
                failed[paths[cell].stem] = f"{type(result).__name__}: {lines[-1]}"
            else:
                write_bytes_atomic(paths[cell], result)
            bar.update(1)
    table, written = merge_results(cells, out_dir, [paths[c] for c in cells])
    return SweepReport(table=table, computed=len(todo) - len(failed), cached=len(cells) - len(todo), failed=failed,
                       results_path=written)


def check_distinct_cells(cells: list, keys: dict) -> None:
    """Refuse a grid whose cells compute the same thing twice (axis values that differ as written but mean the
    same, such as 1 and 1.0), naming the cell key; `keys`: cell -> cell_key. (A value listed twice as written
    is refused when the grid is read, naming its axis.)"""
    seen: set[str] = set()
    for cell in cells:
        if keys[cell] in seen:
            raise SweepError(f"the grid lists the same cell twice (cell {keys[cell]}); remove the duplicate value "
                             "from its axis")
        seen.add(keys[cell])
