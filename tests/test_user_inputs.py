"""What a new user tries beyond the happy path: each input is refused in one line on stderr (exit 2, nothing
written or lost) or gives the corrected result, and a command stopped mid-run leaves no process behind.

Each test runs the real command (in-process through `thoughtkv.cli.main`, or as a subprocess where a signal or
the process tree is the point) on tiny synthetic or bundled traces, and checks the files on disk or the
processes left, not only the message.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from _helpers import start_thoughtkv, wait_while_running

from simulator.synth import synth_run

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
