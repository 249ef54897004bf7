"""Hypothesis drives every subcommand's numeric and path options through `thoughtkv.cli.main`, in-process.

Each call must end in exit 0, or in exit 2 with exactly one line on stderr and no traceback, within
CALL_LIMIT_S. The numeric options are read from the parser itself (every `type=int/float` option, plus the
options that take numbers as text), so a new option is fuzzed without editing this file; the path options are
listed per command. Options that size the work (samples, tokens, duration...) get bad values and small valid
ones only: a large valid workload is allowed to take long.

Commands whose valid runs take minutes (demo, calibrate, crosscheck) are given an `--out` that is an existing
file and a second bad value checked after it, so that every call ends in a refusal: the test there checks that
no value crashes the checks before it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import shutil
import time
from pathlib import Path

import pytest
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thoughtkv.cli import build_parser, main

SAMPLE_RUN = str(REPO / "traces" / "samples" / "micro-hierarchy-b30-e0")
PROFILE_YAML = str(REPO / "hwprofiles" / "profiles" / "h100-pcie.yaml")
GRID = str(REPO / "examples" / "sweeps" / "simulate_budgets.yaml")
GSM8K = str(REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl")
CALL_LIMIT_S = 30.0  # a loaded 2-core machine: one micro trace or one report, imports already done

# Options that take numbers as text (budgets as fractions or token counts, lists of them).
NUMERIC_TEXT = {"hbm_budget", "recall_budget", "evict_ratio", "block_size", "sink_tokens", "window_tokens",
                "recall_k", "budgets", "evict_ratios", "budget", "prompt_tokens", "decode_steps"}
# Options whose valid values size the work: fuzzed with bad values and small good ones only.
WORK = {"n_samples", "max_new_tokens", "prompt_tokens", "decode_steps", "samples", "steps", "repeats",
        "duration_s", "rate_per_s", "max_batch", "batch", "workers", "trace_workers", "threads"}

BAD_NUMBERS = ["0", "-1", "-0", "0.5", "1.5", "nan", "inf", "-inf", "1e308", "-1e308", "1e-320", "abc", "",
               " ", "0x10", "1,2", "1e3", "NaN", "2**8", "9" * 40, "-" + "9" * 40, "1_000", "١"]
SMALL_GOOD = ["1", "2", "3"]

# (base argv, the options/positions that take paths). "{out}" becomes a fresh path under the test's tmp dir,
# "{file}" an existing junk file (the refusal point of the slow commands).
COMMANDS: dict[str, tuple[list[str], list[str]]] = {
    "profiles list": (["profiles", "list"], ["--profiles-dir"]),
    "profiles show": (["profiles", "show", "h100-pcie"], ["#2", "--profiles-dir"]),
    "profiles validate": (["profiles", "validate", PROFILE_YAML], ["#2"]),
    "traces info": (["traces", "info", SAMPLE_RUN], ["#2"]),
    "traces validate": (["traces", "validate", SAMPLE_RUN], ["#2"]),
    "traces synth": (["traces", "synth", "--model", "tiny", "--prompt-tokens", "16", "--decode-steps", "8",
                      "--out", "{out}"], ["--out"]),
    "trace": (["trace", "--model", "micro", "--task", "chains", "--max-new-tokens", "2", "--block-size", "4",
               "--window-tokens", "8", "--out", "{out}", "--quiet"], ["--model", "--data-file", "--out"]),
    # A dataset task, so that --data-file is read (chains is generated and refuses any data file at once).
    "trace gsm8k": (["trace", "--model", "micro", "--task", "gsm8k", "--data-file", GSM8K, "--max-new-tokens", "2",
                     "--out", "{out}", "--quiet"], ["--data-file"]),
    "simulate": (["simulate", SAMPLE_RUN, "--profile", "h100-pcie", "--out", "{out}"],
                 ["#1", "--profile", "--timeline", "--out"]),
    "serve-sim": (["serve-sim", SAMPLE_RUN, "--profile", "h100-pcie", "--rate-per-s", "5", "--duration-s", "2",
                   "--out", "{out}"], ["#1", "--arrivals-csv", "--timeline", "--out"]),
    "sweep": (["sweep", "--grid", GRID, "--out", "{out}", "--dry-run"], ["--grid", "--out"]),
    "plot": (["plot", SAMPLE_RUN, "--out", "{out}", "--quiet"], ["#1", "--sim", "--out", "--measured-profile"]),
    # A second refusal, checked after --out, keeps a valid path from starting the real (minutes-long) run.
    "demo": (["demo", "--out", "{file}", "--model", "/nonexistent/model"], ["--out"]),
    "calibrate": (["calibrate", "--quick", "--out", "{file}", "--architecture", "nosuch-arch"], ["--out"]),
    "crosscheck": (["crosscheck", "--model", "tiny", "--out", "{file}", "--profile", "nosuch-profile"],
                   ["--out", "--data-file", "--profile"]),
    "analyze correlation": (["analyze", "correlation", SAMPLE_RUN], ["#2", "--out"]),
}
# Examples per command: refusals cost milliseconds, accepted runs up to a few seconds (trace, plot).
EXAMPLES = {"trace gsm8k": 6, "trace": 14, "plot": 3, "simulate": 12, "serve-sim": 16, "traces synth": 24, "analyze correlation": 8}
DEFAULT_EXAMPLES = 20
PATH_EXAMPLES = {"plot": 4, "trace gsm8k": 15}  # a report takes seconds; other commands refuse junk paths at once


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in name.split():  # "trace gsm8k": the trace command (a second word that is no subcommand is a label)
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or word not in action.choices:
            break
        parser = action.choices[word]
    return parser


def numeric_options(name: str) -> list[tuple[str, str]]:
    """(option string, dest) of every option of this subcommand that takes a number."""
    found = []
    for action in subparser(name)._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        if action.type in (int, float) or action.dest in NUMERIC_TEXT:
            found.append((action.option_strings[-1], action.dest))
    return found


def junk_paths(root: Path) -> list[str]:
    """Paths a user mistypes or a broken disk leaves: missing, a file, an empty dir, junk content, odd names."""
    junk_file = root / "junk.bin"
    junk_file.write_bytes(b"\x00\xffPAR1 not a thing {{{ ]]]\n" * 8)
    empty_dir = root / "empty"
    empty_dir.mkdir(exist_ok=True)
    fake_run = root / "fake-run"
    (fake_run / "samples.parquet").mkdir(parents=True, exist_ok=True)
    (fake_run / "run.json").write_text('{"schema": "thoughtkv.trace/1", "kind": [1, 2]')
    yaml_bomb = root / "bomb.yaml"
    yaml_bomb.write_text("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                         "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n")
    csv = root / "header_only.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens\n")
    # Data files a new user handed to --data-file: not UTF-8, empty, blank lines only.
    latin1, empty, blank = root / "latin1.jsonl", root / "empty.jsonl", root / "blank.jsonl"
    latin1.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    empty.write_bytes(b"")
    blank.write_text("\n  \n\t\n")
    return [str(root / "missing" / "x"), str(junk_file), str(empty_dir), str(fake_run), str(yaml_bomb), str(csv),
            "/dev/null", "", "-", str(root / ("n" * 300)), str(root / "new\nline"), str(junk_file) + "/below",
            str(latin1), str(empty), str(blank)]


def run_cli(argv: list[str]) -> tuple[int, str, float]:
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue(), time.perf_counter() - started


def check(argv: list[str]) -> None:
    code, err, elapsed = run_cli(argv)
    assert elapsed < CALL_LIMIT_S, f"{elapsed:.1f} s: {argv}"
    assert "Traceback" not in err, f"{argv}\n{err[-3000:]}"
    if code == 0:
        return
    # One error line; a `warning:`/`note:` line the command printed before it (e.g. "--rate-per-s unused with
    # --arrivals-csv") is information, not part of the refusal.
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    assert code == 2 and len(lines) == 1, f"exit {code}, {len(lines)} stderr lines for {argv}:\n{err[-3000:]}"


def with_value(base: list[str], option: str, value: str) -> list[str]:
    """`base` with `option` set to `value` (replacing it when present); `#N` is the Nth word (a positional)."""
    argv = list(base)
    if option.startswith("#"):
        argv[int(option[1:])] = value
        return argv
    if option in argv:
        argv[argv.index(option) + 1] = value
        return argv
    return [*argv, f"{option}={value}"]  # `=`: a value starting with "-" stays the option's value


_counter = itertools.count()


def fill(argv: list[str], root: Path) -> list[str]:
    fresh = root / f"out-{next(_counter)}"
    junk = root / "existing-file.yaml"
    junk.write_text("not: [a, profile\n")
    return [str(fresh) if a == "{out}" else str(junk) if a == "{file}" else a for a in argv]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The fuzz's scratch directory, also the working directory: relative junk paths (`-`) land there."""
    import os

    path = tmp_path_factory.mktemp("fuzz")
    previous = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(previous)


