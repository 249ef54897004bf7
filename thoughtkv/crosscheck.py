"""`thoughtkv crosscheck`: a measured decode with the tiered cache vs the simulator on the calibrated profile.

    thoughtkv calibrate --device cpu                      # -> hwprofiles/measured/measured-cpu.yaml
    thoughtkv crosscheck --model tiny --device cpu --out runs/crosscheck

For each configuration (policy x HBM budget; `full` once) the tracer decodes the same sample `--repeats` times
with step timing (tracer.calibrate.measured); the simulator replays the first repeat's trace on the calibrated
profile, with the framework overheads calibrated for that policy's decode path, and on the datasheet profile
of the same GPU when one exists (as is, and with the calibrated overheads added). The measured time of a step
is the median (or, for a profile calibrated with `--statistic min`, the minimum) over the repeats: the decodes
are identical (same tokens, same block movements), so repeats differ only by noise. The repeats run round-robin
(every configuration once, then again): a slow spell of a shared machine then lands on one repeat of several
configurations, which the median drops, instead of on every repeat of one configuration, which it cannot.

Per step: rel_error = |simulated - measured| / measured; the statistics (median, p95, mean signed error, the
layers-vs-rest split that names the term the simulator gets wrong), the summary table and the scatter figure
live in `analysis/crosscheck.py`.

Writes to --out: runs/ (the traces), measured/ (per-step timings of every repeat), steps.parquet + .csv (one row
per profile x configuration x step), summary.csv + summary.json, scatter.png; prints the table. Rerunning with
the same --out resumes (finished measurements are kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from analysis.crosscheck import CrosscheckError, dominant_term, scatter_figure, step_errors, summarise
from hwprofiles.overhead_modes import apply_mode
from simulator import options as sim_options
from simulator.costs import profile_for_policy
from thoughtkv_base.options import POSITIVE_INT, SHARED, TEXT, Flag, add_flags
from tracer.preflight import check_model_spec, resolve_device, resolve_threads
from traces.policy import PolicySpec, parse_budget, policy_flag

POLICIES = ("full", "evict", "hierarchy")
GOAL_MEDIAN, GOAL_P95 = 0.10, 0.25
# Datasheet profile for a GPU name (first match wins); None on a CPU.
DATASHEET_BY_GPU = (
    ("gh200", "gh200-96gb"), ("h200", "h200-sxm"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
    ("a100", "a100-80gb-pcie"), ("b200", "b200"), ("mi300x", "mi300x"), ("l40s", "l40s"), ("4090", "rtx-4090"),
    ("5080", "rtx-5080"),
)


@dataclass(frozen=True)
class RunSpec:
    """One measured configuration."""

    policy: str
    hbm_budget: str  # as given (a fraction or a token count); "1.0" for full

    @property
    def label(self) -> str:
        return self.policy if self.policy == "full" else f"{self.policy}-b{self.hbm_budget}"


def run_specs(policies: list[str], budgets: list[str]) -> list[RunSpec]:
    specs = []
    for policy in policies:
        for budget in (["1.0"] if policy == "full" else budgets):
            spec = RunSpec(policy, budget)
            if spec not in specs:
                specs.append(spec)
    return specs


# ---------------------------------------------------------------- simulation --------------------------------


def simulate_steps(run_dir: Path, profile, options):
    """simulate_run's per-step table + the split of each step into layers and the rest (LM head + overhead)."""
    from simulator import simulate_run
    from simulator.costs import ModelShape, head_times
    from traces import open_run

    run = open_run(run_dir)
    result = simulate_run(run, profile, options)
    steps = result.steps[["sample_id", "step", "latency_s", "compute_s", "hbm_s", "overhead_s", "link_stall_s"]]
    steps = steps.rename(columns={"latency_s": "simulated_s", "compute_s": "sim_compute_s", "hbm_s": "sim_hbm_s",
                                  "overhead_s": "sim_overhead_s", "link_stall_s": "sim_link_stall_s"})
    head_s = float(head_times(ModelShape.from_manifest(run.manifest["model"]), profile).total_s)
    steps = steps.assign(sim_rest_s=head_s)
    steps["sim_layers_s"] = steps["simulated_s"] - head_s
    return steps


