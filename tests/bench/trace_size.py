"""Size budget of a trace run: one sample, 200-token prompt + 2,000 decoded tokens, 28 layers (the 7B's
shape), block size 16, access recorded with the default encoding. Budget: <= 4 MB for the whole run.

Prints, side by side in one run: the run's size on disk, the access table as stored (log2-u8) against the
same masses stored as float16 in Parquet+zstd, the ratio, and the encoding's measured error.
Exit status 1 when over budget. Run: .venv/bin/python tests/bench/trace_size.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces import TraceWriter, max_relative_error, open_run
from traces.encoding import FLOOR_LOG2
from traces.example import example_manifest, example_sample

BUDGET_BYTES = 4_000_000
PROMPT_TOKENS, GENERATED_TOKENS, ARCHITECTURE = 200, 2000, "qwen2-7b"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def float16_parquet_bytes(masses: list[np.ndarray], path: Path) -> int:
    """The straightforward alternative: the same masses as list<float16> in Parquet with the same zstd level."""
    flat = np.concatenate(masses).astype(np.float16)
    offsets = np.concatenate([[0], np.cumsum([len(m) for m in masses])]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float16()))
    pq.write_table(pa.table({"block_mass": column}), path, compression="zstd", compression_level=9)
    return path.stat().st_size


def main() -> int:
    sample = example_sample("bench/0", prompt_tokens=PROMPT_TOKENS, generated_tokens=GENERATED_TOKENS,
                            n_layers=28, block_size=16, seed=0)
    masses = sample["access"]["block_mass"]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        started = time.perf_counter()
        with TraceWriter(run_dir, example_manifest(architecture=ARCHITECTURE, sample_ids=["bench/0"])) as writer:
            writer.write_sample(**sample)
        write_s = time.perf_counter() - started
        run_bytes = dir_bytes(run_dir)
        access_bytes = dir_bytes(run_dir / "access.parquet")
        f16_bytes = float16_parquet_bytes(masses, Path(tmp) / "f16.parquet")
        decoded = open_run(run_dir).access("bench/0")["block_mass"]

    original = np.concatenate(masses).astype(np.float64)
    restored = np.concatenate(list(decoded)).astype(np.float64)
    warm = original >= 2.0**FLOOR_LOG2
    rel_err = np.abs(restored[warm] - original[warm]) / original[warm]
    dropped = original[~warm]
    row_sums = np.array([d.sum(dtype=np.float64) for d in decoded])
    n_values = original.size

    print(f"sample: {PROMPT_TOKENS} prompt + {GENERATED_TOKENS} decoded tokens, 28 layers, block 16 "
          f"-> {len(masses):,} (step, layer) rows, {n_values:,} block masses; written in {write_s:.2f} s")
    print(f"whole run directory        {run_bytes / 1e6:6.2f} MB   (budget {BUDGET_BYTES / 1e6:.0f} MB)")
    print(f"access, log2-u8 + zstd     {access_bytes / 1e6:6.2f} MB")
    print(f"access, float16 + zstd     {f16_bytes / 1e6:6.2f} MB   (same masses, same Parquet settings)")
    print(f"access, raw float16        {2 * n_values / 1e6:6.2f} MB   (2 bytes x block masses)")
    print(f"ratio log2-u8 / float16+zstd = {access_bytes / f16_bytes:.2f}; whole run / raw float16 = "
          f"{run_bytes / (2 * n_values):.2f}")
    print(f"encoding max relative error: measured {rel_err.max():.2%} (bound {max_relative_error():.2%}) on "
          f"{warm.mean():.1%} of blocks; {(~warm).mean():.1%} below the 2^{FLOOR_LOG2} floor dropped "
          f"(largest {dropped.max() if dropped.size else 0:.2e}); decoded row sums in "
          f"[{row_sums.min():.4f}, {row_sums.max():.4f}]")
    if run_bytes > BUDGET_BYTES:
        print(f"OVER BUDGET: {run_bytes / 1e6:.2f} MB > {BUDGET_BYTES / 1e6:.0f} MB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
