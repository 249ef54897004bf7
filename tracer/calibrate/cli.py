"""`thoughtkv calibrate`: its arguments and run, and `calibrate_here` (the demo's and crosscheck's calibration of
this machine before they measure on it)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from thoughtkv_base import UserError
from thoughtkv_base.options import SHARED, TEXT, Flag, add_flags
from tracer.calibrate.measure import measure, resolve_architecture
from tracer.calibrate.plan import OVERHEAD_DECODERS, CalibrationError, cache_geometry, plan_for
from tracer.calibrate.profile import build_profile
from tracer.calibrate.write import summary_line, write_profile
from tracer.preflight import resolve_threads
from traces.policy import policy_flag

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


OWN = (
    Flag("--architecture", "model shapes for the weight-read, GEMM and attention benchmarks: a known architecture or "
         "a bundled model (micro, micro_long); calibrate for the model you will trace", TEXT,
         default_text="tiny on cpu, qwen2-7b on cuda"),
    Flag("--overhead-decoder", "whose per-step/per-layer overheads the profile's `overheads` are (all are measured "
         "and kept in provenance.overheads_by_decoder)", TEXT, default="tiered/full", choices=OVERHEAD_DECODERS),
    Flag("--statistic", "reduce repeated timings by their median (default) or minimum (the uncontended cost on a "
         "shared machine); recorded, and `thoughtkv crosscheck` reduces its repeats alike", TEXT, default="median",
         choices=("median", "min")),
    Flag("--quick", "the same benchmarks with fewer sizes and repeats (<= 60 s on a 2-core CPU; what the demo runs)",
         None, action="store_true", default=False),
    Flag("--smoke", "tiny sizes, seconds: for tests only (figures mean little)", None, action="store_true",
         default=False),
    Flag("--force", "overwrite an existing --out file", None, action="store_true", default=False),
)
# The tiered overhead decoders' cache geometry: the policy contract's flags (text; cache_geometry parses them).
GEOMETRY = (("block_size", "tokens per KV block"), ("sink_tokens", "attention sinks kept in HBM"),
            ("window_tokens", "recent window kept in HBM"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["device"].use(help="device to calibrate", default_text="cuda when available, else cpu"),
              SHARED["out"].use(help="profile YAML to write; its stem is the profile name",
                                default_text="hwprofiles/measured/measured-<device>.yaml"),
              SHARED["threads"].use(default_text="1 on cpu, torch's default on cuda"), *OWN,
              *(policy_flag(name).use(help=f"{what} of the tiered overhead decoders (default: the policy contract's); "
                                           "calibrate with the geometry of the runs the profile will be compared with")
                for name, what in GEOMETRY))


def resolve_out(out: Path | str | None, device_type: str, force: bool) -> Path:
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