def offload_is_asynchronous(device_type: str) -> bool:
    """Whether the measured run's offload copies overlap later compute: only on CUDA, and only when the DDR
    store the tracer builds says so (`asynchronous_offload`; its scatters through the mapped pinned pool run in
    order on the compute stream, so today it does not)."""
    if device_type != "cuda":
        return False  # the CPU path copies synchronously on the compute thread
    import torch

    from tracer.quant import make_block_store

    store = make_block_store("same", 1, 1, 1, torch.float32, torch.device(device_type))
    return bool(getattr(store, "asynchronous_offload", False))


def datasheet_for(device_name: str) -> str | None:
    name = device_name.lower()
    return next((profile for key, profile in DATASHEET_BY_GPU if key in name), None)


# ---------------------------------------------------------------- CLI ----------------------------------------


OWN = (
    Flag("--steps", "decode steps (max new tokens) per sample", POSITIVE_INT, default=128),
    Flag("--repeats", "identical measured decodes per configuration", POSITIVE_INT, default=3),
    Flag("--datasheet-profile", "datasheet profile to compare too: auto (by GPU name; none on a CPU), none, or a name",
         TEXT, default="auto"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The policy flags are the policy contract's (traces/policy.py), with crosscheck's grid as their defaults;
    # they come as text, which check_args parses through the contract.
    add_flags(parser,
              SHARED["model"].use(required=True, help="random:NAME / NAME from traces.architectures (e.g. tiny, "
                                                      "qwen2-7b), `micro`, HF id/path"),
              policy_flag("policy").use(nargs="+", default=list(POLICIES), choices=POLICIES,
                                        help="policies to measure and simulate", default_text=" ".join(POLICIES)),
              policy_flag("hbm_budget").use(nargs="+", default=["0.5", "0.25"], default_text="0.5 0.25",
                                            help="budgets for evict/hierarchy (fractions or token counts)"),
              policy_flag("evict_ratio").use(help="hierarchy: evicted fraction", default=PolicySpec.evict_ratio),
              policy_flag("recall_k").use(help="hierarchy: DDR blocks recalled per layer and step",
                                          default=PolicySpec.recall_k),
              policy_flag("block_size").use(help="tokens per KV block", default=PolicySpec.block_size),
              policy_flag("scorer").use(help="any tracer scorer but oracle, whose teacher pass is not timed",
                                        default=PolicySpec.scorer),
              *OWN, SHARED["samples"].use(help="samples of the task per measured run"),
              SHARED["task"].use(default="chains", help="tracer task; chains needs no data file"),
              SHARED["data_file"].use(help="local dataset file for the task (as `thoughtkv trace`)"),
              SHARED["device"].use(help="cpu | cuda"), "threads",
              SHARED["profile"].use(help="calibrated profile name or YAML",
                                    default_text="calibrate this machine now, `calibrate --quick`, into "
                                                 "OUT/measured-here-<device>.yaml, reused when rerun"))
    # The simulator's --overlap and --async-offload, spelled as in simulate (the tiered cache recalls, then attends)
    sim_options.add_arguments(parser, only=("overlap", "async_offload"), default_note={
        "async_offload": "as the measured run: on when the tracer's DDR store's offloads overlap later compute "
                         "(tracer.transfer.PinnedBlockStore says so; its scatters run in order: off)"})
    add_flags(parser, SHARED["out"].use(required=True, help="output directory (rerun to resume)"), "quiet")


def normalise_model(spec: str) -> str:
    """A known architecture's name means its random-weight model (`tiny` -> `random:tiny`), except a packaged
    pretrained model's (`smollm2-135m`), which means its real weights."""
    from tracer.packaged import PACKAGED_MODELS
    from traces.architectures import ARCHITECTURES

    return f"random:{spec}" if spec in ARCHITECTURES and spec not in PACKAGED_MODELS else spec


def check_args(args: argparse.Namespace) -> None:
    """Everything that needs no torch, before anything is written."""
    if "oracle" == args.scorer:
        raise CrosscheckError("--scorer oracle runs an untimed teacher pass first; pick another scorer")
    # --steps, --samples and --repeats were checked as they were parsed (POSITIVE_INT). The policy flags come as
    # text: the contract parses and checks them once, here, and the runs and crosscheck.json get its values.
    spec = PolicySpec(policy="hierarchy", evict_ratio=args.evict_ratio, recall_k=args.recall_k,
                      block_size=args.block_size)
    args.evict_ratio, args.recall_k, args.block_size = spec.evict_ratio, spec.recall_k, spec.block_size
    for budget in args.hbm_budget:
        parse_budget(budget)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CrosscheckError(f"--out {out}: exists and is not a directory")
    parent = next((p for p in [out, *out.parents] if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK):
        raise CrosscheckError(f"--out {out}: not writable")


def load_profiles(args: argparse.Namespace, device_type: str, device_name: str):
    from hwprofiles import ProfileError, load_profile

    name = args.profile
    if name is None:  # calibrate here, now: the measured side and the profile come from one machine and run
        from tracer.calibrate import architecture_for_model, cache_geometry, calibrate_here

        name = Path(args.out) / f"measured-here-{device_type}.yaml"
        if not name.is_file():  # a rerun resumes with the calibration its measurements were taken next to
            Path(args.out).mkdir(parents=True, exist_ok=True)
            calibrate_here(device_type, name, resolve_threads(device_type, args.threads), progress=not args.quiet,
                           architecture=architecture_for_model(normalise_model(args.model), device_type),
                           geometry=cache_geometry(block_size=args.block_size))  # the measured runs' blocks
        name = str(name)
    try:
        calibrated = load_profile(name)
    except ProfileError as exc:
        raise CrosscheckError(f"{exc} (run `thoughtkv calibrate --device {device_type}` first)") from None
    if calibrated.provenance.get("kind") != "measured":
        raise CrosscheckError(f"--profile {name}: a datasheet profile; give one written by `thoughtkv calibrate`")
    datasheet = None
    choice = args.datasheet_profile
    if choice != "none":
        datasheet_name = datasheet_for(device_name) if choice == "auto" and device_type == "cuda" else (
            None if choice == "auto" else choice)
        datasheet = load_profile(datasheet_name) if datasheet_name else None
    return calibrated, datasheet


def settings_record(args: argparse.Namespace, model: str, device_type: str, threads: int) -> dict:
    keys = ("policy", "hbm_budget", "evict_ratio", "recall_k", "block_size", "scorer", "steps", "samples", "task",
            "data_file", "repeats")
    settings = {"model": model, "device": device_type, "threads": threads, **{k: getattr(args, k) for k in keys}}
    if settings["data_file"] is not None:  # a Path (the PATH kind): JSON records its text
        settings["data_file"] = str(settings["data_file"])
    return settings


def run(args: argparse.Namespace) -> int:
    check_args(args)
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from tracer.calibrate.measured import load_for_crosscheck, measured_run
    from tracer.run import TraceConfig

    device_type = resolve_device(args.device, allow_index=False)  # tracer.preflight: the one --device check
    threads = resolve_threads(device_type, args.threads)
    device_name = torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu"
    calibrated, datasheet = load_profiles(args, device_type, device_name)
    if calibrated.provenance.get("device") != device_type:
        raise CrosscheckError(f"profile {calibrated.name} was calibrated on {calibrated.provenance.get('device')}, "
                              f"not {device_type}; calibrate this device")
    from traces.host import host_facts, provenance_warning

    here = host_facts()
    host_warning = provenance_warning(calibrated.name, calibrated.provenance, "this machine", {"host_facts": here})
    if host_warning:
        print(host_warning, file=sys.stderr)
    clock = "trace" if device_type == "cuda" else ("thread_cpu" if threads == 1 else "wall")
    if clock != calibrated.provenance.get("clock", clock) and device_type == "cpu":
        raise CrosscheckError(f"profile {calibrated.name} was timed with the {calibrated.provenance.get('clock')} "
                              f"clock but {threads} threads give {clock}; use --threads "
                              f"{calibrated.provenance.get('threads')}")
    model_spec = normalise_model(args.model)
    check_model_spec(model_spec)  # before crosscheck.json is written
    out = Path(args.out)
    settings = settings_record(args, model_spec, device_type, threads)
    settings_path = out / "crosscheck.json"
    if settings_path.exists():
        previous = json.loads(settings_path.read_text())
        if previous != settings:
            raise CrosscheckError(f"--out {out} holds a crosscheck with other settings; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(settings, indent=1))

    torch.set_num_threads(threads)
    specs = run_specs(args.policy, args.hbm_budget)
    loaded = None
    measured_frames = []
    jobs = [(spec, rep) for rep in range(args.repeats) for spec in specs]  # round-robin (module docstring)
    for spec, rep in tqdm(jobs, desc="crosscheck: measured decodes", unit="run", disable=args.quiet):
        timing_path = out / "measured" / f"{spec.label}-rep{rep}.parquet"
        run_dir = out / "runs" / f"{spec.label}-rep{rep}"
        if timing_path.exists() and run_dir.exists():
            measured_frames.append(pd.read_parquet(timing_path))
            continue
        loaded = loaded or load_for_crosscheck(model_spec, device_type, seed=0)
        config = TraceConfig(
            model=model_spec, task=args.task, out=str(run_dir), n_samples=args.samples,
            data_file=settings["data_file"], policy=spec.policy, hbm_budget=spec.hbm_budget,
            evict_ratio=args.evict_ratio, block_size=args.block_size, scorer=args.scorer, recall_k=args.recall_k,
            max_new_tokens=args.steps, device=device_type,
        )
        _, timings = measured_run(loaded, config, clock)
        timings = timings.assign(label=spec.label, policy=spec.policy, hbm_budget=spec.hbm_budget, repeat=rep)
        timing_path.parent.mkdir(parents=True, exist_ok=True)
        timings.to_parquet(timing_path, index=False)
        measured_frames.append(timings)
    all_measured = pd.concat(measured_frames, ignore_index=True)
    # Repeats are reduced like the calibration's repeats were (median, or min on a shared machine).
    statistic = calibrated.provenance.get("statistic", "median")
    measured = (all_measured.groupby(["label", "sample_id", "step"], sort=False)
                .agg(measured_s=("measured_s", statistic), layers_s=("layers_s", statistic),
                     wall_s=("wall_s", statistic),
                     repeats=("repeat", "nunique"), policy=("policy", "first"), hbm_budget=("hbm_budget", "first"))
                .reset_index())
    consistent = repeats_consistent(out, specs, args.repeats)

    as_measured = {} if args.async_offload is not None else {"async_offload": offload_is_asynchronous(device_type)}
    options = sim_options.from_args(args, **as_measured)
    async_offload = options.async_offload
    sim_frames = []
    for spec in specs:
        run_dir = out / "runs" / f"{spec.label}-rep0"
        profile, overhead_source = profile_for_policy(calibrated, spec.policy)
        variants = [("calibrated", profile)]
        if datasheet is not None:
            variants += [("datasheet", datasheet),  # kernel-only
                         ("datasheet+hf-eager", apply_mode(datasheet, "hf-eager")),
                         ("datasheet+overheads", dataclasses.replace(datasheet, overheads=profile.overheads))]
        for kind, variant in variants:
            frame = simulate_steps(run_dir, variant, options)
            sim_frames.append(frame.assign(label=spec.label, profile_kind=kind, profile=variant.name,
                                           overheads={"datasheet": "none", "datasheet+hf-eager": "hf-eager"}.get(kind, overhead_source)))
    table = step_errors(measured, pd.concat(sim_frames, ignore_index=True))
    summary = summarise(table)
    table.to_parquet(out / "steps.parquet", index=False)
    table.to_csv(out / "steps.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    overall = summary[(summary["label"] == "ALL") & (summary["profile_kind"] == "calibrated")].iloc[0].to_dict()
    report = {
        "settings": settings, "clock": clock, "statistic": statistic, "async_offload": async_offload, "profile": calibrated.name, "datasheet_profile":
        datasheet.name if datasheet else None, "repeats_identical": consistent,
        "goal": {"median_rel_error": GOAL_MEDIAN, "p95_rel_error": GOAL_P95},
        # Which machine each side came from (traces/host.py); a warning when they differ.
        "measured_host": here, "profile_host": calibrated.provenance.get("host_facts"), "host_warning": host_warning,
        "calibrated": {k: overall[k] for k in ("n_steps", "median_rel_error", "p95_rel_error",
                                               "mean_signed_rel_error")},
        "goal_met": bool(overall["median_rel_error"] <= GOAL_MEDIAN and overall["p95_rel_error"] <= GOAL_P95),
        "dominant_error": dominant_term(overall),
        "load_average": os.getloadavg(),
        "summary": summary.to_dict(orient="records"),
    }
    (out / "summary.json").write_text(json.dumps(report, indent=1, default=float))
    scatter_figure(table, out / "scatter.png",
                   f"{model_spec} on {device_name}: median {overall['median_rel_error']:.1%}, "
                   f"p95 {overall['p95_rel_error']:.1%} (calibrated)")
    print_table(summary, report, out)
    return 0


def repeats_consistent(out: Path, specs: list[RunSpec], repeats: int) -> bool:
    """True when every repeat moved exactly the same blocks at the same steps as the first (it should)."""
    from traces import open_run

    columns = ["step", "layer", "hbm_tokens", "recalled_tokens", "bytes_h2d", "bytes_d2h"]
    for spec in specs:
        first = open_run(out / "runs" / f"{spec.label}-rep0").steps(columns=columns).reset_index(drop=True)
        for rep in range(1, repeats):
            other = open_run(out / "runs" / f"{spec.label}-rep{rep}").steps(columns=columns).reset_index(drop=True)
            if not first.equals(other):
                return False
    return True


def print_table(summary, report: dict, out: Path) -> None:
    cols = ["profile_kind", "label", "n_steps", "measured_ms_median", "simulated_ms_median", "median_rel_error",
            "p95_rel_error", "mean_signed_rel_error"]
    shown = summary[cols].copy()
    for column in ("median_rel_error", "p95_rel_error"):
        shown[column] = shown[column].map("{:.1%}".format)
    shown["mean_signed_rel_error"] = shown["mean_signed_rel_error"].map("{:+.1%}".format)
    for column in ("measured_ms_median", "simulated_ms_median"):
        shown[column] = shown[column].map("{:.2f}".format)
    print(shown.to_string(index=False))
    calibrated = report["calibrated"]
    verdict = "met" if report["goal_met"] else "MISSED"
    print(f"calibrated profile {report['profile']}: median {calibrated['median_rel_error']:.1%}, "
          f"p95 {calibrated['p95_rel_error']:.1%} over {calibrated['n_steps']} steps "
          f"(goal <= {GOAL_MEDIAN:.0%} / <= {GOAL_P95:.0%}: {verdict}); largest error: {report['dominant_error']}")
    print(f"wrote {out}/summary.csv, summary.json, steps.parquet, scatter.png")
