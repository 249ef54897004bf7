"""`thoughtkv plot RUN_DIR... [--sim RESULTS...] --out DIR`: figures, tables and report.md.

    thoughtkv plot traces/samples/*                       # traces only: importance and accuracy figures
    thoughtkv plot runs/* --sim sim-results/ --out report # everything the data support
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="trace run directories (or a directory of runs, or simulator results files)")
    parser.add_argument("--sim", nargs="+", default=[], metavar="RESULTS",
                        help="simulator results: results.parquet/.csv files or the directory `thoughtkv simulate --out` wrote")
    parser.add_argument("--out", default="report", metavar="DIR",
                        help="directory for report.md, figures/ and tables/ (new, empty or an earlier report; default: report)")
    parser.add_argument("--budget", default=None, metavar="FRACTION",
                        help="HBM budget the latency breakdown and table single out (default: the smallest simulated)")
    parser.add_argument("--measured-profile", default=None, metavar="NAME",
                        help="profile to compare measured timings with (default: the simulated profiles measured by "
                             "`thoughtkv calibrate`)")
    parser.add_argument("--quiet", action="store_true", help="print only the report path")


def run(args: argparse.Namespace) -> int:
    from analysis.report import build_report

    if args.budget is not None:
        from traces.policy import PolicyError, parse_budget

        args.budget = parse_budget(args.budget, "--budget")
        if args.budget > 1:  # the report's budgets are shares of the context (a token count would read as 700%)
            raise PolicyError(f"--budget {args.budget:g}: give a fraction of the context in (0, 1], e.g. 0.3")
    if args.measured_profile is not None:
        from hwprofiles import ProfileError, load_profile

        try:  # a name that is no profile is a typo: refuse it before drawing, not as a skipped Figure 6
            args.measured_profile = load_profile(args.measured_profile).name
        except ProfileError as exc:
            raise ProfileError(f"--measured-profile: {exc}") from None

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr)

    report = build_report(args.runs, args.sim, args.out, budget=args.budget,
                          measured_profile=args.measured_profile, log=log)
    drawn = sum(1 for entry in report.figures if entry.paths)
    if report.ignored:
        log("ignored (not a run or results file): " + ", ".join(str(p) for p in report.ignored))
    print(f"{report.path}: {drawn} of {len(report.figures)} figures, {len(report.tables)} tables")
    return 0
