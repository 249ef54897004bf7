"""`thoughtkv demo [--out DIR] [--n-samples N]`: the main job, end to end, on the bundled long-workload model.

0. calibrate this machine (`calibrate --quick`, <= 60 s) into DIR/profiles: the cross-check compares with it,
          never with a profile measured elsewhere (reused on a rerun on the same host),
1. trace  `micro_long` on `chains_long` (prompt + chain of thought ~550 tokens, look-ups up to ~490 tokens
          back) with the full cache, pure eviction and the hierarchy (recall <= 20% of the context per step) at
          HBM budgets of 30% and 50%: 5 runs of 8 samples (n = 8 keeps the demo under 5 minutes on a 2-core
          CPU; `--n-samples` for more), one single-threaded process at a time (a rerun resumes each run),
2. simulate every run on every datasheet profile (GPU overheads: the cited hf-eager estimate; `--overhead-mode
          kernel-only` for none) and on this machine's measured profile, plus what-if replays of the full run
          under each policy (the "attention mass lost" proxy); a run's results are reused while newer than it,
3. report figures, tables and report.md (analysis.report.build_report), and capacity as served: every run at
          qwen2-7b's shapes with R1-7B GSM8K-like request lengths on h100-pcie and gh200-96gb, a small Poisson
          rate sweep (serve-sim's fast path) -> the serving frontier and its section (analysis/serving.py),
          then a real pretrained LM (smollm2-135m) on a few GSM8K problems: eviction and the hierarchy at one
          budget graded by fidelity to its full cache, with their traffic (thoughtkv/real_model.py),
4. print  the best policy per profile (the fastest within 5 points of the best accuracy) with its traffic.

    DIR/profiles/  this machine's profile   DIR/runs/<policy>/  trace runs   DIR/sim/<policy>.parquet  results
    DIR/report/    report.md, figures/, tables/   DIR/serving/  the serving sweep's cached cells
    DIR/real_model/  the real-model section's trace runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError
from thoughtkv_base.options import (
    FLOAT,
    NONNEGATIVE_INT,
    POSITIVE_INT,
    SHARED,
    TEXT,
    Flag,
    add_flags,
    field_flag,
)
from traces.layout import write_atomic
from traces.policy import policy_flag

DEFAULT_OUT = "demo-out"
MARKER = "demo.json"  # marks a directory as a demo's, so a rerun may write into it
WHAT_IF_PROFILE = "h100-sxm"  # mass lost does not depend on the hardware: one profile is enough

# A small projected serving sweep: every run at qwen2-7b's shapes with R1-7B GSM8K-like request lengths,
# on one PCIe and one NVLink-C2C GPU, at four arrival rates doubled up to once; 20 s of arrivals per rate keeps it
# near 40 s here (`thoughtkv experiment capacity-served`, docs/capacity_served.md: 120 s, refined rates, n = 200).
SERVING_PROFILES = ("h100-pcie", "gh200-96gb")
SERVING_RATES = (8.0, 16.0, 32.0, 64.0)
SERVING = dict(duration_s=20.0, max_batch=4096, tbt_slo_s=0.1, ttft_slo_s=10.0, lengths="r1-7b/gsm8k")
SERVING_OPTIONS = dict(overhead_mode="cuda-graphs", transfer="dma-batched")


class DemoError(UserError):
    pass


@dataclass(frozen=True)
class Cell:
    """One trace run of the grid."""

    policy: str
    hbm_budget: float = 1.0
    evict_ratio: float = 0.0

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full"
        budget = f"{round(100 * self.hbm_budget)}" if self.hbm_budget <= 1 else f"{int(self.hbm_budget)}t"
        label = f"{self.policy}-b{budget}"
        return label + (f"-e{round(100 * self.evict_ratio)}" if self.policy == "hierarchy" else "")


def grid(budgets: list[float], evict_ratios: list[float]) -> list[Cell]:
    cells = [Cell("full")]
    for budget in budgets:
        cells += [Cell("evict", budget)] + [Cell("hierarchy", budget, ratio) for ratio in evict_ratios]
    return cells


OWN = (
    Flag("--budgets", "HBM budgets (fractions) for pure eviction and the hierarchy", TEXT, default="0.3,0.5",
         metavar="B,B"),
    Flag("--evict-ratios", "the hierarchy's eviction ratios: 0 offloads everything over budget, 0.1 also drops the "
         "least important 10%%", TEXT, default="0", metavar="E,E"),
    Flag("--calibrate", "calibrate this machine first (quick: <= 60 s) and cross-check against it; smoke: seconds, "
         "for tests; none: no measured profile, no Figure 6", TEXT, default="quick",
         choices=("quick", "smoke", "none")),
    # A float >= 0 (0 skips the section): no kind says that, so run() checks it.
    Flag("--serving-duration-s", "seconds of Poisson arrivals per rate in the serving sweep; 0 skips the serving "
         "section", FLOAT, default=SERVING["duration_s"], default_text=f"{SERVING['duration_s']:g}", metavar="S"),
    Flag("--real-model-samples", "GSM8K problems for the real-model section (smollm2-135m graded by fidelity to its "
         "full cache); 0 skips it", NONNEGATIVE_INT, default=3),
    Flag("--trace-workers", "runs traced at once, one single-threaded process each (default: 1, so that the measured "
         "decode times that Figure 6 compares with the simulator are uncontended)", POSITIVE_INT, default=1),
)
# The decode limit, the cache geometry and the recall come with the model (its trace_defaults.json; micro_long:
# blocks of 4 and a 16-token window, so that the budget, not the protected tokens, decides what stays in HBM).
FROM_MODEL = "the model's trace_defaults.json; micro_long: {}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.options import SimOptions

    add_flags(parser,
              SHARED["out"].use(help="where runs, results and the report go; a rerun reuses what is there",
                                default=Path(DEFAULT_OUT), metavar="DIR"),
              SHARED["n_samples"].use(default=8, help="samples per run (default: 8, to stay under 5 minutes on a "
                                                      "2-core CPU)"),
              SHARED["model"].use(default="micro_long", help="model to trace (default: the bundled `micro_long`; "
                                                             "`micro` with --task chains)"),
              SHARED["task"].use(default="chains_long", help="task (default: chains_long, which micro_long learnt)"),
              SHARED["max_new_tokens"].use(help="decode limit per sample", default_text=FROM_MODEL.format(600)),
              policy_flag("block_size").use(help="tokens per KV block", default_text=FROM_MODEL.format(4)),
              policy_flag("window_tokens").use(help="recent tokens always kept in HBM",
                                               default_text=FROM_MODEL.format(16)),
              policy_flag("recall_budget").use(help="hierarchy: recall per layer and step at most this fraction of "
                                                    "the context (or a token count), in whole blocks",
                                               default_text=FROM_MODEL.format(0.2), metavar="R"),
              field_flag(SimOptions, "overhead_mode").use(
                  choices=("hf-eager", "kernel-only"), default="hf-eager", default_text=None,
                  help="framework overheads of the datasheet GPU projections: hf-eager (a cited estimate of a "
                       "transformers eager loop) or kernel-only (none)"),
              SHARED["device"].use(help="device to trace on", default="cpu", default_text=None),
              SHARED["workers"].use(help="simulation processes at once", default=min(2, os.cpu_count() or 1),
                                    default_text="2 or the CPU count"),
              *OWN)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    budgets = _parse_list(args.budgets, "--budgets", "hbm_budget")
    evict_ratios = _parse_list(args.evict_ratios, "--evict-ratios", "evict_ratio")
    # --n-samples, --real-model-samples, --workers and --trace-workers were checked as they were parsed.
    if not args.serving_duration_s >= 0:  # also refuses nan
        raise DemoError(f"--serving-duration-s {args.serving_duration_s} must be >= 0 (0 skips the serving section)")
    from tracer.preflight import check_model_spec, resolve_device

    args.device = resolve_device(args.device)  # the one --device check, before anything is written
    check_model_spec(args.model)
    resolve_model_defaults(args)
    out = args.out
    _claim_out_dir(out, vars(args))
    cells = grid(budgets, evict_ratios)

    measured = calibrate_here(out / "profiles", args)
    run_dirs = trace_all(cells, out / "runs", args)
    sim_files = simulate_all(cells, run_dirs, out / "sim", args.workers, measured, args.overhead_mode)
    from analysis.report import build_report

    _stage("report")
    report = build_report(list(run_dirs.values()), sim_files, out / "report", log=lambda m: print(f"  {m}"),
                          measured_profile=measured.stem if measured else None)
    mechanisms_figure(cells, run_dirs, out / "report", args.overhead_mode)
    if args.serving_duration_s > 0:
        serving_section(cells, run_dirs, out, args.workers, args.serving_duration_s)
    if args.real_model_samples > 0:
        real_model_section(out, args.real_model_samples)
    print_summary(report, time.perf_counter() - started)
    return 0


def resolve_model_defaults(args: argparse.Namespace) -> None:
    """Fill the settings left unset from the model's trace_defaults.json (tracer.model_defaults, the one home:
    the runs' TraceConfig reads the same), so that calibration times the runs' cache geometry and the summary
    names them."""
    from tracer.model_defaults import resolve
    from traces.policy import PolicyError, PolicySpec

    policy_keys = ("block_size", "sink_tokens", "window_tokens", "recall_k", "recall_budget")
    given = {"block_size": args.block_size, "window_tokens": args.window_tokens,
             "max_new_tokens": args.max_new_tokens, "recall_budget": args.recall_budget}
    given = {k: v for k, v in given.items() if v is not None}
    values, args.from_model = resolve(args.model, given)
    try:
        spec = PolicySpec(policy="hierarchy", **{k: values[k] for k in policy_keys})
    except PolicyError as error:
        raise DemoError(str(error)) from None
    # The policy flags come as text (traces.policy.policy_flag): the runs and the calibration get the values the
    # contract parsed.
    values.update({k: getattr(spec, k) for k in policy_keys})
    args.given_settings = {k: values[k] for k in given}  # what the runs' TraceConfig gets
    if values["max_new_tokens"] < 1:
        raise DemoError(f"--max-new-tokens {values['max_new_tokens']} must be at least 1")
    for key in ("block_size", "sink_tokens", "window_tokens", "max_new_tokens", "recall_k", "recall_budget"):
        setattr(args, key, values[key])


def _parse_list(text: str, option: str, field: str) -> list[float]:
    """"0.25,0.5" -> sorted unique values of a PolicySpec field, each checked by PolicySpec (the one place a
    budget or ratio is validated)."""
    from traces.policy import PolicyError, PolicySpec

    values = [v.strip() for v in str(text).split(",") if v.strip()]
    if not values:
        raise DemoError(f"{option} {text!r}: give values separated by commas, e.g. 0.25,0.5")
    try:
        parsed = [getattr(PolicySpec(policy="hierarchy", **{field: v}), field) for v in values]
    except PolicyError as error:
        raise DemoError(f"{option}: {error}") from None
    return sorted(set(parsed))


def _claim_out_dir(out: Path, settings: dict) -> None:
    """--out must be new, empty or an earlier demo's (marked by demo.json); never write into anything else."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out}: exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise DemoError(f"--out {out}: a non-empty directory that is not a demo's (no {MARKER}); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    marker = {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items() if not k.startswith("_")}
    marker.pop("command", None)
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _stage(name: str) -> None:
    print(f"== {name}", file=sys.stderr, flush=True)


