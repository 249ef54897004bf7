"""`thoughtkv experiment micro-table`: the bundled `micro` model's capacity–accuracy table (tracer/micro/table.py).

    thoughtkv experiment micro-table --out docs/ [--runs build/micro_table] [--n-samples 200] [--cells key|all|quant]

One trace run per cell under --runs (resumable); `capacity_accuracy.md` is rewritten from the runs that exist.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtkv_base.options import SHARED, add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["out"].use(help="folder for capacity_accuracy.md", default=Path("docs")),
              SHARED["runs"].use(default=Path("build/micro_table")),
              SHARED["n_samples"].use(help="problems per cell", default=200),
              SHARED["cells"].use(choices=("key", "all", "quant"), help="key: full and the 30%% budget only; quant: "
                                  "hierarchy e=0 at 30%% with same/int8/int4 DDR"),
              "shard")


def run(args: argparse.Namespace) -> int:
    from tracer.micro.table import run_table

    print(f"wrote {run_table(args.out, args.runs, args.n_samples, args.cells, shard=args.shard)}")
    return 0
