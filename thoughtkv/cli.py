"""The `thoughtkv` command: a thin dispatcher. Each subcommand's code lives in its own package.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it must not import torch at
module level, so that `thoughtkv --help` and the torch-free subcommands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from thoughtkv_base import UserError, __version__

# (name, module, one-line help). Order = order in --help.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("profiles", "hwprofiles.cli", "hardware profiles: list, show, validate"),
    ("traces", "traces.cli", "trace runs: info, validate, synth (synthetic traces without torch)"),
    ("trace", "tracer.cli", "decode a model with a tiered KV cache and record a trace (torch)"),
    ("simulate", "simulator.cli", "replay a trace against hardware profiles (SimPy)"),
    ("serve-sim", "simulator.serving_cli", "serving simulation: continuous batching, HBM admission, shared link"),
    ("sweep", "simulator.sweep_cli", "grid of simulations or collections, local process pool or Ray"),
    ("plot", "analysis.cli", "figures, tables and report.md from traces and simulator results"),
    ("demo", "thoughtkv.demo", "the main job on the bundled micro model: trace, simulate, report"),
    ("calibrate", "tracer.calibrate", "microbenchmarks of this machine -> a measured hardware profile"),
    ("crosscheck", "thoughtkv.crosscheck", "measured decode vs simulator on the calibrated profile"),
    ("analyze", "analysis.analyze_cli", "statistics on traces (e.g. rank correlation between scorers)"),
]

# Second-level subcommands whose code lives in another package than their parent's
# (`traces synth` needs the simulator's placement model; `traces` itself stays the dependency-free base).
NESTED: dict[str, list[tuple[str, str, str]]] = {
    "traces": [("synth", "simulator.synth", "write a synthetic trace v1 for a known architecture (no torch)")],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thoughtkv",
        description="Trace collector and discrete-event memory-hierarchy simulator for reasoning-LLM KV caches.",
    )
    parser.add_argument("--version", action="version", version=f"thoughtkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name, help_text in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            p.set_defaults(_run=_not_yet(name))
            continue
        nested_parent = module.add_arguments(p)
        p.set_defaults(_run=module.run)
        for child, child_module_name, child_help in NESTED.get(name, []):
            # The parent's add_arguments returns its subparsers action so that children can join it.
            cp = nested_parent.add_parser(child, help=child_help, description=child_help)
            try:
                child_module = importlib.import_module(child_module_name)
            except ModuleNotFoundError as exc:
                if exc.name is None or not child_module_name.startswith(exc.name):
                    raise
                cp.set_defaults(_run=_not_yet(f"{name} {child}"))
                continue
            child_module.add_arguments(cp)
            cp.set_defaults(_run=child_module.run)
    return parser


def _not_yet(name: str):
    def run(_args: argparse.Namespace) -> int:
        from thoughtkv_base import NotYetImplemented

        raise NotYetImplemented(f"`thoughtkv {name}` is not implemented yet in this version")

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"thoughtkv {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"thoughtkv {args.command}: interrupted; finished work is kept, rerun to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
