"""`thoughtkv plot RUN_DIR... [--sim RESULTS...] --out DIR`: figures, tables and report.md.

    thoughtkv plot traces/samples/*                       # traces only: importance and accuracy figures
    thoughtkv plot runs/* --sim sim-results/ --out report # everything the data support
"""

from __future__ import annotations

import argparse
import sys

from thoughtkv_base.options import PATH, SHARED, TEXT, Flag, add_flags

OWN = (
    Flag("runs", "trace run directories (or a directory of runs, or simulator results files)", PATH, nargs="+",
         metavar="RUN_DIR"),
    Flag("--sim", "simulator results: results.parquet/.csv files or the directory `thoughtkv simulate --out` wrote",
         PATH, nargs="+", default=[], metavar="RESULTS"),
    # Text, read by traces.policy.parse_budget as the policy flags are; run refuses a token count (and says why).
    Flag("--budget", "HBM budget the latency breakdown and table single out (default: the smallest simulated)", TEXT,
         metavar="FRACTION"),
    Flag("--measured-profile", "profile to compare measured timings with (default: the simulated profiles measured "
         "by `thoughtkv calibrate`)", TEXT, metavar="NAME"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, *OWN,
              SHARED["out"].use(help="directory for report.md, figures/ and tables/ (new, empty or an earlier report; "
                                     "default: report)", default="report", metavar="DIR"),
              SHARED["quiet"].use(help="print only the report path"))


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
