"""`thoughtkv simulate RUN_DIR --profile NAME ...`: replay a trace against hardware profiles.

Prints one row per profile and writes the full results to --out (default RUN_DIR/sim/):
results.parquet/.csv (one row per sample and profile), summary.parquet/.csv (one row per profile) and
steps.parquet (per-step latencies). Rows of an earlier call with the same run, what-if, profile and options
are replaced; all other rows already there are kept.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from simulator import options as sim_options
from simulator.errors import SimulationError
from thoughtkv_base.options import PATH, SHARED, TEXT, Flag, add_flags


class SimulateOptionError(SimulationError):
    pass


# serve-sim takes the same repeatable --profile
PROFILES = SHARED["profile"].use(help="hardware profile name or YAML path (repeatable)", action="append", default=[],
                                 metavar="NAME")

OWN = (
    Flag("run_dir", "a trace run directory", PATH, metavar="RUN_DIR"),
    Flag("--all-profiles", "every shipped and measured profile", None, action="store_true", default=False),
    Flag("--what-if", "replay recorded masses under another placement, e.g. budget=0.3,block=32,recall_k=8,"
         "scorer=h2o,policy=hierarchy,evict=0.1,recall_rule=score (results are 'projected')", TEXT, metavar="SPEC"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PROFILES, *OWN)
    sim_options.add_arguments(parser)  # --overlap, --async-offload, --batch, --engine, --offload-tier, --transfer
    # --as-model, --as-dtype, --context-scale, --recalls: one flag per options.Projection field (serve-sim's too)
    sim_options.add_arguments(parser, sim_options.Projection)
    add_flags(parser, SHARED["timeline"].use(help="Chrome-trace JSON of the first sample on each profile (open in "
                                                  "ui.perfetto.dev)", metavar="FILE"),
              SHARED["out"].use(help="results directory (default RUN_DIR/sim)"))


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hwprofiles import load_profile
    from hwprofiles.loader import contention_note, default_profiles, left_out_reason
    from simulator.engine import Timeline
    from simulator.simulate import simulate_run
    from traces.reader import open_run

    if args.all_profiles and args.profile:
        raise SimulateOptionError("give either --profile NAME (repeatable) or --all-profiles, not both")
    if not args.all_profiles and not args.profile:
        raise SimulateOptionError("no hardware given; add --profile NAME (see `thoughtkv profiles list`) or --all-profiles")
    options = sim_options.from_args(args)
    projection = sim_options.from_args(args, sim_options.Projection)  # checked there (ProjectionError)
    if options.engine == "fast" and args.timeline is not None:
        raise SimulateOptionError("--timeline records the DES; drop --engine fast")
    run_ = open_run(args.run_dir)  # checks run.json and its schema version before anything else
    damage = missing_parts_line(run_)
    if damage is not None and args.what_if is not None:  # a what-if reads the access parts
        raise SimulateOptionError(damage)
    if damage is not None:  # a replay reads the steps only (a missing steps part is refused where it is read)
        print(f"warning: {damage}; replaying from the steps", file=sys.stderr)
    if args.all_profiles:
        profiles, left_out = default_profiles()
        if left_out:
            reasons = ", ".join(f"{name} ({left_out_reason(load_profile(name))})" for name in left_out)
            print(f"note: --all-profiles leaves out {reasons}; name one with --profile to use it anyway",
                  file=sys.stderr)
    else:
        profiles = [load_profile(name) for name in args.profile]
        for profile in profiles:
            note = contention_note(profile)
            if note is not None:
                print(f"warning: profile {profile.name} was {note}", file=sys.stderr)
    out = args.out if args.out is not None else args.run_dir / "sim"
    _check_writable_dir(out, "--out")
    for name in RESULT_FILES:  # an unreadable earlier results file fails now, before any simulation
        if (out / name).is_file():
            _read_existing(out / name)
    if args.timeline is not None:
        _check_writable_file(args.timeline, "--timeline")
    if len(run_.samples()) and (run_.samples()["generated_tokens"] <= 1).all():  # every sample ended at its prefill
        print(f"warning: {args.run_dir} has no decode step (every sample ended at its prefill): ms/token shows "
              "the prefill's time and tokens/s is undefined (nan)", file=sys.stderr)

    timeline = Timeline() if args.timeline is not None else None
    results, written = [], []
    n_samples = len(run_.sample_ids())
    with tqdm(total=len(profiles) * n_samples, desc="simulate", unit="sample", disable=len(profiles) * n_samples < 4) as bar:
        for profile in profiles:
            bar.set_postfix_str(profile.name)
            results.append(simulate_run(run_, profile, options, what_if=args.what_if, timeline=timeline,
                                        progress=bar.update, projection=projection))
            written = write_results(results[-1:], out)  # after each profile: an interrupt keeps finished ones
            for warning in results[-1].warnings:
                tqdm.write(warning, file=sys.stderr)
    if timeline is not None:
        timeline.write(args.timeline)
    for line in table_lines([r.summary for r in results]):
        print(line)
    print(f"results: {', '.join(str(p) for p in written)}" + (f"; timeline: {args.timeline}" if timeline else ""))
    return 0


def missing_parts_line(run) -> str | None:
    """One line, as `thoughtkv traces validate` words it (which refuses such a run), when committed samples lack
    a part of a table the run records (a deleted access.parquet, a copy that left a folder out); else None. A
    directory listing per table: the deep read stays validate's."""
    from traces.cli import repair_command
    from traces.layout import list_parts

    committed = run.sample_ids()
    tables = ["steps", "tokens", *(["access"] if run.has_access else [])]
    for table in tables:
        missing = [s for s in committed if s not in list_parts(run.path, table)]
        if missing:
            return (f"{run.path}: {len(missing)} of {len(committed)} committed sample(s) have no {table} part (first: "
                    f"{missing[0]!r}); `thoughtkv traces validate` refuses this run; to repair, rerun "
                    f"`{repair_command(run.manifest, run.path)}`")
    return None