def test_every_numeric_option_is_found():
    """The introspection sees the options the issue named (so the fuzz below really reaches them)."""
    assert ("--n-samples", "n_samples") in numeric_options("trace")
    assert ("--threads", "threads") in numeric_options("trace")
    assert ("--rate-per-s", "rate_per_s") in numeric_options("serve-sim")
    assert ("--budget", "budget") in numeric_options("plot")
    assert ("--hbm-budget", "hbm_budget") in numeric_options("traces synth")
    for name in COMMANDS:
        subparser(name)  # every command listed exists


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_numeric_options(name, root):
    options = numeric_options(name)
    if not options:
        pytest.skip(f"{name} has no numeric options")
    base = COMMANDS[name][0]

    @settings(max_examples=EXAMPLES.get(name, DEFAULT_EXAMPLES), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data):
        option, dest = data.draw(st.sampled_from(options))
        values = BAD_NUMBERS + SMALL_GOOD if dest in WORK else BAD_NUMBERS + SMALL_GOOD + ["0.3", "64", "1000000000"]
        check(fill(with_value(base, option, data.draw(st.sampled_from(values))), root))

    fuzz()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_path_options(name, root):
    base, path_options = COMMANDS[name]
    paths = junk_paths(root)

    @settings(max_examples=PATH_EXAMPLES.get(name, min(12, len(paths) * len(path_options))), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(option=st.sampled_from(path_options), path=st.sampled_from(paths))
    def fuzz(option, path):
        check(fill(with_value(base, option, path), root))

    fuzz()
    shutil.rmtree(root / "missing", ignore_errors=True)
