"""Where cells run: a local process pool or Ray tasks; both yield (cell, Parquet bytes or the exception) as
cells finish."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from simulator.sweep.cells import SweepError, cell_key, cell_to_dict, run_cell_to_parquet

Executor = Callable[[list, int], Iterator[tuple[Any, bytes | BaseException]]]


def execute_local(cells: list, workers: int, keys: dict | None = None) -> Iterator[tuple[Any, bytes | BaseException]]:
    """A process pool (spawned workers: safe next to a Ray driver's threads); yields cells as they finish.
    Stopped early (Ctrl-C, SIGTERM, the caller closing this generator), it terminates its workers at once
    (thoughtkv_base.pool); finished cells are already on disk, the driver writes them."""
    from concurrent.futures import as_completed

    from thoughtkv_base.pool import process_pool

    if workers == 1:  # no pool: same code path, no start-up cost
        for cell in cells:
            yield cell, _call(cell, keys)
        return
    with process_pool(min(workers, len(cells) or 1)) as pool:
        futures = {pool.submit(run_cell_to_parquet, cell_to_dict(cell), _key(cell, keys)): cell for cell in cells}
        for future in as_completed(futures):
            exc = future.exception()
            yield futures[future], exc if exc is not None else future.result()


def _key(cell, keys: dict | None) -> str:
    return keys[cell] if keys is not None else cell_key(cell)


def _call(cell, keys: dict | None = None) -> bytes | BaseException:
    try:
        return run_cell_to_parquet(cell_to_dict(cell), _key(cell, keys))
    except Exception as exc:  # a failed cell is reported at the end; the others still run
        return exc


def execute_ray(cells: list, workers: int, address: str | None = None,
                keys: dict | None = None) -> Iterator[tuple[Any, bytes | BaseException]]:
    """Ray tasks, one per cell (`num_cpus=1`, `num_gpus` from the cell); yields cells as they finish.

    Joins the running Ray if this process already initialised one, else `ray.init(address)`: None starts a
    local Ray with `workers` CPUs, "auto" or "ray://host:10001" joins a cluster (see README).
    """
    try:
        import ray
    except ImportError:
        raise SweepError("Ray is not installed; `pip install 'thoughtkv[ray]'` or use --executor local") from None
    started_here = False
    if not ray.is_initialized():
        if address is None:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        started_here = True
    try:
        remote = ray.remote(run_cell_to_parquet)
        pending = {
            remote.options(num_cpus=1, num_gpus=cell.num_gpus, max_retries=0).remote(cell_to_dict(cell),
                                                                                    _key(cell, keys)): cell
            for cell in cells
        }
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(done[0])
            try:
                yield cell, ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                yield cell, exc.as_instanceof_cause()
    finally:
        if started_here:
            ray.shutdown()