def _check_writable_dir(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise SimulateOptionError(f"{what} {path}: exists and is not a directory; choose another path")
    parent = next((p for p in [path, *path.parents] if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):  # a file as parent: ENOTDIR later
        raise SimulateOptionError(f"{what} {path}: cannot be created (no writable parent directory); choose another path")


def _check_writable_file(path: Path, what: str) -> None:
    if path.is_dir():
        raise SimulateOptionError(f"{what} {path}: is a directory; give a file name such as timeline.json")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise SimulateOptionError(f"{what} {path}: its directory does not exist or is not writable")


def write_results(results, out: Path) -> list[Path]:
    """Merge into out/: rows with the same key as a new row are replaced, every other row is kept."""
    import io

    import pandas as pd

    from simulator.columns import KEY_COLUMNS
    from traces.layout import write_bytes_atomic

    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "results": pd.concat([r.samples for r in results], ignore_index=True),
        "summary": pd.DataFrame([r.summary for r in results]),
        "steps": pd.concat([r.steps for r in results], ignore_index=True),
    }
    written = []
    for name, new in tables.items():
        path = out / f"{name}.parquet"
        keys = [*KEY_COLUMNS, *(["step"] if name == "steps" else [])]
        if path.exists():
            old = _with_option_defaults(_read_existing(path))
            if set(keys) <= set(old.columns):
                stale = old.set_index(keys).index.isin(new.set_index(keys).index)
                new = pd.concat([old[~stale], new], ignore_index=True)
        buffer = io.BytesIO()
        new.to_parquet(buffer, index=False)
        write_bytes_atomic(path, buffer.getvalue())
        written.append(path)
        if name != "steps":
            csv = out / f"{name}.csv"
            write_bytes_atomic(csv, new.to_csv(index=False).encode())
            written.append(csv)
    return written


RESULT_FILES = ("results.parquet", "summary.parquet", "steps.parquet")  # merged into on every call


def _read_existing(path: Path):
    """An earlier results table in --out (rows are merged into it); unreadable -> one line, nothing written."""
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a damaged file
        raise SimulateOptionError(f"--out {path.parent}: {path.name} is not a readable results table "
                                  f"({str(exc).splitlines()[0][:100]}); move it away or choose another --out") from None


def _with_option_defaults(old):
    """Rows written before an option existed were computed with its default: give them that column."""
    from dataclasses import fields

    for f in fields(sim_options.SimOptions):
        if f.name in sim_options.KEY_FIELDS and f.name not in old.columns:
            old[f.name] = f.default
    return old


def table_lines(summaries: list[dict]) -> list[str]:
    """The printed table: a line naming the overhead modes charged (ms/token differs ~100x between kernel-only
    and hf-eager for a small model), then one row per profile, the profile column as wide as its longest name."""
    from hwprofiles.overhead_modes import MODE_TEXT

    width = max([16, *(len(str(s["profile"])) + 1 for s in summaries)])
    modes = sorted({str(s["overhead_mode"]) for s in summaries})
    note = "; ".join(MODE_TEXT.get(m, m) for m in modes)
    if "kernel-only" in modes:  # the datasheet profiles' default, and not what the demo charges
        note += "; --overhead-mode hf-eager charges a transformers eager loop (what `thoughtkv demo` charges)"
    header = (f"{'profile':<{width}} {'kind':<9} {'overheads (host term)':<24} {'engine':<6} {'ms/token':>9} "
              f"{'tokens/s':>9} {'stall %':>7} {'peak HBM GB':>11} {'max conc. policy/full':>21}  flags")
    lines = [f"overheads charged: {note}", header, "-" * len(header)]
    for s in summaries:
        flags = []
        if s["hbm_overflow"]:
            flags.append("HBM OVERFLOW")
        if s["ddr_overflow"]:
            flags.append("DDR OVERFLOW")
        if s["d2h_backlog_s"] > 0:
            flags.append(f"offload backlog {s['d2h_backlog_s'] * 1e3:.1f} ms")
        concurrency = f"{s['max_concurrency_policy']}/{s['max_concurrency_full']}"
        overheads = f"{s['overhead_mode']} ({s['host_term']})"
        lines.append(
            f"{s['profile']:<{width}} {s['result_kind']:<9} {overheads:<24} {s['engine']:<6} {s['ms_per_token']:>9.3f} "
            f"{s['tokens_per_s']:>9.1f} {100 * s['link_stall_frac']:>7.1f} {s['peak_hbm_bytes'] / 1e9:>11.2f} "
            f"{concurrency:>21}  {' '.join(flags)}"
        )
    return lines
