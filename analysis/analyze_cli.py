"""`thoughtkv analyze`: statistics on trace runs.

    thoughtkv analyze correlation RUN [--scorers attention,h2o,gradient] [--out DIR]

`correlation` ranks the tokens of each sample by two scorers' importances and reports the Spearman
correlation, mean over samples with a 95% bootstrap interval, for every pair (see analysis/correlation.py;
record the scorers with `thoughtkv trace --also-score A,B`). With --out it writes correlation.csv and the
forest plot correlation.png/.pdf there.
"""

from __future__ import annotations

import argparse

from thoughtkv_base import UserError
from thoughtkv_base.options import PATH, SHARED, TEXT, Flag, add_flags


class BadAnalyzeArgs(UserError):
    pass


CORRELATION = (
    Flag("run", "a trace run directory", PATH, metavar="RUN"),
    Flag("--scorers", "scorers to compare (default: every one recorded, incl. `attention`)", TEXT, metavar="A,B,..."),
)


def add_arguments(parser: argparse.ArgumentParser):
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS")
    correlation = sub.add_parser(
        "correlation", help="rank correlation between scorers' importances on one trace, with a CI over samples",
        description="Spearman rank correlation between every pair of scorers recorded in RUN (tokens.importance = "
                    "`attention`, plus the scorers of `thoughtkv trace --also-score`), mean over samples, 95% "
                    "bootstrap CI.",
    )
    add_flags(correlation, *CORRELATION,
              SHARED["out"].use(help="write correlation.csv and correlation.png/.pdf here", metavar="DIR"),
              SHARED["seed"].use(help="bootstrap seed"))
    correlation.set_defaults(_analysis=run_correlation)
    return sub


def run(args: argparse.Namespace) -> int:
    analysis = getattr(args, "_analysis", None)
    if analysis is None:
        raise BadAnalyzeArgs("name an analysis: `thoughtkv analyze correlation RUN` (see --help)")
    return analysis(args)


def run_correlation(args: argparse.Namespace) -> int:
    from analysis.correlation import choose_scorers, correlation_figure, correlation_table, scorer_importances
    from analysis.style import save_figure
    from traces import TraceFormatError, open_run

    run_path, out = args.run, args.out
    if out is not None and out.exists() and not out.is_dir():
        raise BadAnalyzeArgs(f"--out {out}: exists and is not a directory; choose another path")
    try:
        trace = open_run(run_path)
        tokens = trace.tokens()
    except TraceFormatError as exc:
        raise BadAnalyzeArgs(f"{run_path}: not a readable trace run ({exc})") from None
    importances = scorer_importances(tokens)
    requested = [s.strip() for s in args.scorers.split(",") if s.strip()] if args.scorers else None
    scorers = choose_scorers(importances, requested, str(run_path))
    table = correlation_table(importances, scorers, seed=args.seed)
    print(f"{run_path}: Spearman rank correlation per sample, mean over samples [95% bootstrap CI]")
    for row in table.itertuples():
        print(f"  {row.scorer_a:>12} vs {row.scorer_b:<12} {row.mean_spearman:+.3f} "
              f"[{row.ci_low:+.3f}, {row.ci_high:+.3f}]  median {row.median_spearman:+.3f}  n={row.n_samples}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "correlation.csv", index=False)
        policy = trace.manifest.get("policy", {}).get("name", "?")
        paths = save_figure(correlation_figure(table, title=f"{run_path.name} ({policy})"), out, "correlation")
        print(f"wrote {out / 'correlation.csv'}, {', '.join(str(p) for p in paths)}")
    return 0
