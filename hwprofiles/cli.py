"""`thoughtkv profiles list|show NAME|validate FILE...`: look at and check hardware profiles."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from thoughtkv_base.options import PATH, TEXT, Flag, add_flags

# Each action's flags: show's NAME, list's and show's --profiles-dir, validate's FILEs.
NAME = Flag("name", "profile name (see `list`) or path to a .yaml file", TEXT, metavar="NAME")
PROFILES_DIR = Flag("--profiles-dir", "extra directory of <name>.yaml profiles, searched before the shipped ones", PATH,
                    metavar="DIR")
FILES = Flag("files", "profile .yaml files", PATH, nargs="+", metavar="FILE")


def add_arguments(parser: argparse.ArgumentParser):
    sub = parser.add_subparsers(dest="profiles_command", metavar="ACTION")
    p_list = sub.add_parser("list", help="table of all known profiles", description="table of all known profiles")
    p_show = sub.add_parser("show", help="every field of one profile, with units and sources",
                            description="every field of one profile, with units and sources")
    add_flags(p_show, NAME)
    for p in (p_list, p_show):
        add_flags(p, PROFILES_DIR)
    p_validate = sub.add_parser("validate", help="check profile YAML files (exit 2 if any is invalid)",
                                description="check profile YAML files (exit 2 if any is invalid)")
    add_flags(p_validate, FILES)
    return sub


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "profiles_command", None)
    if action == "list":
        return _list(args.profiles_dir)
    if action == "show":
        return _show(args.name, args.profiles_dir)
    if action == "validate":
        return _validate(args.files)
    print("usage: thoughtkv profiles {list,show,validate} ...", file=sys.stderr)
    return 2


def _list(profiles_dir: Path | None) -> int:
    from rich.console import Console
    from rich.table import Table

    from hwprofiles.loader import list_profiles

    table = Table("name", "GPU", "HBM GB", "HBM TB/s peak", "HBM TB/s achv", "link", "H2D GB/s achv",
                  "TFLOP/s peak", "extra tiers")
    for p in list_profiles(profiles_dir):
        table.add_row(
            p.name, p.gpu.name, f"{p.gpu.hbm_capacity_bytes / 1e9:g}", f"{p.gpu.hbm_peak_bytes_per_s / 1e12:.2f}",
            f"{p.gpu.hbm_bytes_per_s / 1e12:.2f}", p.link.kind, f"{p.link.h2d_bytes_per_s / 1e9:g}",
            f"{p.gpu.matmul_peak_flops_per_s / 1e12:g}", ", ".join(t.name for t in p.extra_tiers) or "-",
        )
    Console(width=max(160, Console().width)).print(table)
    return 0


def _show(name: str, profiles_dir: Path | None) -> int:
    import yaml

    from hwprofiles.loader import load_profile

    profile = load_profile(name, profiles_dir)  # validates; the raw file then gives units and sources as written
    with open(profile.path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    print(f"# {profile.name}  ({profile.path})")
    for line in _flatten(raw, ""):
        print(line)
    g, lk = profile.gpu, profile.link
    print("# derived (SI units, what the simulator uses)")
    print(f"gpu.hbm_bytes_per_s = {g.hbm_bytes_per_s:.4g}  (peak x efficiency)")
    print(f"gpu.matmul_flops_per_s = {g.matmul_flops_per_s:.4g}  (peak x efficiency)")
    print(f"link.h2d_bytes_per_s = {lk.h2d_bytes_per_s:.4g}, link.d2h_bytes_per_s = {lk.d2h_bytes_per_s:.4g}")
    return 0


def _flatten(node, prefix: str):
    """One line per field: `dotted.name = value unit  [source]`."""
    if isinstance(node, dict) and "source" in node and "value" in node:
        unit = f" {node['unit']}" if "unit" in node else ""
        yield f"{prefix} = {node['value']}{unit}  [{node['source']}]"
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list) and all(not isinstance(v, dict | list) for v in node):
        yield f"{prefix} = {str(node)[:200]}"  # e.g. calibration series: one line, not one per point
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _flatten(value, f"{prefix}[{index}]")
    else:
        yield f"{prefix} = {node}"


def _validate(files: list[Path]) -> int:
    from hwprofiles.loader import YAML_SUFFIXES, load_profile_file, search_dirs
    from hwprofiles.schema import ProfileError

    failures = 0
    # A user's file must not reuse a shipped name: `load_profile(name)` would then be ambiguous.
    shipped = {path.stem: path for d in search_dirs() for path in d.iterdir() if path.suffix in YAML_SUFFIXES}
    for file in files:
        try:
            profile = load_profile_file(file)
            other = shipped.get(profile.name)
            if other is not None and other.resolve() != Path(file).resolve():
                raise ProfileError(f"{file}: name: {profile.name!r} is already a shipped profile ({other}); "
                                   "choose another name")
        except ProfileError as exc:
            failures += 1
            print(f"thoughtkv profiles: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line per file
            continue
        print(f"ok  {profile.name}  ({file})")
    return 2 if failures else 0