# -- 0. calibrate --------------------------------------------------------------------------------------------


def calibrate_here(profiles_dir: Path, args: argparse.Namespace) -> Path | None:
    """This machine's measured profile, calibrated now (into the demo's output, never into the package): the
    cross-check (Figure 6) then compares the simulator with timings from the same machine and day. A rerun
    reuses it when it was calibrated on this host (traces.host) for the same model shapes and cache geometry (the
    runs' block size and window: their per-layer cost depends on them), else calibrates again."""
    if args.calibrate == "none":
        return None
    import yaml

    from tracer.calibrate import architecture_for_model, cache_geometry
    from traces.host import host_facts, same_host

    device_type = args.device.split(":")[0]
    architecture = architecture_for_model(args.model, device_type)  # weight reads with the traced model's shapes
    geometry = cache_geometry(block_size=args.block_size, sink_tokens=args.sink_tokens,
                              window_tokens=args.window_tokens)  # the runs' blocks
    path = profiles_dir / f"measured-here-{device_type}.yaml"
    if path.is_file():
        provenance = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("provenance", {})
        if same_host(provenance.get("host_facts"), host_facts()) and \
                provenance.get("architecture_for_attention") == architecture and \
                provenance.get("cache_geometry") == geometry:
            _stage(f"calibrate: {path} (this host, reused)")
            return path
    _stage(f"calibrate: this machine, {args.calibrate} plan -> {path}")
    from tracer.calibrate import calibrate_here as calibrate
    from tracer.preflight import resolve_threads

    profiles_dir.mkdir(parents=True, exist_ok=True)
    return calibrate(device_type, path, resolve_threads(args.device, None), level=args.calibrate,
                     architecture=architecture, geometry=geometry)


