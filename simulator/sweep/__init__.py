"""Sweeps: a grid of independent cells (simulations, serving simulations or trace collections) run on a local
process pool or on Ray, each finished cell cached as a small Parquet file, all merged into one table.

    grid = load_grid("examples/sweeps/simulate_budgets.yaml")    # validated YAML -> list of cells
    report = run_sweep(grid.cells, "sweeps/budgets", executor="local", workers=2)
    report.table                                                  # = sweeps/budgets/results.parquet

A cell is a frozen dataclass (one per kind: SimulateCell, ServeCell, CollectCell) with one method `run()`
returning a DataFrame; `cell_key(cell)` hashes what it computes (not where it runs) and the content of what it
reads (`cell_inputs`: the project version, the trace run's manifest and committed sample parts, the profile
file) into the name of its cached result, OUT/cells/<key>.parquet, so a rerun skips finished cells and
recomputes those whose inputs changed. Every cell is validated when the grid is read, before any runs. The scheduler is not ours:
`concurrent.futures.ProcessPoolExecutor` locally, Ray tasks otherwise (`ray.init()` starts a local Ray;
`address=` joins a cluster). Workers return Parquet bytes and only the driver writes files, so on a cluster
the trace runs must be on a path every node sees (and thoughtkv installed on every node), the output
directory only on the driver. Collection cells are the exception: `thoughtkv trace` writes its run itself,
under OUT/runs/<key>/, which must then be shared too.

Grid files (YAML, read bounded by hwprofiles.loader.read_yaml_file): a scalar is fixed, a list is an axis,
the cells are the cross product.
See `examples/sweeps/` and GRID_KEYS (grid.py) for the keys each kind accepts.

The package by idea: cells.py (the cell kinds, their keys and input digests), grid.py (grid files -> cells),
executors.py (process pool, Ray), estimate.py (size and time before a sweep starts), merge.py (cached results
and the merged table), run.py (run_sweep). Every public name is importable from `simulator.sweep`.
"""

from __future__ import annotations

from simulator.sweep.cells import (
    CELL_KINDS,
    NOT_IN_KEY,
    CollectCell,
    ServeCell,
    SimulateCell,
    SweepError,
    cell_from_dict,
    cell_inputs,
    cell_key,
    cell_kind,
    cell_to_dict,
    file_digest,
    inputs_snapshot,
    run_cell_to_parquet,
    run_digest,
)
from simulator.sweep.estimate import (
    CELL_FILE_BYTES,
    MERGE_BYTES_PER_CELL,
    MERGE_SECONDS_PER_CELL,
    RESULT_ROW_BYTES,
    SIM_SECONDS_PER_LAYER_STEP,
    SIM_SECONDS_PER_SAMPLE,
    WHAT_IF_SECONDS_PER_LAYER_BLOCK,
    WHAT_IF_SECONDS_PER_SAMPLE,
    WORKER_BASE_BYTES,
    WORKER_BYTES_PER_LAYER_BLOCK,
    SweepEstimate,
    check_estimate,
    estimate_sweep,
)
from simulator.sweep.executors import (
    Executor,
    execute_local,
    execute_ray,
)
from simulator.sweep.grid import (
    COMMON_KEYS,
    GRID_KEYS,
    SERVE_OPTION_EXCLUDE,
    CellChecks,
    Grid,
    grid_from_dict,
    load_grid,
)
from simulator.sweep.merge import (
    cell_result_path,
    is_cached,
    merge_results,
    readable_result,
)
from simulator.sweep.run import (
    SweepReport,
    check_distinct_cells,
    run_sweep,
)

__all__ = [
    "CELL_FILE_BYTES",
    "CELL_KINDS",
    "COMMON_KEYS",
    "CellChecks",
    "CollectCell",
    "Executor",
    "GRID_KEYS",
    "Grid",
    "MERGE_BYTES_PER_CELL",
    "MERGE_SECONDS_PER_CELL",
    "NOT_IN_KEY",
    "RESULT_ROW_BYTES",
    "SERVE_OPTION_EXCLUDE",
    "SIM_SECONDS_PER_LAYER_STEP",
    "SIM_SECONDS_PER_SAMPLE",
    "ServeCell",
    "SimulateCell",
    "SweepError",
    "SweepEstimate",
    "SweepReport",
    "WHAT_IF_SECONDS_PER_LAYER_BLOCK",
    "WHAT_IF_SECONDS_PER_SAMPLE",
    "WORKER_BASE_BYTES",
    "WORKER_BYTES_PER_LAYER_BLOCK",
    "cell_from_dict",
    "cell_inputs",
    "cell_key",
    "cell_kind",
    "cell_result_path",
    "cell_to_dict",
    "check_distinct_cells",
    "check_estimate",
    "estimate_sweep",
    "execute_local",
    "execute_ray",
    "file_digest",
    "grid_from_dict",
    "inputs_snapshot",
    "is_cached",
    "load_grid",
    "merge_results",
    "readable_result",
    "run_cell_to_parquet",
    "run_digest",
    "run_sweep",
]
