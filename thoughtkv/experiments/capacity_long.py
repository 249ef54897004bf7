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
from thoughtkv_base.options import SHARED, add_flags

FIGURE_STEM = "accuracy_vs_recall_long"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["out"].use(help="folder for the table, its CSV and figures/", default=Path("docs")),
              SHARED["runs"].use(default=Path("build/micro_long_table")),
              SHARED["n_samples"].use(help="problems per cell", default=200),
              SHARED["cells"].use(choices=("key", "all"), help="key: full and the 30%% column only"),
              SHARED["figure_only"].use(help="draw from the runs there are; trace nothing"), "shard", "batch_size")


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
    from tracer.micro.table_long import run_table

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.figure_only:
        run_table(args.out, args.runs, args.n_samples, args.cells, shard=args.shard, batch_size=args.batch_size)
    print(f"wrote {draw(args.out, args.runs)}")
    return 0