# -- 1. trace -------------------------------------------------------------------------------------------------


def committed_samples(run_dir: Path) -> int:
    """Samples on disk (a samples part is a sample's commit record): a directory listing, cheap to poll."""
    if not (run_dir / "run.json").is_file():
        return 0
    from traces.layout import list_parts

    return len(list_parts(run_dir, "samples"))


def trace_all(cells: list[Cell], runs_dir: Path, args: argparse.Namespace) -> dict[str, Path]:
    """Trace every cell; finished runs are skipped without loading the model, unfinished ones resume.

    Runs go to `--trace-workers` processes at once (default 1): two single-threaded processes on two cores
    finish the grid sooner, but each records slower decode times (they share memory bandwidth and caches), and
    those timings are what the simulator is checked against: the demo's cross-check figure's error grows with
    two.
    """
    from tracer.run import TraceConfig

    run_dirs = {cell.label: (runs_dir / cell.label).resolve() for cell in cells}  # results name runs absolutely
    todo = [c for c in cells if committed_samples(run_dirs[c.label]) < args.n_samples]
    _stage(f"trace: {len(cells) - len(todo)} of {len(cells)} runs already complete")
    configs = []
    for cell in todo:
        config = TraceConfig(
            model=args.model, task=args.task, out=str(run_dirs[cell.label]), n_samples=args.n_samples,
            policy=cell.policy, hbm_budget=cell.hbm_budget, evict_ratio=cell.evict_ratio,
            device=args.device, **args.given_settings,  # the rest from the model (recorded per run)
        )
        config.validate()  # before any model loads: a bad option fails in a second, not a minute
        configs.append(config)
    if not configs:
        return run_dirs
    if args.trace_workers == 1 or len(configs) == 1:
        for index, config in enumerate(configs, start=1):
            print(f"[{index}/{len(configs)}] trace {config.out}", file=sys.stderr, flush=True)
            trace_one(dataclasses.asdict(config), threads=_threads(args.device), progress=True)
    else:
        _trace_in_processes(configs, [run_dirs[c.label] for c in todo], args.trace_workers, args.n_samples)
    return run_dirs


