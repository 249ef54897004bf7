"""`thoughtkv traces info RUN` and `thoughtkv traces validate RUN` (`traces synth` lives in the simulator)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from thoughtkv_base.options import PATH, Flag, add_flags
from traces.errors import TraceFormatError
from traces.stats import completion_lines, run_traffic, traffic_line

RUN = Flag("run_dir", "a trace run directory", PATH, metavar="RUN")  # of info and validate


def add_arguments(parser: argparse.ArgumentParser):
    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION")
    info = sub.add_parser("info", help="summary of a run: manifest, samples, accuracy, steps and bytes moved")
    add_flags(info, RUN)
    validate = sub.add_parser("validate", help="read every file of a run and check it against trace format v1")
    add_flags(validate, RUN)
    parser.set_defaults(_traces_parser=parser)
    return sub


def run(args: argparse.Namespace) -> int:
    from traces.reader import open_run

    if args.traces_command is None:
        args._traces_parser.print_help()
        return 2
    trace = open_run(args.run_dir)
    if args.traces_command == "validate":
        try:
            # A bar only on a terminal: in a log or a pipe the error must stay the one line on stderr.
            trace.validate(progress=sys.stderr.isatty())
        except TraceFormatError as exc:
            raise with_repair(exc, trace.manifest, args.run_dir) from None
        print(f"OK {args.run_dir}: {len(trace.sample_ids())} committed samples, trace format {trace.manifest['schema']}")
        return 0
    try:
        lines = info_lines(trace)
    except TraceFormatError as exc:  # a damaged part found while summarising: the same repair as validate's
        raise with_repair(exc, trace.manifest, args.run_dir) from None
    for line in lines:
        print(line)
    return 0


def with_repair(exc: TraceFormatError, manifest: dict, run_dir: Path) -> TraceFormatError:
    return TraceFormatError(f"{exc}; to repair, rerun `{repair_command(manifest, run_dir)}`, which writes damaged "
                            "samples again")


def repair_command(manifest: dict, run_dir: Path) -> str:
    """The command that resumes this run: rerun, it re-writes every sample with a damaged part
    (traces.writer drops them on resume): the argv `thoughtkv trace` recorded in run.json (tracer.command)."""
    settings = manifest.get("tracer")
    if manifest.get("kind") != "traced" or not isinstance(settings, dict):
        return f"the command that wrote {run_dir} (same --out)"
    n_samples = str(len(manifest["task"]["sample_ids"]))  # the sample list may have grown on resume
    command = settings.get("command")
    if isinstance(command, list) and all(isinstance(w, str) for w in command):  # as typed (tracer/cli.py)
        words = list(command)
        for option, value in (("--n-samples", n_samples), ("--out", str(run_dir))):
            if option in words[:-1]:
                words[words.index(option) + 1] = value
            else:
                words += [option, value]
        return shlex.join(words)
    # Written by demo, crosscheck or an older thoughtkv: the settings are in run.json, not the command line.
    return f"the command that wrote {run_dir} with the same --out (run.json `tracer` holds its settings)"


def info_lines(trace) -> list[str]:
    from traces.encoding import max_relative_error

    m = trace.manifest
    model, task, policy, access = m["model"], m["task"], m["policy"], m["access"]
    samples = trace.samples()
    lines = [
        f"run         {trace.path}  ({_disk_bytes(trace.path) / 1e6:.2f} MB on disk)",
        f"format      {m['schema']}  kind={m['kind']}  created={m['created']}  "
        f"thoughtkv={m['thoughtkv']['version']} ({m['thoughtkv']['git_commit'] or 'no git commit'})",
        f"model       {model['id']}  {model['architecture']}  layers={model['n_layers']}  "
        f"kv_heads={model['n_kv_heads']}x{model['head_dim']}  {model['dtype']}  "
        f"kv_bytes_per_token={model['kv_bytes_per_token']:,}  random_weights={model['random_weights']}",
        f"task        {task['name']} ({task['split']})  samples planned={len(task['sample_ids'])}",
        f"policy      {policy['name']}  hbm_budget={policy['hbm_budget']}  evict_ratio={policy['evict_ratio']}  "
        f"block_size={policy['block_size']}  scorer={policy['scorer']}  recall={policy['recall_rule']}",
        f"hardware    {m['hardware']['device']}  torch={m['hardware']['torch']}  cuda={m['hardware']['cuda']}",
        "access      " + (
            f"recorded, {access['encoding']} (max relative error "
            f"{max_relative_error(access.get('levels_per_octave', 8)):.1%}, floor 2^{access.get('floor_log2')})"
            if access["enabled"] else "not recorded"
        ),
        f"samples     {len(samples)} committed",
    ]
    # Token-limit share, accuracy over all and over finished samples (long generations).
    lines += [f"{label:<11} {text}" for label, text in completion_lines(samples)]
    if len(samples):
        steps = trace.steps(columns=["step", "bytes_h2d", "bytes_d2h"])
        lines += [
            f"tokens      prompt={int(samples['prompt_tokens'].sum()):,}  generated={int(samples['generated_tokens'].sum()):,}"
            f"  wall={samples['wall_s'].sum():.1f} s",
            f"steps       {len(steps):,} (step, layer) rows  H2D={int(steps['bytes_h2d'].sum()):,} bytes  "
            f"D2H={int(steps['bytes_d2h'].sum()):,} bytes",
            f"traffic     {traffic_line(run_traffic(trace))}",
        ]
    return lines


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
