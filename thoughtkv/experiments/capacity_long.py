"""`thoughtkv experiment capacity-long`: the long workload's capacity–accuracy–traffic table and its Pareto figure, one command.

    thoughtkv experiment capacity-long --out docs/ [--runs build/micro_long_table] [--n-samples 200] [--figure-only]

Traces every cell of `tracer.micro.table_long` (resumable: one `thoughtkv trace` run per cell), writes
`capacity_accuracy_long.md` and `.csv` into --out, then draws from the CSV `figures/accuracy_vs_recall_long.png`
(analysis.figures.accuracy_vs_recall: accuracy vs recalled tokens per layer-step, one curve per HBM budget and
recall rule, pure eviction and the full cache as references, 95% Wilson CIs). It lives at the top because it
needs both the tracer (to trace) and analysis (to draw).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtkv_base import UserError

FIGURE_STEM = "accuracy_vs_recall_long"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs"),
                        help="folder for the table, its CSV and figures/ (default: docs)")
    parser.add_argument("--runs", type=Path, default=Path("build/micro_long_table"),
                        help="one trace run per cell, resumed (default: build/micro_long_table)")
    parser.add_argument("--n-samples", type=int, default=200, help="problems per cell (default: 200)")
    parser.add_argument("--cells", choices=["key", "all"], default="all",
                        help="key: full and the 30%% column only (default: all)")
    parser.add_argument("--figure-only", action="store_true", help="draw from the runs there are; trace nothing")
    parser.add_argument("--shard", default="0/1",
                        help="I/N: trace every N-th cell from the I-th, for N processes side by side (default: 0/1)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="samples decoded per step: the same results, faster (default: 1)")


def draw(out: Path, runs: Path) -> Path:
    """The figure from the runs that exist (through the table's CSV, rewritten first)."""
    import pandas as pd

    from analysis.figures import accuracy_vs_recall
    from analysis.style import save_figure
    from tracer.micro.table_long import CSV_NAME, write_markdown

    write_markdown(out / "capacity_accuracy_long.md", runs)
    csv = out / CSV_NAME
    frame = pd.read_csv(csv) if csv.stat().st_size else pd.DataFrame(columns=["policy"])
    if frame.empty or not (frame["policy"] == "hierarchy").any():
        raise UserError(f"{runs}: no hierarchy cell has run yet; run `thoughtkv experiment capacity-long` without --figure-only")
    return save_figure(accuracy_vs_recall(frame), out / "figures", FIGURE_STEM)[0]


def run(args: argparse.Namespace) -> int:
    if args.n_samples < 1 or args.batch_size < 1:
        raise UserError(f"--n-samples and --batch-size must be >= 1 (got {args.n_samples}, {args.batch_size})")
    from tracer.micro.table_long import parse_shard, run_table

    shard = parse_shard(args.shard)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.figure_only:
        run_table(args.out, args.runs, args.n_samples, args.cells, shard=shard, batch_size=args.batch_size)
    print(f"wrote {draw(args.out, args.runs)}")
    return 0
