"""Size and time of a sweep, before it starts: from each trace run's size and measured per-cell costs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simulator.sweep.cells import SimulateCell, SweepError

# What a cell costs, measured on the 2-core development machine (tests/test_sweep.py checks the estimate against a
# small sweep's own files): a simulate cell replays its run in ~10 ms per sample + ~4 us per layer-step; a what-if
# re-places the recorded masses, ~20 ms per sample + ~0.12 us per layer-block more (the shipped micro runs: 0.2-0.35
# s a replay, 0.5-1.3 s a what-if; a 4-sample qwen2-7b synth run of 2,000 steps: 0.9 s and 5.3 s). Each cached result
# is a ~34 kB Parquet file; the merge reads them all (~6 ms and ~60 kB of memory a cell); a worker process holds
# ~200 MiB of libraries plus its run (~30 B per layer-block of its longest sample under a what-if).
SIM_SECONDS_PER_SAMPLE, SIM_SECONDS_PER_LAYER_STEP = 0.010, 4e-6
WHAT_IF_SECONDS_PER_SAMPLE, WHAT_IF_SECONDS_PER_LAYER_BLOCK = 0.020, 0.12e-6
CELL_FILE_BYTES, RESULT_ROW_BYTES = 34_000, 1_000
MERGE_SECONDS_PER_CELL, MERGE_BYTES_PER_CELL = 0.006, 60_000
WORKER_BASE_BYTES, WORKER_BYTES_PER_LAYER_BLOCK = 200 * 2**20, 30


@dataclass(frozen=True)
class SweepEstimate:
    cells: int  # to compute
    workers: int
    seconds: float | None  # None when no cell's time can be estimated
    untimed: int  # cells whose time is not estimated (serve, collect)
    disk_bytes: int
    memory_bytes: int

    def text(self) -> str:
        from simulator.synth import duration_text, size_text

        if self.seconds is None:
            time = "time not estimated (serving and collection cells)"
        else:
            time = f"~{duration_text(self.seconds)}" + (f" + {self.untimed:,} untimed serve/collect cells"
                                                        if self.untimed else "")
        return (f"{self.cells:,} cells to compute on {self.workers} worker(s): {time}, ~{size_text(self.disk_bytes)} "
                f"on disk, ~{size_text(self.memory_bytes)} peak memory")


def estimate_sweep(cells: list, todo: list, workers: int) -> SweepEstimate:
    """Time, disk and memory of computing `todo` and merging `cells`, from each run's size (the constants above)."""
    sizes: dict[str, dict] = {}
    seconds, untimed, worker_bytes = 0.0, 0, WORKER_BASE_BYTES
    for cell in todo:
        if not isinstance(cell, SimulateCell):
            untimed += 1
            continue
        if cell.run_dir not in sizes:
            sizes[cell.run_dir] = _run_size(cell.run_dir)
        size = sizes[cell.run_dir]
        seconds += SIM_SECONDS_PER_SAMPLE * size["samples"] + SIM_SECONDS_PER_LAYER_STEP * size["layer_steps"]
        if cell.what_if:
            seconds += WHAT_IF_SECONDS_PER_SAMPLE * size["samples"] + WHAT_IF_SECONDS_PER_LAYER_BLOCK * size["layer_blocks"]
            worker_bytes = max(worker_bytes, WORKER_BASE_BYTES + WORKER_BYTES_PER_LAYER_BLOCK * size["max_sample_layer_blocks"])
    workers = max(1, min(workers, len(todo) or 1))
    timed = len(todo) - untimed
    total = seconds / workers + MERGE_SECONDS_PER_CELL * len(cells) if timed or not todo else None
    return SweepEstimate(cells=len(todo), workers=workers, seconds=total, untimed=untimed,
                         disk_bytes=CELL_FILE_BYTES * len(todo) + RESULT_ROW_BYTES * len(cells),
                         memory_bytes=MERGE_BYTES_PER_CELL * len(cells) + workers * worker_bytes)


def _run_size(run_dir: str) -> dict:
    """Samples, layer-steps and layer-blocks (blocks attended per layer and step, summed) of a trace run."""
    import numpy as np

    from traces.reader import open_run

    run = open_run(run_dir)
    samples = run.samples()
    n_layers, block_size = run.n_layers, run.block_size
    blocks = [int((-(-(int(p) + np.arange(int(g) + 1)) // block_size)).sum()) * n_layers
              for p, g in zip(samples["prompt_tokens"], samples["generated_tokens"])]
    return {"samples": len(samples), "layer_steps": int((samples["generated_tokens"] + 1).sum()) * n_layers,
            "layer_blocks": sum(blocks), "max_sample_layer_blocks": max(blocks, default=0)}


def check_estimate(estimate: SweepEstimate, out_dir: Path, allow_large: bool) -> None:
    """Refuse, before any cell runs, a sweep whose estimate exceeds the memory available or the disk free."""
    from simulator.synth import exceeded_limit

    exceeded = None if allow_large else exceeded_limit(estimate.memory_bytes, estimate.disk_bytes, out_dir)
    if exceeded:
        raise SweepError(f"the sweep needs {exceeded} ({estimate.text()}); split the grid, use fewer --workers, "
                         "or --allow-large to try anyway")
