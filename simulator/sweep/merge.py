"""Cached cell results on disk (OUT/cells/<key>.parquet) and their merge into one results table."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from simulator.sweep.cells import cell_key
from traces.layout import write_bytes_atomic


def cell_result_path(out_dir: Path, cell) -> Path:
    return out_dir / "cells" / f"{cell_key(cell)}.parquet"


def is_cached(out_dir: Path, cell) -> bool:
    """The cell has a usable result under out_dir (what run_sweep skips)."""
    return readable_result(cell_result_path(out_dir, cell))


def readable_result(path: Path) -> bool:
    """A cached cell result that pyarrow can open (a truncated or foreign file is not one)."""
    if not path.is_file():
        return False
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception:  # noqa: BLE001 - pyarrow raises many types for a damaged file
        return False
    return True


def merge_results(cells: list, out_dir: Path, paths: list[Path] | None = None) -> tuple[pd.DataFrame, Path | None]:
    """One table of every finished cell of this grid, sorted so that any executor gives the same table, and
    where it was written (None when no cell has a result: nothing is written then)."""
    paths = paths if paths is not None else [cell_result_path(out_dir, c) for c in cells]
    parts = [pd.read_parquet(p) for p in paths if p.is_file()]
    if not parts:
        return pd.DataFrame(), None
    table = pd.concat(parts, ignore_index=True)
    sort_by = ["cell_key"] + [c for c in ("sample_id",) if c in table.columns]
    table = table.sort_values(sort_by, kind="stable").reset_index(drop=True)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    write_bytes_atomic(out_dir / "results.parquet", buffer.getvalue())
    write_bytes_atomic(out_dir / "results.csv", table.to_csv(index=False).encode())
    return table, out_dir / "results.parquet"