def _threads(device: str) -> int | None:
    """One torch thread on CPU: a small model's ops are too short to split, and idle threads spinning on a
    shared 2-core machine made decoding ~10x slower in our runs (280 vs 18 ms/token for micro)."""
    from tracer.preflight import resolve_threads  # the one default, shared with trace/calibrate/crosscheck

    return resolve_threads(device, None)


_LOADED: dict = {}  # per process: (model, device) -> loaded model, reused across the runs it traces


def trace_one(config: dict, threads: int | None, progress: bool) -> str:
    """Trace one run (in a worker process or this one), loading the model once per process."""
    import torch

    from tracer.models import load_model
    from tracer.run import TraceConfig, run_trace

    if threads is not None:
        torch.set_num_threads(threads)
    key = (config["model"], config["device"], config["seed"])
    if key not in _LOADED:
        _LOADED[key] = load_model(config["model"], config["device"], config["dtype"], seed=config["seed"])
    run_trace(TraceConfig(**config), progress=progress, loaded=_LOADED[key])
    return config["out"]


def _trace_in_processes(configs: list, run_dirs: list[Path], workers: int, n_samples: int) -> None:
    """A process pool over runs; progress counts committed samples on disk (each is its own file)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from tqdm.auto import tqdm

    from thoughtkv_base.pool import process_pool

    def committed() -> int:
        return sum(min(committed_samples(d), n_samples) for d in run_dirs)

    total = n_samples * len(configs)
    # spawned workers (torch's thread pools do not survive a fork) that end with this process on Ctrl-C / SIGTERM
    with process_pool(workers) as pool, \
            tqdm(total=total, initial=committed(), desc=f"trace ({workers} processes)", unit="sample") as bar:
        pending = {pool.submit(trace_one, dataclasses.asdict(c), 1, False) for c in configs}
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()  # a worker's error (one-line UserError) surfaces here, the pool shuts down
            bar.update(committed() - bar.n)
            bar.set_postfix(runs_left=len(pending))


# -- 2. simulate ----------------------------------------------------------------------------------------------


def newest_mtime(run_dir: Path) -> float:
    """When the run last changed: its manifest or any committed sample (samples parts are written last)."""
    paths = [run_dir / "run.json", *sorted((run_dir / "samples.parquet").glob("*.parquet"))]
    return max(p.stat().st_mtime for p in paths if p.exists())


def simulate_all(cells: list[Cell], run_dirs: dict[str, Path], sim_dir: Path, workers: int = 1,
                 measured: Path | None = None, overhead_mode: str = "hf-eager") -> list[Path]:
    """One results file per run (all profiles; the full run also carries the what-if replays).

    Profiles: every shipped datasheet profile, charging `overhead_mode` (hf-eager: the cited estimate of a
    transformers eager loop's launches; kernel-only: none), plus this machine's in-run calibration (`measured`,
    its measured overheads). The shipped example of a measured profile is not used. Each (run, profile) replay
    is one sweep cell, run by the sweep's local executor on `workers` processes; a run's file is written once all
    of its cells are back, so an interrupted simulation leaves either a complete file or none.
    """
    import io

    import pandas as pd
    from tqdm.auto import tqdm

    from hwprofiles import list_profiles
    from simulator.sweep.executors import execute_local

    profiles = [(p.name, overhead_mode) for p in list_profiles() if p.provenance.get("kind") != "measured"]
    if measured is not None:
        profiles.append((str(measured), None))
    sim_dir.mkdir(parents=True, exist_ok=True)
    files = {cell.label: sim_dir / f"{cell.label}.parquet" for cell in cells}
    newest_input = max([measured.stat().st_mtime] if measured is not None else [0.0])
    stale = [c for c in cells if not files[c.label].is_file()
             or files[c.label].stat().st_mtime <= max(newest_mtime(run_dirs[c.label]), newest_input)]
    _stage(f"simulate: {len(cells) - len(stale)} of {len(cells)} runs' results up to date, {len(profiles)} profiles "
           f"(datasheet GPUs {overhead_mode}{', this machine measured' if measured is not None else ''})")
    names = [name for name, _ in profiles]
    what_if_profile = (WHAT_IF_PROFILE, overhead_mode) if WHAT_IF_PROFILE in names else profiles[0]
    label_of = {}  # sweep cell (one simulate_run, one row per sample) -> the run whose results file it joins
    for cell in stale:
        run_dir = str(run_dirs[cell.label])
        for profile, mode in profiles:
            label_of[replay_cell(run_dir, profile, mode)] = cell.label
        if cell.policy == "full":
            for other in (t for t in cells if t.policy != "full"):
                label_of[replay_cell(run_dir, *what_if_profile, what_if_of(run_dirs[other.label]))] = cell.label
    results: dict[str, list] = {cell.label: [] for cell in stale}
    remaining = {cell.label: sum(1 for label in label_of.values() if label == cell.label) for cell in stale}
    # The sweep's executor (simulator/sweep/executors.py): a spawn pool of `workers`, stopped with this process.
    finished = execute_local(list(label_of), workers)
    with closing(finished), tqdm(total=len(label_of), desc="simulate", unit="sim") as bar:  # closing: stops the pool
        for sweep_cell, table in finished:
            if isinstance(table, BaseException):
                raise table
            label = label_of[sweep_cell]
            results[label].append(pd.read_parquet(io.BytesIO(table)).drop(columns="cell_key"))
            remaining[label] -= 1
            if remaining[label] == 0:
                frame = pd.concat(results.pop(label), ignore_index=True)
                write_atomic(files[label], lambda temp, frame=frame: frame.to_parquet(temp, index=False))
            bar.update()
    return list(files.values())


def replay_cell(run_dir: str, profile: str, overhead_mode: str | None, what_if: dict | None = None):
    """One replay of a run on a profile as a sweep cell whose table is simulate's per-sample rows."""
    from simulator import SimOptions
    from simulator.sweep.cells import SimulateCell

    return SimulateCell(run_dir, profile, SimOptions(overhead_mode=overhead_mode),
                        what_if=tuple(sorted((what_if or {}).items())), per_sample=True)


def what_if_of(run_dir: Path) -> dict:
    """The --what-if that replays the full run's masses under `run_dir`'s traced policy, knob for knob, so that
    the projection and the measured accuracy describe the same policy (analysis joins them on these keys)."""
    from traces import open_run

    policy = open_run(run_dir).manifest["policy"]
    what_if = {"policy": policy["name"], "budget": policy["hbm_budget"], "evict": policy["evict_ratio"],
               "block": policy["block_size"], "recall_k": policy["recall_k"], "scorer": policy["scorer"],
               "sink": policy["sink_tokens"], "window": policy["window_tokens"]}
    recall_budget = (policy.get("params") or {}).get("recall_budget")
    if recall_budget is not None:
        what_if["recall_budget"] = recall_budget
    return what_if


def open_run_model(run_dir: Path) -> str:
    from traces import open_run

    return str(open_run(run_dir).manifest["model"]["id"])


def mechanisms_figure(cells: list[Cell], run_dirs: dict[str, Path], report_dir: Path, overhead_mode: str) -> None:
    """Issue 17's figure in the demo's report: the smallest-budget hierarchy run projected to qwen2-7b shapes at
    8k and 32k context, ms/token and sequences in HBM per transfer mechanism x profile (analysis/mechanisms.py)."""
    hierarchy = sorted((c for c in cells if c.policy == "hierarchy" and c.evict_ratio == 0), key=lambda c: c.hbm_budget)
    if not hierarchy:
        return
    from analysis.mechanisms import write_mechanism_figure

    cell = hierarchy[0]
    written = write_mechanism_figure(run_dirs[cell.label], report_dir / "figures", overhead_mode=overhead_mode)
    model = open_run_model(run_dirs[cell.label])
    caption = (f"Transfer mechanisms x hardware: the {cell.label} run of `{model}` projected to qwen2-7b shapes (bf16) at 8k and "
               f"32k context, every step keeping its tier shares; top ms/token of one sequence, bottom sequences "
               f"whose decode-peak footprint fits in HBM (black: full cache); framework overheads {overhead_mode}. "
               f"Numbers: figures/mechanisms.csv; who wins where and why: docs/mechanisms/README.md.")
    with open(report_dir / "report.md", "a", encoding="utf-8") as handle:
        handle.write(f"\n## Transfer mechanisms\n\n![Transfer mechanisms](figures/mechanisms.png)\n\n{caption}\n")
    from analysis.report import add_owned_files

    add_owned_files(report_dir, written)  # a later `plot --out` here removes it unless it draws it again
    print(f"  wrote {', '.join(str(p) for p in written if p.suffix == '.png')}", file=sys.stderr)


# -- 3b. capacity as served (its settings, SERVING, are at the top) --------------------------------------------------


def serving_section(cells: list[Cell], run_dirs: dict[str, Path], out: Path, workers: int,
                    duration_s: float = SERVING["duration_s"]) -> list[Path]:
    """The serving sweep of every run (cells cached under DIR/serving) and its section in the report: the
    frontier (accuracy vs max sustainable rate, labelled with traffic), goodput and TBT vs rate, the knee."""
    from analysis.serving import write_serving_section
    from simulator.options import Projection, ServingConfig, SimOptions
    from thoughtkv.capacity import capacity_sweep

    _stage(f"serving: {len(cells)} runs x {', '.join(SERVING_PROFILES)} at qwen2-7b shapes, R1-7B GSM8K-like lengths")
    config = ServingConfig(**{**SERVING, "duration_s": duration_s}, projection=Projection("qwen2-7b"),
                           options=SimOptions(**SERVING_OPTIONS))
    table, capacity = capacity_sweep([run_dirs[c.label] for c in cells], list(SERVING_PROFILES), config,
                                     list(SERVING_RATES), 0, out / "serving", workers=workers,
                                     log=lambda m: print(f"  {m}", file=sys.stderr), max_extensions=1)
    written = write_serving_section(table, capacity, out / "report", config.tbt_slo_s, config.ttft_slo_s,
                                    append_to=out / "report" / "report.md")
    print(f"  wrote {out / 'report' / 'figures' / 'serving_frontier.png'}", file=sys.stderr)
    return written


# -- 3c. a real pretrained LM ---------------------------------------------------------------------------------

REAL_MODEL_TOKENS = 64  # new tokens per problem: the section's decodes take about a minute here


def real_model_section(out: Path, n_samples: int) -> None:
    """smollm2-135m on a few shipped GSM8K problems: eviction and the hierarchy graded by fidelity to the full
    cache, with traffic (thoughtkv.experiments.real_model.demo_section); skipped in one line when the model is not installed."""
    from thoughtkv.experiments.real_model import MODEL, demo_section
    from tracer.packaged import PACKAGED_MODELS, PackagedModelError, model_file

    try:
        model_file(PACKAGED_MODELS[MODEL])
    except PackagedModelError as error:
        print(f"  real-model section skipped: {error}", file=sys.stderr)
        return
    _stage(f"real model: {MODEL}, {n_samples} GSM8K problems, full vs evict vs hierarchy at one budget")
    print(demo_section(out / "real_model", out / "report", n_samples, REAL_MODEL_TOKENS), file=sys.stderr)


# -- 4. summary -----------------------------------------------------------------------------------------------


def separation_note(best) -> str:
    """One line: on how many profiles the choice is one the samples can make (no other policy's 95% CI overlaps
    it), and what would, when some cannot."""
    unseparated = int(best["not_separated_from"].map(bool).sum())
    n = int(best["n"].min())
    if not unseparated:
        return f"separated: on every profile the choice's 95% CI is clear of every other policy's at n = {n}"
    return (f"not separated: on {unseparated} of {len(best)} profiles another policy's 95% CI overlaps the choice's "
            f"at n = {n}, so these samples cannot tell them apart ('no' above); rerun with a larger --n-samples "
            "(the 95% CI half-width shrinks as 1/sqrt(n)) before reading a winner off this table")


def print_summary(report, elapsed_s: float) -> None:
    """The best policy per profile, each with the traffic that bought its accuracy and the overheads charged."""
    from rich.console import Console
    from rich.table import Table

    from analysis.report import best_per_profile, priced_text
    from traces.stats import REFERENCE_ARCHITECTURE, bytes_text

    def percent(value) -> str:
        return "-" if value != value else f"{value:.0%}"

    console = Console()
    if not console.is_terminal:  # a log file or pipe: do not squeeze the table into 80 columns
        console = Console(width=200)
    best = best_per_profile(report.latency)
    if best.empty:
        console.print("No accuracy to rank policies by (unscored samples); see the report for latency.")
    else:
        table = Table(title="Best policy per profile: the fastest within 5 points of the best accuracy (95% CI), "
                            f"with its traffic (decode steps); ms/token {priced_text(report.latency, report.run_table)}",
                      title_justify="left")
        columns = ("profile", "overheads", "policy", "budget", "accuracy [CI]", "n", "ms/token", "attended",
                   "recalled/step", f"H2D/token ({REFERENCE_ARCHITECTURE})", "separated at this n?")
        for column in columns:
            table.add_column(column, justify="left" if column in ("profile", "overheads", "policy") else "right",
                             no_wrap=True)
        for row in best.to_dict("records"):
            h2d_ref = row.get("h2d_bytes_per_token_ref", float("nan"))
            unseparated = row.get("not_separated_from") or []
            table.add_row(row["profile"], str(row.get("overhead_mode", "?")), row["method"], f"{row['hbm_budget']:.0%}",
                          f"{row['accuracy']:.0%} [{row['ci_low']:.0%}, {row['ci_high']:.0%}]", str(int(row["n"])),
                          f"{row['ms_per_token']:.3g}", percent(row.get("attended_frac", float("nan"))),
                          percent(row.get("recalled_frac", float("nan"))),
                          "-" if h2d_ref != h2d_ref else bytes_text(h2d_ref),
                          f"no: CI overlaps {unseparated[0]}" if unseparated else "yes")
        console.print(table)
        console.print("overheads: measured = this machine's in-run calibration; hf-eager = datasheet GPU + a cited "
                      "estimate of a transformers eager loop's kernel launches; kernel-only = kernels and copies only")
        console.print(separation_note(best), markup=False)
    drawn = sum(1 for f in report.figures if f.paths)
    console.print(f"report: {report.path} ({drawn} of {len(report.figures)} figures) in {elapsed_s:.0f} s")
