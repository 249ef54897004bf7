"""`thoughtkv serve-sim RUN_DIR [RUN_DIR ...] --profile NAME [...] --rate-per-s R --duration-s S --max-batch N`.

Serving simulation (simulator/serving.py): requests arrive (Poisson at R/s for S seconds, or the rows of
--arrivals-csv CSV), each replays a sample of the run, and share one GPU with continuous batching, HBM admission
and one host link. Give several runs (e.g. a full-cache trace and a 30%-budget trace of the same task) and
several profiles to compare them: one table row per (run, profile).

Arrival CSV: one row per request with columns `arrival_s,prompt_tokens,output_tokens` (seconds from the
start), or the Azure LLM inference trace's `TIMESTAMP,ContextTokens,GeneratedTokens` (timestamps; shifted to
start at 0). Each request replays the run's sample nearest in (prompt, output) length, resampled to the row's own
prompt and output tokens (simulator/lengths.py: the same resampling as `--lengths`), so a 40k-token prompt costs
a 40k-token prefill and its KV whatever the traced lengths were.

Before a large one starts it prints its estimate (requests, tokens, time, memory: `estimate_serving`) and refuses
one that would not fit in this machine's memory unless --allow-large; a window in which no request arrived is
refused. After it, a row whose server fell behind gets one `warning: overloaded` line (`overload_line`).

Writes OUT/serving_summary.{parquet,csv} (one row per run x profile), OUT/serving_requests.parquet and
OUT/serving_timeline.parquet (per iteration: running, waiting, HBM/DDR occupancy), once every case is served:
a Ctrl-C or SIGTERM before then writes nothing (STOPPED_NOTE). OUT defaults to RUN_DIR/serving for one run,
else ./serving.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from simulator import options as sim_options
from simulator.cli import PROFILES
from thoughtkv_base.options import PATH, SHARED, Flag, add_flags

# What a stop (Ctrl-C, SIGTERM) leaves: the tables are written once every case is served (thoughtkv/cli.py prints it)
STOPPED_NOTE = "nothing was written (serve-sim writes its tables once every run x profile is served); rerun it"

# What a serving simulation costs, measured on the 2-core development machine (the fast path; the DES is slower):
# ~30 us per batch iteration plus ~10 us per operation in it (a layer or the LM head); memory: ~3 kB per request
# (its record and row), ~400 B per iteration (its occupancy row) and ~48 B per token (its times).
SECONDS_PER_ITERATION, SECONDS_PER_ITERATION_OP = 30e-6, 10e-6
BYTES_PER_REQUEST, BYTES_PER_ITERATION, BYTES_PER_TOKEN = 3_000, 400, 48
ESTIMATE_SHOWN_S, ESTIMATE_SHOWN_BYTES = 10.0, 2**30  # a smaller serving simulation starts without its estimate


OWN = (Flag("run_dirs", "trace run(s) to serve", PATH, nargs="+", metavar="RUN_DIR"),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.options import ServingConfig

    add_flags(parser, *OWN, PROFILES)  # --profile: simulate's (repeatable)
    # --rate-per-s, --duration-s, --max-batch, --tbt-slo-s, ... : one flag per ServingConfig field
    sim_options.add_arguments(parser, ServingConfig)
    # --overlap, --async-offload, --engine, --offload-tier, --transfer (a serving batch is --max-batch requests)
    sim_options.add_arguments(parser, exclude=("batch",))
    # --as-model, --as-dtype, --context-scale, --recalls: the same fields (and checks) as simulate's
    sim_options.add_arguments(parser, sim_options.Projection)
    add_flags(parser, SHARED["timeline"].use(help="Chrome-trace JSON (Perfetto) of the first run on the first profile",
                                             metavar="FILE"),
              SHARED["out"].use(help="results directory (default: RUN_DIR/serving for one run, else ./serving)"),
              SHARED["allow_large"].use(help="run even when the estimate says it will not fit in this machine's "
                                             "memory (default: refuse)"))


def serving_config(args: argparse.Namespace):
    """The ServingConfig the flags describe (validated by it: one line naming the wrong option)."""
    from simulator.options import ServingConfig

    config = sim_options.from_args(args, ServingConfig, options=sim_options.from_args(args),
                                   projection=sim_options.from_args(args, sim_options.Projection))
    if config.arrivals_csv is not None:
        from simulator.lengths import read_arrivals_csv

        read_arrivals_csv(config.arrivals_csv)  # a missing, directory or malformed CSV fails before any work
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

    from simulator.tiers import tier_chain

    for profile in profiles:  # an unknown --offload-tier fails before the estimate, in one line
        tier_chain(profile, config.options.offload_tier)
    estimate = estimate_serving(args.run_dirs, profiles, config)
    if estimate.seconds_low >= ESTIMATE_SHOWN_S or estimate.memory_bytes >= ESTIMATE_SHOWN_BYTES:
        print(f"note: estimate: {estimate.text()}", file=sys.stderr, flush=True)
    if not args.allow_large:
        from simulator.synth import exceeded_limit

        exceeded = exceeded_limit(estimate.memory_bytes, 0, out)
        if exceeded:
            raise ServingError(f"this serving simulation needs {exceeded} ({estimate.text()}); shorten --duration-s, "
                               "lower --rate-per-s, or --allow-large to try anyway")

    timeline = Timeline() if args.timeline is not None else None
    summaries, requests, timelines = [], [], []
    cases = [(r, p) for r in args.run_dirs for p in profiles]
    for run_dir, profile in tqdm(cases, desc="serve-sim", unit="case", disable=len(cases) < 2):
        record = timeline if (run_dir, profile) == cases[0] else None
        if record is not None:
            record.begin_process(f"{profile.name} serving {run_dir.name}")
        result = simulate_serving(run_dir, profile, config, timeline=record, progress=True)
        if result.summary["n_requests"] == 0:  # nothing to measure: a row of NaN would say nothing
            raise ServingError(f"no request arrived in the {config.duration_s:g} s window at {config.rate_per_s:g} "
                               f"req/s ({config.rate_per_s * config.duration_s:.3g} expected, seed {config.seed}); "
                               "raise --rate-per-s or "
                               "--duration-s; nothing was written")
        overload = overload_line(result.summary, result.requests)
        if overload is not None:
            tqdm.write(overload, file=sys.stderr)
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


@dataclass
class ServingEstimate:
    """Requests, tokens, time and memory of a serve-sim call, before it runs (the constants above)."""

    requests: float = 0.0
    tokens: float = 0.0
    seconds_low: float = 0.0  # at the batch estimate_serving expects
    seconds_high: float = 0.0  # one request per iteration
    memory_bytes: float = 0.0  # the largest case (cases run one after another)

    def text(self) -> str:
        from simulator.synth import duration_text, size_text

        high = "" if self.seconds_high <= 1.5 * self.seconds_low else f" (up to ~{duration_text(self.seconds_high)} " \
            "if the batch stays small)"
        return (f"~{self.requests:,.0f} requests, ~{self.tokens:,.0f} tokens: ~{duration_text(self.seconds_low)}"
                f"{high}, ~{size_text(self.memory_bytes)} peak memory")


def estimate_serving(run_dirs, profiles, config) -> ServingEstimate:
    """The estimate of serving every run on every profile under `config`, from each run's lengths (or the length
    model's, or the arrival CSV's) and the constants above. Iterations: tokens / the batch Little's law gives
    (rate x a request's tokens x its step time, bounded by 1 and --max-batch), the step time taken as the
    weights' read at HBM bandwidth (a lower bound, so the batch is if anything underestimated)."""
    import numpy as np

    from simulator import costs
    from simulator.lengths import csv_classes, csv_work_bytes, length_model, read_arrivals_csv
    from traces import open_run

    requests_csv = read_arrivals_csv(config.arrivals_csv) if config.arrivals_csv else None
    total = ServingEstimate()
    for run_dir in run_dirs:
        run = open_run(run_dir)
        samples = run.samples()
        shape = config.projection.shape if config.projection.active else \
            costs.ModelShape.from_manifest(run.manifest["model"])
        work_bytes = 0
        if requests_csv is not None:
            classes, _ = csv_classes(requests_csv, samples[["prompt_tokens", "generated_tokens"]].to_numpy())
            n_requests, tokens = len(requests_csv), float(requests_csv.output_tokens.sum())
            span_s = float(requests_csv.arrival_s[-1]) or 1.0
            work_bytes = csv_work_bytes(classes, shape.n_layers)
        else:
            outputs = [o for _, o in length_model(config.lengths).classes()] if config.lengths else \
                samples["generated_tokens"].tolist() or [1]
            n_requests = config.rate_per_s * config.duration_s
            tokens, span_s = n_requests * float(np.mean(outputs)), config.duration_s
        per_request = tokens / max(n_requests, 1)
        for profile in profiles:
            step_s = float(costs.roofline(0.0, shape.weight_bytes, profile, 0.0).total_s)  # the weights' read
            batch = min(max(1.0, n_requests / span_s * per_request * step_s), config.max_batch, max(n_requests, 1))
            iteration_s = SECONDS_PER_ITERATION + SECONDS_PER_ITERATION_OP * (shape.n_layers + 1)
            total.requests += n_requests
            total.tokens += tokens
            total.seconds_low += tokens / batch * iteration_s
            total.seconds_high += tokens * iteration_s
            case_bytes = (BYTES_PER_REQUEST * n_requests + BYTES_PER_TOKEN * tokens + BYTES_PER_ITERATION * tokens
                          / batch + 2 * work_bytes)  # the primary tier's works and a spill tier's
            total.memory_bytes = max(total.memory_bytes, case_bytes)  # cases run one after another
    return total


def overload_line(summary: dict, requests) -> str | None:
    """One `warning:` line when the server fell behind the arrivals: p99 TTFT past the TTFT SLO, or completions
    at under half the offered rate while TTFT grows through the window (the last third's p99 more than twice the
    first third's): every number of such a row then depends on the window's length. None otherwise."""
    import numpy as np

    served = requests[~requests["rejected"]] if len(requests) else requests
    if not len(served) or summary["end_s"] <= 0:
        return None
    window_s = float(served["arrival_s"].max()) or summary["duration_s"]
    offered = summary["rate_per_s"] if summary["rate_per_s"] == summary["rate_per_s"] else len(requests) / window_s
    completed = summary["n_completed"] / summary["end_s"]
    ttft_p99, slo = summary["ttft_p99_s"], summary["ttft_slo_s"]
    over_slo = slo is not None and ttft_p99 > slo
    by_arrival = served.sort_values("arrival_s")["ttft_s"].to_numpy()
    third = len(by_arrival) // 3
    growing = third >= 3 and np.percentile(by_arrival[-third:], 99) > 2 * np.percentile(by_arrival[:third], 99)
    if not (over_slo or (completed < 0.5 * offered and growing)):
        return None
    bound = f" > the {slo:g} s TTFT SLO" if over_slo else ", growing through the window"
    return (f"warning: overloaded: {Path(summary['run_dir']).name} on {summary['profile']} served {completed:.3g} of "
            f"{offered:.3g} req/s offered (its last token at {time_text(summary['end_s'])} after "
            f"{time_text(window_s)} of arrivals), p99 TTFT {time_text(ttft_p99)}{bound}: the queue grows with the "
            "window; lower --rate-per-s, or find the highest sustainable rate with `thoughtkv capacity`")


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
