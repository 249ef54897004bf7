"""`thoughtkv serve-sim RUN_DIR [RUN_DIR ...] --profile NAME [...] --rate R --duration S --max-batch N`.

Serving simulation (simulator/serving.py): requests arrive (Poisson at R/s for S seconds, or the rows of
--arrivals CSV), each replays a sample of the run, and share one GPU with continuous batching, HBM admission
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
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", metavar="RUN_DIR", type=Path, nargs="+", help="trace run(s) to serve")
    add_serving_arguments(parser)
    parser.add_argument("--profile", action="append", default=[], metavar="NAME",
                        help="hardware profile name or YAML path (repeatable)")
    parser.add_argument("--overlap", default="none", choices=("none", "layer-prefetch"),
                        help="none: recall then compute; layer-prefetch: recall for layer l+1 during layer l")
    parser.add_argument("--sync-offload", action="store_true", help="wait for offloads (default: async)")
    parser.add_argument("--offload-tier", default="ddr", metavar="TIER",
                        help="where offloaded KV lives: ddr or a profile's extra tier")
    parser.add_argument("--timeline", type=Path, metavar="FILE",
                        help="Chrome-trace JSON (Perfetto) of the first run on the first profile")
    parser.add_argument("--out", type=Path, default=None, help="results directory (see above)")


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving options alone, for `thoughtkv simulate --serving` to reuse."""
    parser.add_argument("--rate", type=float, default=1.0, metavar="R", help="Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=60.0, metavar="S", help="arrival window in seconds")
    parser.add_argument("--max-batch", type=int, default=64, metavar="N", help="most requests per decode iteration")
    parser.add_argument("--arrivals", type=Path, default=None, metavar="CSV",
                        help="arrival trace instead of Poisson (columns: see `serve-sim --help`)")
    parser.add_argument("--tbt-slo-ms", type=float, default=100.0, help="goodput: mean time between tokens SLO")
    parser.add_argument("--ttft-slo-s", type=float, default=None, help="goodput: time to first token SLO")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and sample choice")
    parser.add_argument("--batch-copies", action="store_true",
                        help="one copy per layer for the whole batch (gather kernel) instead of one per request")


def serving_config(args: argparse.Namespace):
    from simulator.serving import ServingConfig, ServingError

    if args.rate <= 0 or args.duration <= 0 or args.max_batch < 1:
        raise ServingError("--rate and --duration must be > 0 and --max-batch >= 1")
    if args.arrivals is not None and not args.arrivals.is_file():
        raise ServingError(f"--arrivals {args.arrivals}: not found; pass an existing CSV")
    return ServingConfig(
        rate_per_s=args.rate, duration_s=args.duration, max_batch=args.max_batch, tbt_slo_s=args.tbt_slo_ms / 1e3,
        ttft_slo_s=args.ttft_slo_s, overlap=getattr(args, "overlap", "none"),
        async_offload=not getattr(args, "sync_offload", False), seed=args.seed,
        arrivals_csv=str(args.arrivals) if args.arrivals else None,
        offload_tier=getattr(args, "offload_tier", "ddr"), batch_copies=args.batch_copies,
    )


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    from tqdm import tqdm

    from hwprofiles import load_profile
    from simulator.engine import Timeline
    from simulator.serving import ServingError, simulate_serving
    from traces import open_run

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
    summary.to_parquet(out / "serving_summary.parquet", index=False)
    summary.to_csv(out / "serving_summary.csv", index=False)
    pd.concat(requests, ignore_index=True).to_parquet(out / "serving_requests.parquet", index=False)
    pd.concat(timelines, ignore_index=True).to_parquet(out / "serving_timeline.parquet", index=False)
    if timeline is not None:
        timeline.write(args.timeline)
    for line in table_lines(summaries):
        print(line)
    print(f"results: {out}/serving_summary.parquet (+ .csv, serving_requests, serving_timeline)")
    return 0


def table_lines(summaries: list[dict]) -> list[str]:
    header = (f"{'run':<18} {'profile':<14} {'policy':<10} {'budget':>6} {'reqs':>5} {'tok/s':>8} "
              f"{'TTFT p50/p99 s':>15} {'TBT p50/p99 ms':>15} {'queue s':>8} {'max conc':>8} {'H2D %':>6} "
              f"{'goodput tok/s':>13}")
    lines = [header, "-" * len(header)]
    for s in summaries:
        budget = s["hbm_budget"] if s["hbm_budget"] is not None else float("nan")
        lines.append(
            f"{Path(s['run_dir']).name[:18]:<18} {s['profile'][:14]:<14} {str(s['policy'])[:10]:<10} {budget:>6.2f} "
            f"{s['n_requests']:>5} {s['throughput_tokens_per_s']:>8.1f} "
            f"{s['ttft_p50_s']:>7.2f}/{s['ttft_p99_s']:<7.2f} {s['tbt_p50_s'] * 1e3:>7.1f}/{s['tbt_p99_s'] * 1e3:<7.1f} "
            f"{s['queue_delay_mean_s']:>8.2f} {s['max_concurrency']:>8} {100 * s['link_util_h2d']:>6.1f} "
            f"{s['goodput_tokens_per_s']:>13.1f}"
        )
    return lines
