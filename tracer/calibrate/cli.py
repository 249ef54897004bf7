"""`thoughtkv calibrate`: its arguments and run, and `calibrate_here` (the demo's and crosscheck's calibration of
this machine before they measure on it)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from thoughtkv_base import UserError
from tracer.calibrate.measure import measure, resolve_architecture
from tracer.calibrate.plan import OVERHEAD_DECODERS, CalibrationError, cache_geometry, plan_for
from tracer.calibrate.profile import build_profile
from tracer.calibrate.write import summary_line, write_profile
from tracer.preflight import resolve_threads

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="device to calibrate (default: cuda when available, else cpu)")
    parser.add_argument("--out", default=None,
                        help="profile YAML to write; its stem is the profile name "
                             "(default: hwprofiles/measured/measured-<device>.yaml)")
    parser.add_argument("--architecture", default=None,
                        help="model shapes for the weight-read, GEMM and attention benchmarks: a known architecture "
                             "or a bundled model (micro, micro_long); calibrate for the model you will trace "
                             "(default: tiny on cpu, qwen2-7b on cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 on cpu, torch's default on cuda); recorded")
    parser.add_argument("--overhead-decoder", default="tiered/full", choices=OVERHEAD_DECODERS,
                        help="whose per-step/per-layer overheads the profile's `overheads` are (all are measured "
                             "and kept in provenance.overheads_by_decoder); default: tiered/full")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="reduce repeated timings by their median (default) or minimum (the uncontended cost "
                             "on a shared machine); recorded, and `thoughtkv crosscheck` reduces its repeats alike")
    parser.add_argument("--quick", action="store_true",
                        help="the same benchmarks with fewer sizes and repeats (<= 60 s on a 2-core CPU; what the demo runs)")
    for flag, what in (("--block-size", "tokens per KV block"), ("--sink-tokens", "attention sinks kept in HBM"),
                       ("--window-tokens", "recent window kept in HBM")):
        parser.add_argument(flag, type=int, default=None,
                            help=f"{what} of the tiered overhead decoders (default: the policy contract's); "
                                 "calibrate with the geometry of the runs the profile will be compared with")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: for tests only (figures mean little)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")


def resolve_out(out: str | None, device_type: str, force: bool) -> Path:
    from hwprofiles import MEASURED_DIR

    path = Path(out) if out else MEASURED_DIR / f"measured-{device_type}.yaml"
    if path.suffix not in (".yaml", ".yml"):
        raise CalibrationError(f"--out {path}: must end in .yaml (the profile is YAML)")
    if not NAME_PATTERN.match(path.stem):
        raise CalibrationError(f"--out {path}: the file stem is the profile name and must be lower-case letters, "
                               "digits, '.', '_' or '-'")
    if path.exists() and not force:
        raise CalibrationError(f"--out {path}: exists; pass --force to overwrite it or choose another file")
    if path.exists() and not path.is_file():
        raise CalibrationError(f"--out {path}: is not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not os.access(parent, os.W_OK):
        raise CalibrationError(f"--out {path}: directory {parent} is not writable")
    return path


def resolve_device(device: str | None) -> str:
    from tracer import preflight  # the one check of --device (a CPU build of torch -> the install line)

    return preflight.resolve_device(device, allow_index=False)


def run(args: argparse.Namespace) -> int:
    device_type = resolve_device(args.device)
    out = resolve_out(args.out, device_type, args.force)
    architecture = args.architecture or ("qwen2-7b" if device_type == "cuda" else "tiny")
    try:
        resolve_architecture(architecture)
    except UserError as exc:
        raise CalibrationError(f"--architecture: {exc}") from None
    threads = resolve_threads(device_type, args.threads)
    geometry = cache_geometry(args.block_size, args.sink_tokens, args.window_tokens)
    cal = measure(device_type, architecture, plan_for(device_type, "smoke" if args.smoke else "quick" if args.quick else "full"), threads, args.overhead_decoder,
                  args.statistic, geometry=geometry)
    profile, sources = build_profile(cal, out.stem)
    write_profile(profile, sources, out)
    print(summary_line(profile))
    print(f"wrote {out}")
    return 0


def calibrate_here(device_type: str, out: Path, threads: int, level: str = "quick", architecture: str | None = None,
                   progress: bool = True, geometry: dict | None = None) -> Path:
    """Calibrate this machine now (the `quick` plan: <= 60 s on a 2-core CPU) into `out`, for a command that
    then measures on it (demo, crosscheck): the profile and the timings it is compared with come from the same
    machine in the same run, and its tiered decoders use the runs' `geometry` (`cache_geometry`). Returns `out`."""
    architecture = architecture or ("qwen2-7b" if device_type == "cuda" else "tiny")
    cal = measure(device_type, architecture, plan_for(device_type, level), threads, progress=progress,
                  geometry=geometry)
    profile, sources = build_profile(cal, out.stem)
    write_profile(profile, sources, out)
    print(summary_line(profile), file=sys.stderr)
    return out
