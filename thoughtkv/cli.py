"""The `thoughtkv` command: a thin dispatcher. Each subcommand's code lives in its own package.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it must not import torch at
module level, so that `thoughtkv --help` and the torch-free subcommands start fast.

Every refusal looks the same: one line on stderr, exit 2 — a `UserError` from the code or from a flag's value
check (thoughtkv_base.options, as the flag is parsed), a usage error from argparse (`OneLineParser`), a group named without its action (the line lists the actions). Ctrl-C ends any
command within `HARD_INTERRUPT_GRACE_S`, even inside one long torch op (`hard_interrupt`); SIGTERM takes the same
path and says the same (work kept, rerun to resume), exiting 143; a subcommand module whose stop keeps nothing
says so in its `STOPPED_NOTE` (serve-sim writes its tables at the end), printed instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from contextlib import contextmanager

from thoughtkv.experiments import EXPERIMENTS
from thoughtkv_base import UserError, __version__

# The product commands: (name, module, one-line help). Order = order in --help.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("profiles", "hwprofiles.cli", "hardware profiles: list, show, validate"),
    ("traces", "traces.cli", "trace runs: info, validate, synth (synthetic traces without torch)"),
    ("trace", "tracer.cli", "decode a model with a tiered KV cache and record a trace (torch)"),
    ("models", "tracer.models_cli", "the models --model takes by name: bundled, packaged; shapes, KV bytes per token"),
    ("simulate", "simulator.cli", "replay a trace against hardware profiles (SimPy)"),
    ("serve-sim", "simulator.serving_cli", "serving simulation: continuous batching, paged admission, shared link"),
    ("capacity", "thoughtkv.capacity", "capacity as served: max arrival rate at an SLO per policy x profile, figures"),
    ("sweep", "simulator.sweep_cli", "grid of simulations or collections, local process pool or Ray"),
    ("plot", "analysis.cli", "figures, tables and report.md from traces and simulator results"),
    ("analyze", "analysis.analyze_cli", "statistics on traces (e.g. rank correlation between scorers)"),
    ("calibrate", "tracer.calibrate", "microbenchmarks of this machine -> a measured hardware profile"),
    ("crosscheck", "thoughtkv.crosscheck", "measured decode vs simulator on the calibrated profile"),
    ("demo", "thoughtkv.demo", "the main job on the bundled micro model: trace, simulate, report"),
    ("experiment", "thoughtkv.experiments.cli", "regenerate a committed document: the experiments listed below"),
]

# Second-level subcommands whose code lives in another module than their parent's (`traces synth` needs the
# simulator's placement model; `traces` itself stays the dependency-free base), and the experiments.
NESTED: dict[str, list[tuple[str, str, str]]] = {
    "traces": [("synth", "simulator.synth", "write a synthetic trace v1 for a known architecture (no torch)"),
               ("regrade", "tracer.regrade", "re-score a finished run's stored texts with the current grader (no torch)")],
    "experiment": [(name, module, f"{help_text}; writes {docs}") for name, module, docs, help_text in EXPERIMENTS],
}


# After a Ctrl-C the main thread normally raises KeyboardInterrupt at once; inside one long C++ op (a 7B
# matmul on a CPU takes tens of seconds) it cannot, so a watchdog ends the process after this grace.
HARD_INTERRUPT_GRACE_S = 1.5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
EXIT_TERMINATED = 143  # 128 + SIGTERM (`kill`, a job scheduler's stop)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `thoughtkv ... | head`
# What either says: every file a command writes is committed whole (temp name + rename), so the work done is kept.
STOPPED_TEXT = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}
STOPPED_EXIT = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}
KEPT_NOTE = "finished work is kept, rerun to resume"


def stopped_line(command: str, signum: int, note: str | None = None) -> str:
    return f"thoughtkv {command}: {STOPPED_TEXT[signum]}; {note or KEPT_NOTE}\n"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as a Ctrl-C is, so that every command stops the way it does on Ctrl-C
    (committed work kept, workers shut down) and says so; the exit status is 143."""


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage before its error; thoughtkv's refusals are one line, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _experiments_epilog() -> str:
    width = max(len(name) for name, *_ in EXPERIMENTS)
    lines = ["experiments (`thoughtkv experiment NAME --out docs/`; each resumes and rewrites its documents):"]
    for name, _module, docs, help_text in EXPERIMENTS:
        lines += [f"  {name:<{width}}  {help_text}", f"  {'':<{width}}  writes docs/{docs}"]
    return "\n".join(lines)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser tree, or with `argv` only the chosen command's (and experiment's) module imported: every
    command is listed with its help either way, but `thoughtkv simulate` never imports torch or pandas for the
    commands it does not run."""
    chosen = _chosen(argv)
    parser = OneLineParser(
        prog="thoughtkv",
        description="Trace collector and discrete-event memory-hierarchy simulator for reasoning-LLM KV caches.",
        epilog=_experiments_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"thoughtkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(_group_parser=parser, _group_dest="command")
    for name, module_name, help_text in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if chosen and chosen[0] != name:
            continue  # listed, not loaded
        module = importlib.import_module(module_name)
        nested_parent = module.add_arguments(p)
        p.set_defaults(_run=module.run, _stopped_note=getattr(module, "STOPPED_NOTE", None))
        group = _subparsers_of(p)
        if group is not None:  # a group (profiles, traces, analyze): naming no action is a one-line refusal
            p.set_defaults(_group_parser=p, _group_dest=group.dest)
        for child, child_module_name, child_help in NESTED.get(name, []):
            # The parent's add_arguments returns its subparsers action so that children can join it.
            cp = nested_parent.add_parser(child, help=child_help, description=child_help)
            if len(chosen) > 1 and chosen[1] != child:
                continue
            child_module = importlib.import_module(child_module_name)
            child_module.add_arguments(cp)
            cp.set_defaults(_run=child_module.run, _stopped_note=getattr(child_module, "STOPPED_NOTE", None))
    return parser


def _chosen(argv: list[str] | None) -> tuple[str, ...]:
    """The command (and its second word) that argv names, or () for the whole tree (--help, a typo, no argv)."""
    if argv is None:
        return ()
    words = [word for word in argv if not word.startswith("-")][:2]
    if not words or words[0] not in {name for name, *_ in SUBCOMMANDS}:
        return ()
    children = {child for child, *_ in NESTED.get(words[0], [])}
    return tuple(words) if len(words) > 1 and words[1] in children else words[:1]


def _subparsers_of(parser: argparse.ArgumentParser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


@contextmanager
def hard_interrupt(command: str, grace_s: float = HARD_INTERRUPT_GRACE_S, note: str | None = None):
    """Make Ctrl-C end the process within `grace_s` wherever the main thread is.

    Python runs a SIGINT handler only between bytecodes, so a Ctrl-C during one long torch op waits for the
    op. The C-level handler also writes the signal number to the wakeup fd at once (signal.set_wakeup_fd);
    a watchdog thread blocked on it wakes, and if the main thread has not unwound within `grace_s` it ends
    the process. Work on disk stays intact: every trace part and run.json is written to a temp name and
    renamed, and a resumed run removes leftover temp files.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only; nothing to watch from elsewhere
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    finished = threading.Event()

    def terminate(signum, frame):  # SIGTERM: the Ctrl-C path, told apart by its type
        raise Terminated()

    previous_sigterm = signal.signal(signal.SIGTERM, terminate)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or finished.is_set():
                return
            signum = next((s for s in (signal.SIGTERM, signal.SIGINT) if s in data), None)
            if signum is not None and not finished.wait(grace_s):
                os.write(2, stopped_line(command, signum, note).encode())
                os._exit(STOPPED_EXIT[signum])

    watchdog = threading.Thread(target=watch, name="thoughtkv-interrupt-watchdog", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        finished.set()
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.set_wakeup_fd(previous)
        os.write(write_fd, b"\0")  # wake the watchdog so that it returns
        watchdog.join(timeout=1.0)
        os.close(write_fd)
        os.close(read_fd)


def main(argv: list[str] | None = None) -> int:
    own_command_line = argv is None  # the process's own (console script, python -m thoughtkv), not a caller's
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except UserError as exc:  # a flag's value out of its kind's range (thoughtkv_base.options): before any work
        command = " ".join(_chosen(argv)) or "thoughtkv"
        print(f"thoughtkv {command}: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    group = getattr(args, "_group_parser", None)
    if group is not None and getattr(args, args._group_dest, None) is None:
        # Naming a group without its action is bad input like any other: one line, the choices, exit 2.
        choices = ", ".join(_subparsers_of(group).choices)
        print(f"{group.prog}: error: choose one of: {choices} (`{group.prog} --help` describes them)", file=sys.stderr)
        return 2
    try:
        with hard_interrupt(args.command, note=getattr(args, "_stopped_note", None)):
            return int(args._run(args) or 0)
    except UserError as exc:
        print(f"thoughtkv {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # stdout closed by its reader (`| head`): nothing more to say, as a shell tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # a path the filesystem refuses (name too long, not a directory, no space, read-only)
        where = f": {_one_line(exc.filename)}" if exc.filename else ""
        print(f"thoughtkv {args.command}: error: {_one_line(exc.strerror or exc)}{where}; check the "
              "path or free space", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
        sys.stderr.write(stopped_line(args.command, signum, getattr(args, "_stopped_note", None)))
        if own_command_line:
            # Skip the interpreter's teardown: unloading torch took seconds on a loaded machine, and every file
            # the command wrote is already committed (temp name + rename).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(STOPPED_EXIT[signum])
        return STOPPED_EXIT[signum]


def _one_line(exc: BaseException) -> str:
    """A refusal is one line whatever the message holds (a path or a value with a newline in it)."""
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
