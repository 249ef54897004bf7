"""What a new user tries beyond the happy path: each input is refused in one line on stderr (exit 2, nothing
written or lost) or gives the corrected result, and a command stopped mid-run leaves no process behind.

Each test runs the real command (in-process through `thoughtkv.cli.main`, or as a subprocess where a signal or
the process tree is the point) on tiny synthetic or bundled traces, and checks the files on disk or the
processes left, not only the message.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
from _helpers import start_thoughtkv, wait_while_running

from analysis.frames import add_method
from analysis.load import run_table
from simulator.synth import synth_run
from thoughtkv.cli import main
from traces import open_run

REPO = Path(__file__).resolve().parents[1]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith(("warning:", "note:"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """Two 40-step samples of the `tiny` architecture, full cache (serve-sim and sweeps in seconds)."""
    return synth_run(tmp_path_factory.mktemp("tiny") / "run", model="tiny", prompt_tokens=16, decode_steps=40,
                     samples=2, policy="full")


# -- a sweep stopped mid-run: no worker, no resource tracker left --------------------------------------------


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process, from /proc (Linux)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended while listed
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    table = process_table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pids: set[int]) -> set[int]:
    """The pids still alive (a zombie has ended: it only waits for a parent to read its status)."""
    table = process_table()
    return {p for p in pids if p in table and table[p][1] != "Z"}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="lists processes through /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_stopped_mid_run_leaves_no_child_process(signum, tiny_run, tmp_path):
    """`kill -INT` / `kill PID` reach the sweep's own process only (not its process group, as a terminal's Ctrl-C
    does): its workers, busy in cells that take many seconds, and the multiprocessing resource tracker must end
    with it."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"kind: serve\nruns: [{tiny_run}]\nprofiles: [h100-pcie, h200-sxm]\nrate_per_s: [200, 201]\n"
                    "duration_s: 60\n")  # each cell serves ~12,000 requests: far longer than this test waits
    out = tmp_path / "out"
    process = start_thoughtkv(["sweep", "--grid", str(grid), "--out", str(out), "--workers", "2"], REPO, text=True)
    children: set[int] = set()
    try:
        def workers_started() -> bool:
            return sum("multiprocessing.spawn" in cmdline(p) for p in descendants(process.pid)) >= 2

        wait_while_running(process, workers_started, timeout_s=120)
        time.sleep(1.5)  # the workers import the simulator and start their first cells
        children = descendants(process.pid)
        assert process.poll() is None and sum("multiprocessing.spawn" in cmdline(p) for p in children) >= 2
        assert any("resource_tracker" in cmdline(p) for p in children), [cmdline(p) for p in children]
        process.send_signal(signum)
        rc = process.wait(timeout=60)
        deadline = time.time() + 15
        while running(children) and time.time() < deadline:
            time.sleep(0.1)
        left = running(children)
    finally:
        process.kill()
        for pid in running(children):  # never leave them to the next test, whatever happened
            os.kill(pid, signal.SIGKILL)
    assert rc == 128 + signum
    assert not left, [cmdline(p) for p in left]
    assert "finished work is kept, rerun to resume" in process.stderr.read()
    assert not (out / "results.parquet").exists()  # no cell finished: nothing merged, nothing half-written


# -- capacity: runs that differ only by scorer ---------------------------------------------------------------

MICRO_HIERARCHY = REPO / "traces" / "samples" / "micro-hierarchy-b30-e0"


def with_policy(source: Path, out: Path, **policy) -> Path:
    """A copy of a run whose run.json policy has `policy` set (the traces are the source's)."""
    shutil.copytree(source, out)
    manifest = json.loads((out / "run.json").read_text())
    manifest["policy"].update(policy)
    (out / "run.json").write_text(json.dumps(manifest))
    return out


def test_capacity_names_the_scorer_of_runs_at_one_budget_as_plot_does(tmp_path, capsys):
    tova = with_policy(MICRO_HIERARCHY, tmp_path / "h30tova", scorer="tova")
    out = tmp_path / "cap"
    assert main(["capacity", str(MICRO_HIERARCHY), str(tova), "--profile", "h100-pcie", "--rates", "1024,4096",
                 "--refine", "0", "--duration-s", "1", "--workers", "1", "--out", str(out)]) == 0, capsys.readouterr()
    capacity = pd.read_csv(out / "report" / "tables" / "capacity_served.csv")
    assert sorted(capacity["label"]) == ["hierarchy, evict 0% [h2o] @ 30%", "hierarchy, evict 0% [tova] @ 30%"]
    # the rule is the report's: the same two runs get the same method names in `plot`
    runs = run_table([open_run(MICRO_HIERARCHY), open_run(tova)])
    assert sorted(f"{m} @ 30%" for m in add_method(runs)["method"]) == sorted(capacity["label"])
    assert (out / "report" / "figures" / "serving_knee.png").is_file()


def test_capacity_names_runs_the_labels_cannot_tell_apart(tmp_path):
    from analysis.serving import run_info

    copy = tmp_path / "again"
    shutil.copytree(MICRO_HIERARCHY, copy)
    labels = list(run_info([MICRO_HIERARCHY, copy])["label"])
    assert labels == [f"hierarchy, evict 0% @ 30% ({MICRO_HIERARCHY.name})", "hierarchy, evict 0% @ 30% (again)"]


@pytest.mark.parametrize("flags, problem", [
    (["--refine", "-1"], "--refine -1: give a number of refinement rounds >= 0"),
    (["--workers", "0"], "--workers 0: give at least 1"),
    (["RUN_AGAIN"], "given twice; name each run once"),
])
def test_capacity_refuses_in_plain_words(flags, problem, tmp_path, capsys):
    runs = [str(MICRO_HIERARCHY)] + [str(MICRO_HIERARCHY) for f in flags if f == "RUN_AGAIN"]
    flags = [f for f in flags if f != "RUN_AGAIN"]
    out = tmp_path / "cap"
    assert main(["capacity", *runs, "--profile", "h100-pcie", "--out", str(out), *flags]) == 2
    assert problem in one_line_error(capsys)
    assert not out.exists()
