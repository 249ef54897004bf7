"""`thoughtkv experiment micro-table`: the bundled `micro` model's capacity–accuracy table (tracer/micro/table.py).

    thoughtkv experiment micro-table --out docs/ [--runs build/micro_table] [--n-samples 200] [--cells key|all|quant]

One trace run per cell under --runs (resumable); `capacity_accuracy.md` is rewritten from the runs that exist.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtkv_base import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs"),
                        help="folder for capacity_accuracy.md (default: docs)")
    parser.add_argument("--runs", type=Path, default=Path("build/micro_table"),
                        help="one trace run per cell, resumed (default: build/micro_table)")
    parser.add_argument("--n-samples", type=int, default=200, help="problems per cell (default: 200)")
    parser.add_argument("--cells", choices=["key", "all", "quant"], default="all",
                        help="key: full and the 30%% budget only; quant: hierarchy e=0 at 30%% with same/int8/int4 "
                             "DDR (default: all)")
    parser.add_argument("--shard", default="0/1",
                        help="I/N: trace every N-th cell from the I-th, for N processes side by side (default: 0/1)")


def run(args: argparse.Namespace) -> int:
    if args.n_samples < 1:
        raise UserError(f"--n-samples must be >= 1 (got {args.n_samples})")
    from tracer.micro.table import run_table
    from tracer.micro.table_long import parse_shard

    print(f"wrote {run_table(args.out, args.runs, args.n_samples, args.cells, shard=parse_shard(args.shard))}")
    return 0
