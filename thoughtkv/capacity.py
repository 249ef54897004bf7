"""`thoughtkv capacity RUN_DIR... --profile P... --out DIR`: capacity as served, one line.

    thoughtkv capacity runs/full runs/hier30 --profile h100-pcie --profile gh200-96gb --as-model qwen2-7b \\
        --lengths r1-7b/gsm8k --overhead-mode cuda-graphs --transfer dma-batched --max-batch 4096 --out capacity/

For every run x profile, serve Poisson arrivals at a grid of rates (`--rates`, then `--refine` rounds of three
rates inside the bracket where the SLO starts to fail, and doublings / halvings while no rate or every rate
fails) through the sweep machinery (simulator/sweep.py: a local process pool or Ray, each cell cached by the
content of its run and profile, so a rerun or a wider grid recomputes nothing it has), then write
OUT/report/: the serving figures, tables and a report section (analysis/serving.py), and print the max
sustainable rate per policy and profile with each run's accuracy and traffic.

Sustainable: p99 TBT <= --tbt-slo-s, p99 TTFT <= --ttft-slo-s, nothing rejected (analysis/serving.py). An
overloaded server's TBT can stay low (admission caps the batch) while its queue grows, so capacity needs a TTFT
bound: serving's own default (`simulator.options.DEFAULT_TTFT_SLO_S`) unless given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from thoughtkv_base import UserError
from thoughtkv_base.options import INT, PATH, SHARED, TEXT, Flag, add_flags

DEFAULT_RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
REFINE_POINTS = 3  # rates added inside the failing bracket per refinement round (log-spaced)
MAX_EXTENSIONS = 8  # doublings (or halvings) of the grid while every (or no) swept rate is sustainable
MIN_RATE_PER_S = 1e-3
MIN_WINDOW_REQUESTS = 3  # halvings stop where a window expects fewer requests (P(none) = 5%): they say nothing


class CapacityError(UserError):
    pass


OWN = (
    Flag("run_dirs", "trace runs (one per policy)", PATH, nargs="+", metavar="RUN_DIR"),
    Flag("--rates", "arrival rates (requests/s) swept first", TEXT, default=",".join(f"{r:g}" for r in DEFAULT_RATES),
         metavar="R,R"),
    # INT, not NONNEGATIVE_INT: run() refuses a negative count saying what 0 means.
    Flag("--refine", f"rounds of {REFINE_POINTS} more rates inside each failing bracket", INT, default=2, metavar="N"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator import options as sim_options

    add_flags(parser, *OWN, SHARED["profile"].use(action="append", default=[], metavar="NAME",
                                                  help="hardware profile name or YAML path (repeatable)"))
    # --duration-s, --max-batch, --tbt-slo-s, --ttft-slo-s, --seed, --lengths, --batch-copies (ServingConfig)
    sim_options.add_arguments(parser, sim_options.ServingConfig, exclude=("rate_per_s", "arrivals_csv"))
    sim_options.add_arguments(parser, exclude=("batch", "engine"))  # --overlap, --overhead-mode, --transfer, ...
    sim_options.add_arguments(parser, sim_options.Projection)  # --as-model, --as-dtype, --context-scale, --recalls
    add_flags(parser, SHARED["executor"].use(help="local process pool (default) or Ray (simulator/sweep.py)"),
              "address", "workers",
              SHARED["out"].use(required=True, metavar="DIR", help="OUT/sweep (cached cells, results.parquet) and "
                                                                   "OUT/report (figures, tables, serving.md)"))


def base_config(args: argparse.Namespace):
    """The ServingConfig every cell shares (the rate aside), checked once before anything runs."""
    from simulator import options as sim_options

    return sim_options.from_args(args, sim_options.ServingConfig, options=sim_options.from_args(args),
                                 projection=sim_options.from_args(args, sim_options.Projection))


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        raise CapacityError(f"--rates {text!r}: give numbers separated by commas, e.g. 1,2,4,8") from None
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise CapacityError(f"--rates {text!r}: every rate must be a finite number > 0 (requests/s)")
    return rates


def _rounded(rate: float) -> float:
    """4 significant digits: refined rates stay stable cache keys across reruns."""
    return float(f"{rate:.4g}")


def next_rates(rates: list[float], ok: list[bool], refined: int, extended: int, refine: int,
               max_extensions: int = MAX_EXTENSIONS, min_rate: float = MIN_RATE_PER_S) -> tuple[list[float], str | None]:
    """Rates to add for one (run, profile), and why: "extend" (double past the top while nothing failed, halve
    below the bottom while everything failed, at most `max_extensions` times and not below `min_rate`) or
    "refine" (REFINE_POINTS log-spaced rates inside the failing bracket, `refine` rounds); ([], None) when the
    bracket is done. `refined` and `extended`: the rounds of each kind this (run, profile) had."""
    from analysis.serving import bracket

    low, high = bracket(rates, ok)
    if high is None or low is None:
        rate = 2 * max(rates) if high is None else min(rates) / 2
        if extended >= max_extensions or rate < min_rate:
            return [], None
        return [_rounded(rate)], "extend"
    if refined >= refine:
        return [], None
    step = (math.log(high) - math.log(low)) / (REFINE_POINTS + 1)
    more = [r for r in (_rounded(math.exp(math.log(low) + k * step)) for k in range(1, REFINE_POINTS + 1))
            if low < r < high and r not in rates]
    return more, "refine" if more else None


def capacity_sweep(run_dirs: list[Path], profiles: list[str], config, rates: list[float], refine: int, out: Path,
                   executor: str = "local", workers: int | None = None, address: str | None = None,
                   progress: bool = True, log=print, max_extensions: int = MAX_EXTENSIONS):
    """Sweep rates per run x profile until every bracket is refined; returns (serving table, capacity table).
    Halving stops where a window would hold fewer than MIN_WINDOW_REQUESTS expected requests, and where the
    lowest rate failed with every request alone (analysis.serving.alone_failure: no lower rate can help)."""
    from analysis.serving import alone_failure, capacity_table, serving_table, sustainable
    from hwprofiles import load_profile
    from simulator.sweep import ServeCell, run_sweep

    runs = [str(Path(r).resolve()) for r in run_dirs]
    # the cells load each profile as given (a name or a file), the tables name it as results do
    # (hwprofiles.loader.load_profile: a copy of a shipped profile is named after its file)
    named = {profile: load_profile(profile).name for profile in profiles}
    swept = {(run, profile): sorted(rates) for run in runs for profile in profiles}
    rounds = {pair: {"refine": 0, "extend": 0} for pair in swept}  # per (run, profile): rounds of each kind
    table = None
    for round_index in range(refine + max_extensions + 1):
        cells = [ServeCell(run_dir=run, profile=profile, config=dataclasses.replace(config, rate_per_s=rate))
                 for (run, profile), grid in swept.items() for rate in grid]
        report = run_sweep(cells, out, executor=executor, workers=workers, address=address, progress=progress)
        if report.failed:
            key, error = sorted(report.failed.items())[0]
            raise CapacityError(f"{len(report.failed)} serving cell(s) failed, e.g. {key}: {error}")
        table = serving_table(report.table, runs, [named[p] for p in profiles])
        table["sustainable"] = sustainable(table, config.tbt_slo_s, config.ttft_slo_s)
        added = 0
        for (run, profile), grid in swept.items():
            rows = table[(table["run_dir"] == run) & (table["profile"] == named[profile])]
            done = rounds[(run, profile)]
            lowest = rows.loc[rows["rate_per_s"].idxmin()]
            if not lowest["sustainable"] and alone_failure(lowest, config.tbt_slo_s, config.ttft_slo_s):
                more, kind = [], None  # the SLO is out of reach at any rate
            else:
                more, kind = next_rates(list(rows["rate_per_s"]), list(rows["sustainable"]), done["refine"],
                                        done["extend"], refine, max_extensions,
                                        max(MIN_RATE_PER_S, MIN_WINDOW_REQUESTS / config.duration_s))
            if kind is not None:
                done[kind] += 1
            swept[(run, profile)] = sorted(set(grid) | set(more))
            added += len(more)
        log(f"capacity: round {round_index + 1}, {len(cells)} cells ({report.computed} computed), {added} rates added")
        if not added:
            break
    return table, capacity_table(table, config.tbt_slo_s, config.ttft_slo_s)


def run(args: argparse.Namespace) -> int:
    from analysis.serving import max_rate_text, slo_text, write_serving_section
    from hwprofiles import load_profile
    from traces import open_run

    if not args.profile:
        raise CapacityError("no hardware given; add --profile NAME (repeatable; see `thoughtkv profiles list`)")
    if args.refine < 0:
        raise CapacityError(f"--refine {args.refine}: give a number of refinement rounds >= 0 (0: the swept rates "
                            "and their extensions only)")
    if args.address is not None and args.executor != "ray":
        raise CapacityError("--address joins a Ray cluster; add --executor ray or drop --address")
    rates = parse_rates(args.rates)
    config = base_config(args)
    for run_dir in args.run_dirs:
        open_run(run_dir)  # a run.json that cannot be read fails before anything is simulated
    resolved = [Path(r).resolve() for r in args.run_dirs]
    twice = next((r for r, path in zip(args.run_dirs, resolved) if resolved.count(path) > 1), None)
    if twice is not None:
        raise CapacityError(f"{twice}: given twice; name each run once")
    for name in args.profile:
        load_profile(name)  # unknown names fail now, in one line
    profiles = list(dict.fromkeys(args.profile))
    if args.out.exists() and not args.out.is_dir():
        raise CapacityError(f"--out {args.out}: exists and is not a directory; choose another path")
    if args.ttft_slo_s is None:
        print(f"capacity: a rate is sustainable only with p99 TTFT <= {config.ttft_slo_s:g} s (--ttft-slo-s: the "
              "queue stays bounded)", file=sys.stderr)
    table, capacity = capacity_sweep(args.run_dirs, profiles, config, rates, args.refine, args.out / "sweep",
                                     args.executor, args.workers, args.address,
                                     log=lambda m: print(m, file=sys.stderr))
    if capacity["no_rate_meets_slo"].all():  # nothing to draw: say why, write no report
        row = capacity.iloc[0]
        raise CapacityError(f"no rate meets this SLO ({slo_text(config.tbt_slo_s, config.ttft_slo_s)}): "
                            f"{row['limit'].removeprefix('SLO out of reach: ')} on {row['profile']} "
                            f"({row['label']}); relax --tbt-slo-s / --ttft-slo-s")
    written = write_serving_section(table, capacity, args.out / "report", config.tbt_slo_s, config.ttft_slo_s)
    for _, row in capacity.iterrows():
        if row["no_rate_meets_slo"]:
            print(f"{row['profile']:<14} {row['label']:<34} no rate meets this SLO: "
                  f"{row['limit'].removeprefix('SLO out of reach: ')}")
            continue
        print(f"{row['profile']:<14} {row['label']:<34} max {max_rate_text(row):>8} req/s ({row['limit']}); "
              f"accuracy {100 * row['accuracy']:.1f}% [{100 * row['ci_low']:.1f}, {100 * row['ci_high']:.1f}] "
              f"n={int(row['n_scored'])}")
    print(f"wrote {', '.join(str(p) for p in written if p.suffix in ('.md', '.png', '.csv'))}")
    return 0
