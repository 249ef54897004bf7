"""`thoughtkv serve-sim RUN_DIR [RUN_DIR ...] --profile NAME [...] --rate-per-s R --duration-s S --max-batch N`.

Serving simulation (simulator/serving.py): requests arrive (Poisson at R/s for S seconds, or the rows of
--arrivals-csv CSV), each replays a sample of the run, and share one GPU with continuous batching, HBM admission
and one host link. Give several runs (e.g. a full-cache trace and a 30%-budget trace of the same task) and
several profiles to compare them: one table row per (run, profile).

Arrival CSV: one row per request with columns `arrival_s,prompt_tokens,output_tokens` (seconds from the
start), or the Azure LLM inference trace's `TIMESTAMP,ContextTokens,GeneratedTokens` (timestamps; shifted to
start at 0). Each request replays the run's sample nearest in (prompt, output) length, cut at its output tokens.

Writes OUT/serving_summary.{parquet,csv} (one row per run x profile), OUT/serving_requests.parquet and
OUT/serving_timeline.parquet (per iteration: running, waiting, HBM/DDR occupancy). OUT defaults to
RUN_DIR/serving for one run, else ./serving.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from simulator import options as sim_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.options import ServingConfig

    parser.add_argument("run_dirs", metavar="RUN_DIR", type=Path, nargs="+", help="trace run(s) to serve")
    parser.add_argument("--profile", action="append", default=[], metavar="NAME",
                        help="hardware profile name or YAML path (repeatable)")
    # --rate-per-s, --duration-s, --max-batch, --tbt-slo-s, ... : one flag per ServingConfig field
    sim_options.add_arguments(parser, ServingConfig)
    # --overlap, --async-offload, --engine, --offload-tier, --transfer (a serving batch is --max-batch requests)
    sim_options.add_arguments(parser, exclude=("batch",))
    # --as-model, --as-dtype, --context-scale, --recalls: the same fields (and checks) as simulate's
    sim_options.add_arguments(parser, sim_options.Projection)
    parser.add_argument("--timeline", type=Path, metavar="FILE",
                        help="Chrome-trace JSON (Perfetto) of the first run on the first profile")
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default: RUN_DIR/serving for one run, else ./serving)")


def serving_config(args: argparse.Namespace):
    """The ServingConfig the flags describe (validated by it: one line naming the wrong option)."""
    from simulator.errors import ServingError
    from simulator.options import ServingConfig

    config = sim_options.from_args(args, ServingConfig, options=sim_options.from_args(args),
                                   projection=sim_options.from_args(args, sim_options.Projection))
    if config.arrivals_csv is not None and not Path(config.arrivals_csv).is_file():
        raise ServingError(f"--arrivals-csv {config.arrivals_csv}: not found; pass an existing CSV")
    unused = [f"--{n.replace('_', '-')}" for n in ("rate_per_s", "duration_s") if getattr(args, n, None) is not None]
    if config.arrivals_csv is not None and unused:  # never silently: the CSV's times decide the arrivals
        print(f"warning: {' and '.join(unused)} unused: --arrivals-csv gives the arrivals", file=sys.stderr)
    return config


def run(args: argparse.Namespace) -> int:
    import io

    import pandas as pd
    from tqdm import tqdm

    from hwprofiles import load_profile
    from simulator.engine import Timeline
    from simulator.serving import ServingError, simulate_serving
    from traces import open_run
    from traces.layout import write_bytes_atomic

    if not args.profile:
        raise ServingError("no hardware given; add --profile NAME (see `thoughtkv profiles list`)")
    config = serving_config(args)
    for run_dir in args.run_dirs:
        open_run(run_dir)  # checks run.json before anything is simulated or written
    profiles = [load_profile(name) for name in args.profile]
    out = args.out or (args.run_dirs[0] / "serving" if len(args.run_dirs) == 1 else Path("serving"))
    if out.exists() and not out.is_dir():
        raise ServingError(f"--out {out}: exists and is not a directory; choose another path")
    if args.timeline is not None and (args.timeline.is_dir() or not args.timeline.parent.is_dir()):
        raise ServingError(f"--timeline {args.timeline}: give a file name in an existing directory")

    timeline = Timeline() if args.timeline is not None else None
    summaries, requests, timelines = [], [], []
    cases = [(r, p) for r in args.run_dirs for p in profiles]
    for run_dir, profile in tqdm(cases, desc="serve-sim", unit="case", disable=len(cases) < 2):
        record = timeline if (run_dir, profile) == cases[0] else None
        if record is not None:
            record.begin_process(f"{profile.name} serving {run_dir.name}")
        result = simulate_serving(run_dir, profile, config, timeline=record, progress=True)
        summaries.append(result.summary)
        keys = {"run_dir": str(run_dir), "profile": profile.name}
        requests.append(result.requests.assign(**keys))
        timelines.append(result.timeline.assign(**keys))
    out.mkdir(parents=True, exist_ok=True)
    summary = pd.DataFrame(summaries)
    tables = {"serving_summary.parquet": summary, "serving_requests.parquet": pd.concat(requests, ignore_index=True),
              "serving_timeline.parquet": pd.concat(timelines, ignore_index=True)}
    for name, frame in tables.items():  # atomically: an interrupted run never leaves half a table
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        write_bytes_atomic(out / name, buffer.getvalue())
    write_bytes_atomic(out / "serving_summary.csv", summary.to_csv(index=False).encode())
    if timeline is not None:
        timeline.write(args.timeline)
    for line in table_lines(summaries):
        print(line)
    print(f"results: {out}/serving_summary.parquet (+ .csv, serving_requests, serving_timeline)")
    return 0


def time_text(seconds: float) -> str:
    """A duration in the unit that fits it, 3 significant digits: 41.2 µs, 3.05 ms, 1.27 s (a fixed unit
    would print a fast model's TBT as 0.0 ms)."""
    if seconds != seconds:  # NaN: no request got that far
        return "-"
    magnitude = abs(seconds)
    if magnitude == 0:
        return "0 s"
    if magnitude < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if magnitude < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def table_lines(summaries: list[dict]) -> list[str]:
    header = (f"{'run':<18} {'profile':<14} {'policy':<10} {'budget':>6} {'reqs':>5} {'tok/s':>8} "
              f"{'TTFT p50/p99':>21} {'TBT p50/p99':>21} {'queue':>9} {'max conc':>8} {'H2D %':>6} "
              f"{'goodput tok/s':>13}  overheads (host term)")
    lines = [header, "-" * len(header)]
    for s in summaries:
        budget = s["hbm_budget"] if s["hbm_budget"] is not None else float("nan")
        ttft = f"{time_text(s['ttft_p50_s'])}/{time_text(s['ttft_p99_s'])}"
        tbt = f"{time_text(s['tbt_p50_s'])}/{time_text(s['tbt_p99_s'])}"
        lines.append(
            f"{Path(s['run_dir']).name[:18]:<18} {s['profile'][:14]:<14} {str(s['policy'])[:10]:<10} {budget:>6.2f} "
            f"{s['n_requests']:>5} {s['throughput_tokens_per_s']:>8.1f} {ttft:>21} {tbt:>21} "
            f"{time_text(s['queue_delay_mean_s']):>9} {s['max_concurrency']:>8} {100 * s['link_util_h2d']:>6.1f} "
            f"{s['goodput_tokens_per_s']:>13.1f}  {s['overhead_mode']} ({s['host_term']})"
        )
    return lines
