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
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _helpers import start_thoughtkv, wait_while_running
from conftest import REPO

from analysis.frames import add_method
from analysis.load import run_table
from simulator.synth import synth_run
from thoughtkv.cli import main
from traces import open_run


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith(("warning:", "note:"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def error_line(capsys) -> str:
    """The one error line of a command that also logs progress (capacity's rounds) on stderr."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


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


# -- serve-sim: arrival CSV lengths, SLO and overload, size, stops -------------------------------------------


def serve(run: Path, out: Path, *flags: str) -> list[str]:
    return ["serve-sim", str(run), "--profile", "h100-pcie", "--out", str(out), *flags]


def test_an_arrival_csvs_lengths_are_served(tiny_run, tmp_path, capsys):
    """A 4,000-token prompt costs its prefill and its KV, though every traced prompt has 16 tokens."""
    csv = tmp_path / "a.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens\n0,4000,30\n0.5,16,41\n1.0,16,200\n")
    out = tmp_path / "s"
    assert main(serve(tiny_run, out, "--arrivals-csv", str(csv))) == 0, capsys.readouterr().err
    served = pd.read_parquet(out / "serving_requests.parquet")
    assert list(zip(served["prompt_tokens"], served["tokens"])) == [(4000, 30), (16, 41), (16, 200)]
    traced = open_run(tiny_run).samples()
    assert (traced["prompt_tokens"] == 16).all() and (traced["generated_tokens"] == 41).all()
    long, same = served.iloc[0], served.iloc[1]
    assert long["peak_hbm_kv_bytes"] > 50 * same["peak_hbm_kv_bytes"]  # ~4,030 tokens of KV against ~57
    assert long["ttft_s"] > same["ttft_s"]


@pytest.mark.parametrize("content, problem", [
    (None, "is a directory; pass the CSV file itself"),
    ("arrival_s,prompt_tokens,output_tokens\n0,8,\n", "line 2: output tokens (empty) is not a finite whole number"),
    ("arrival_s,prompt_tokens,output_tokens\n0,8,nan\n", "line 2: output tokens (empty) is not a finite whole number"),
    ("arrival_s,prompt_tokens,output_tokens\n0,8,2.5\n", "line 2: output tokens 2.5 is not a finite whole number"),
])
def test_a_bad_arrival_csv_is_one_plain_line(content, problem, tiny_run, tmp_path, capsys):
    csv = tmp_path / "a.csv"
    if content is None:
        csv.mkdir()
    else:
        csv.write_text(content)
    out = tmp_path / "s"
    assert main(serve(tiny_run, out, "--arrivals-csv", str(csv))) == 2
    error = one_line_error(capsys)
    assert problem in error and "np.float64" not in error
    assert not out.exists()


def test_a_window_without_requests_is_refused_not_a_row_of_nan(tiny_run, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(serve(tiny_run, out, "--rate-per-s", "1e-9")) == 2
    assert "no request arrived in the 60 s window at 1e-09 req/s (6e-08 expected" in one_line_error(capsys)
    assert not out.exists()


def test_an_overloaded_server_says_so_and_misses_its_ttft_slo(tiny_run, tmp_path, capsys):
    """hf-eager makes a tiny step ~1 ms; one request at a time at 100 req/s falls ~4x behind."""
    flags = ("--overhead-mode", "hf-eager", "--max-batch", "1", "--duration-s", "1")
    assert main(serve(tiny_run, tmp_path / "over", "--rate-per-s", "100", *flags)) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: overloaded")]
    assert len(warnings) == 1 and "of 100 req/s offered" in warnings[0] and "p99 TTFT" in warnings[0]
    over = pd.read_parquet(tmp_path / "over" / "serving_summary.parquet").iloc[0]
    requests = pd.read_parquet(tmp_path / "over" / "serving_requests.parquet")
    assert over["ttft_slo_s"] == 10.0  # the TTFT bound is in the SLO by default, as in capacity
    good = (requests["tbt_mean_s"] <= over["tbt_slo_s"]) & (requests["ttft_s"] <= over["ttft_slo_s"])
    assert over["slo_attainment"] == pytest.approx(good.mean())
    assert main(serve(tiny_run, tmp_path / "ok", "--rate-per-s", "5", *flags)) == 0
    assert "overloaded" not in capsys.readouterr().err
    assert pd.read_parquet(tmp_path / "ok" / "serving_summary.parquet").iloc[0]["slo_attainment"] == 1.0


def test_the_slo_attainment_counts_ttft(tiny_run, tmp_path):
    out = tmp_path / "s"
    assert main(serve(tiny_run, out, "--rate-per-s", "100", "--overhead-mode", "hf-eager", "--max-batch", "1",
                      "--duration-s", "1", "--ttft-slo-s", "0.5")) == 0
    summary = pd.read_parquet(out / "serving_summary.parquet").iloc[0]
    requests = pd.read_parquet(out / "serving_requests.parquet")
    assert requests["tbt_mean_s"].max() <= summary["tbt_slo_s"]  # TBT alone would call every request good
    assert summary["slo_attainment"] == pytest.approx((requests["ttft_s"] <= 0.5).mean())
    assert summary["slo_attainment"] < 0.5
    assert summary["goodput_tokens_per_s"] < summary["throughput_tokens_per_s"]


def test_a_huge_serving_window_is_estimated_and_refused_first(tiny_run, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(serve(tiny_run, out, "--rate-per-s", "1", "--duration-s", "2000000")) == 2
    err = capsys.readouterr().err
    assert "note: estimate: ~2,000,000 requests, ~82,000,000 tokens" in err
    refusal = [line for line in err.splitlines() if "error:" in line]
    assert len(refusal) == 1 and "of memory but" in refusal[0] and "--allow-large" in refusal[0]
    assert not out.exists()


def test_sigterm_during_serve_sim_says_nothing_was_written(tiny_run, tmp_path):
    out = tmp_path / "s"
    process = start_thoughtkv(serve(tiny_run, out, "--rate-per-s", "300", "--duration-s", "600"), REPO, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        wait_while_running(process, lambda: any(line.startswith("note: estimate") for line in lines), timeout_s=120)
        time.sleep(1.0)  # serving
        process.send_signal(signal.SIGTERM)
        rc = process.wait(timeout=30)
    finally:
        process.kill()
    reader.join(timeout=10)
    assert rc == 143
    stopped = [line for line in lines if "terminated (SIGTERM)" in line]
    assert len(stopped) == 1 and "nothing was written" in stopped[0] and "finished work is kept" not in stopped[0]
    assert not out.exists()


def test_capacity_at_an_slo_no_rate_meets_says_what_one_request_takes(tmp_path, capsys):
    out = tmp_path / "cap"
    assert main(["capacity", str(MICRO_HIERARCHY), "--profile", "h100-pcie", "--rates", "0.5", "--refine", "0",
                 "--duration-s", "10", "--workers", "1", "--tbt-slo-s", "0.000001", "--out", str(out)]) == 2
    error = error_line(capsys)
    assert "no rate meets this SLO (p99 TBT ≤ 0.001 ms" in error and "one request alone takes" in error
    assert "between tokens (p50 at 0.5 req/s" in error and "on h100-pcie" in error and "queueing" not in error
    assert not (out / "report").exists()
    cells = pd.concat([pd.read_parquet(p) for p in (out / "sweep" / "cells").glob("*.parquet")])
    assert list(cells["rate_per_s"]) == [0.5] and cells["mean_concurrency"].max() < 1.5  # no halving past "alone"
    alone_ms = float(error.split("one request alone takes ~")[1].split(" ms")[0])
    assert alone_ms == pytest.approx(1e3 * cells["tbt_p50_s"].iloc[0], rel=1e-2)
    assert alone_ms > 0.001


# -- plot ----------------------------------------------------------------------------------------------------


def test_plot_refuses_a_copied_run_it_would_pool_twice(tmp_path, capsys):
    copy = tmp_path / "oldver"
    shutil.copytree(MICRO_HIERARCHY, copy)
    manifest = json.loads((copy / "run.json").read_text())
    manifest["thoughtkv"]["version"] = "0.0.1"  # an edited copy: same config, same sample ids
    (copy / "run.json").write_text(json.dumps(manifest))
    out = tmp_path / "report"
    assert main(["plot", str(MICRO_HIERARCHY), str(copy), "--out", str(out), "--quiet"]) == 2
    error = one_line_error(capsys)
    assert "trace the same 20 sample(s)" in error and "pass one of them" in error
    assert main(["plot", str(MICRO_HIERARCHY), str(MICRO_HIERARCHY), "--out", str(out), "--quiet"]) == 2
    assert "is given twice" in one_line_error(capsys)
    assert not out.exists()


def shard(source: Path, out: Path, keep) -> Path:
    """A copy of a run with only the samples whose ids `keep` accepts (as a run split over machines)."""
    from traces.layout import sample_id_of_part

    shutil.copytree(source, out)
    for table in ("samples", "steps", "tokens", "access"):
        for part in (out / f"{table}.parquet").iterdir():
            if not keep(sample_id_of_part(part.name)):
                part.unlink()
    return out


def test_plot_still_pools_two_shards_of_one_policy(tmp_path, capsys):
    ids = open_run(MICRO_HIERARCHY).sample_ids()
    first = shard(MICRO_HIERARCHY, tmp_path / "a", lambda sid: sid in ids[:10])
    second = shard(MICRO_HIERARCHY, tmp_path / "b", lambda sid: sid in ids[10:])
    out = tmp_path / "report"
    assert main(["plot", str(first), str(second), "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    table = (out / "tables" / "table_capacity_accuracy.md").read_text()
    assert "| 20 |" in table  # 10 + 10 samples pooled into one row


@pytest.mark.parametrize("budget", ["7", "1.5", "0", "-0.3"])
def test_plot_refuses_a_budget_that_is_no_fraction(budget, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["plot", str(MICRO_HIERARCHY), "--budget", budget, "--out", str(out), "--quiet"]) == 2
    error = one_line_error(capsys)
    assert "--budget" in error and budget in error and "(0, 1]" in error
    assert not out.exists()


# -- damaged runs: a deleted table, an edited run.json ---------------------------------------------------------


@pytest.mark.parametrize("table", ["samples", "steps", "tokens", "access"])
def test_validate_names_a_deleted_table(table, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(MICRO_HIERARCHY, run)
    shutil.rmtree(run / f"{table}.parquet")
    assert main(["traces", "validate", str(run)]) == 2
    error = one_line_error(capsys)
    assert f"{table}.parquet" in error or f"no {table} part" in error
    assert "missing" in error or f"has no {table} part" in error
    assert "OK" not in error
    if table == "samples":  # every reader says what validate says, instead of "0 committed samples"
        assert "missing while steps.parquet" in error
        assert main(["simulate", str(run), "--profile", "h100-pcie", "--out", str(tmp_path / "sim")]) == 2
        assert "samples.parquet: missing" in one_line_error(capsys)
        assert not (tmp_path / "sim").exists()


@pytest.mark.parametrize("key, value, named", [
    ("hbm_budget", "abc", "policy.hbm_budget 'abc' is not a number"),
    ("evict_ratio", 2, "policy.evict_ratio 2 must be in [0, 1)"),
    ("recall_budget", "x", "policy.params.recall_budget 'x' is not a number"),
    ("name", "magic", "policy 'magic' is not one of"),
])
def test_an_edited_run_json_policy_is_refused_naming_the_file_and_key(key, value, named, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(MICRO_HIERARCHY, run)
    manifest = json.loads((run / "run.json").read_text())
    (manifest["policy"]["params"] if key == "recall_budget" else manifest["policy"])[key] = value
    (run / "run.json").write_text(json.dumps(manifest))
    for argv in (["traces", "validate", str(run)], ["simulate", str(run), "--profile", "h100-pcie", "--out",
                                                    str(tmp_path / "sim")]):
        assert main(argv) == 2
        error = one_line_error(capsys)
        assert f"{run / 'run.json'}: " in error and named in error and "--hbm-budget" not in error, error
    assert not (tmp_path / "sim").exists()


# -- profiles: an edited copy keeping a shipped name; --all-profiles ---------------------------------------------


def edited_copy(tmp_path: Path, name: str = "h100-pcie") -> Path:
    """hw2/<name>.yaml: the shipped profile with half its HBM bandwidth, still `name: <name>`."""
    from hwprofiles.loader import PROFILES_DIR

    path = tmp_path / "hw2" / f"{name}.yaml"
    path.parent.mkdir()
    text = (PROFILES_DIR / f"{name}.yaml").read_text()
    assert "hbm_peak_bandwidth:\n    value: 2.0" in text
    path.write_text(text.replace("hbm_peak_bandwidth:\n    value: 2.0", "hbm_peak_bandwidth:\n    value: 1.0"))
    return path


def test_an_edited_profile_copy_is_named_after_its_file_and_replaces_no_rows(tmp_path, capsys):
    copy = edited_copy(tmp_path)
    out = tmp_path / "sim"
    assert main(["simulate", str(MICRO_HIERARCHY), "--profile", str(copy), "--out", str(out)]) == 0
    assert main(["simulate", str(MICRO_HIERARCHY), "--profile", "h100-pcie", "--out", str(out)]) == 0
    assert f"h100-pcie (file {copy})" in capsys.readouterr().out
    summary = pd.read_parquet(out / "summary.parquet").set_index("profile")
    assert sorted(summary.index) == ["h100-pcie", f"h100-pcie (file {copy})"]  # both kept
    assert summary.loc[f"h100-pcie (file {copy})", "ms_per_token"] > summary.loc["h100-pcie", "ms_per_token"]
    from hwprofiles import load_profile
    from hwprofiles.loader import PROFILES_DIR

    same = tmp_path / "same" / "h100-pcie.yaml"  # an unedited copy is the same profile: its plain name
    same.parent.mkdir()
    shutil.copy(PROFILES_DIR / "h100-pcie.yaml", same)
    assert load_profile(same).name == load_profile(PROFILES_DIR / "h100-pcie.yaml").name == "h100-pcie"


def test_capacity_serves_an_edited_profile_copy_from_its_file(tmp_path, capsys):
    copy = edited_copy(tmp_path)
    out = tmp_path / "cap"
    assert main(["capacity", str(MICRO_HIERARCHY), "--profile", str(copy), "--profile", "h100-pcie", "--rates",
                 "1024,4096", "--refine", "0", "--duration-s", "1", "--workers", "1", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    served = pd.read_csv(out / "report" / "tables" / "serving.csv")
    assert set(served["profile"]) == {"h100-pcie", f"h100-pcie (file {copy})"}
    bandwidth = served.groupby("profile")["tbt_p50_s"].min()
    assert bandwidth[f"h100-pcie (file {copy})"] > bandwidth["h100-pcie"]  # the copy's slower HBM was served


def test_all_profiles_leaves_examples_out_and_names_the_overhead_mode(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(MICRO_HIERARCHY), "--all-profiles", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "example-measured-cpu (an example, not this machine)" in captured.err
    assert "example-measured-cpu" not in set(pd.read_parquet(out / "summary.parquet")["profile"])
    header = captured.out.splitlines()[0]
    assert header.startswith("overheads charged: kernel-only (no framework overhead") and "hf-eager" in header
    rows = [line for line in captured.out.splitlines() if line.startswith(("h100-pcie ", "measured-"))]
    assert len({line.index(" traced") for line in rows}) == 1  # one column width, whatever the names


# -- sweep grids, synthetic runs, messages ---------------------------------------------------------------------


@pytest.mark.parametrize("axis, text", [
    ("profiles: [h100-pcie, h200-sxm, h100-pcie]", "axis 'profiles' lists 'h100-pcie' twice"),
    ("profiles: [h100-pcie]\nwhat_if: {budget: [0.1, 0.3, 0.1]}", "axis 'what_if.budget' lists 0.1 twice"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_grid_listing_a_value_twice_is_refused_naming_the_axis(axis, text, dry_run, tiny_run, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"kind: simulate\nruns: [{tiny_run}]\n{axis}\n")
    out = tmp_path / "out"
    assert main(["sweep", "--grid", str(grid), "--out", str(out), *(["--dry-run"] if dry_run else [])]) == 2
    assert text in one_line_error(capsys)
    assert not out.exists()


def test_a_synthetic_run_without_decode_steps_is_refused(tmp_path, capsys):
    out = tmp_path / "zero"
    assert main(["traces", "synth", "--model", "tiny", "--prompt-tokens", "16", "--decode-steps", "0", "--out",
                 str(out)]) == 2
    assert "--decode-steps 0: give at least 1 decode step" in one_line_error(capsys)
    assert not out.exists()


def test_simulate_warns_once_when_a_run_has_no_decode_step(tmp_path, capsys):
    """A traced run can still end every sample at its prefill (EOS first): one line says what ms/token is then."""
    run = tmp_path / "run"
    synth_run(run, model="tiny", prompt_tokens=16, decode_steps=1, samples=1, policy="full")
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    for table in ("samples", "steps", "access"):  # as if the sample had stopped at its prefill (step 0)
        for part in (run / f"{table}.parquet").glob("*.parquet"):
            data = pq.read_table(part)
            if table == "samples":
                field = data.schema.field("generated_tokens")
                data = data.set_column(data.schema.get_field_index(field.name), field,
                                       pa.array([1] * data.num_rows, type=field.type))
            else:
                data = data.filter(pc.equal(data.column("step"), 0))
            pq.write_table(data, part)
    assert main(["simulate", str(run), "--profile", "h100-pcie", "--out", str(tmp_path / "sim")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "no decode step" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning:") and "tokens/s is undefined" in warnings[0]


@pytest.mark.parametrize("typo, meant", [("micro-long", "micro_long"), ("mirco", "micro"), ("Micro_Long", "micro_long")])
def test_a_misspelt_bundled_model_gets_a_did_you_mean(typo, meant, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["trace", "--model", typo, "--task", "chains_long", "--out", str(out), "--quiet"]) == 2
    error = one_line_error(capsys)
    assert f"did you mean {meant}?" in error and "Hub" not in error
    assert not out.exists()


# -- the report: its opening, its figures ------------------------------------------------------------------------

MICRO_FULL = REPO / "traces" / "samples" / "micro-full"
MICRO_EVICT = REPO / "traces" / "samples" / "micro-evict-h2o-b30"


@pytest.fixture(scope="module")
def hf_eager_report(tmp_path_factory) -> Path:
    """plot of three micro runs simulated on four GPUs under hf-eager (host-bound at micro's shapes)."""
    work = tmp_path_factory.mktemp("report")
    for run in (MICRO_FULL, MICRO_EVICT, MICRO_HIERARCHY):
        assert main(["simulate", str(run), "--profile", "h100-pcie", "--profile", "h200-sxm", "--profile", "l40s",
                     "--profile", "b200", "--overhead-mode", "hf-eager", "--out", str(work / "sim" / run.name)]) == 0
    out = work / "report"
    sims = [str(work / "sim" / run.name) for run in (MICRO_FULL, MICRO_EVICT, MICRO_HIERARCHY)]
    assert main(["plot", str(MICRO_FULL), str(MICRO_EVICT), str(MICRO_HIERARCHY), "--sim", *sims,
                 "--out", str(out), "--quiet"]) == 0
    return out


def test_the_report_opens_with_a_three_line_summary(hf_eager_report):
    lines = (hf_eager_report / "report.md").read_text().splitlines()
    assert lines[0] == "# thoughtkv report" and lines[1] == "" and lines[5] == ""
    traced, accuracy, projected = lines[2:5]
    assert traced.startswith("- **Traced:** 3 runs of `micro` on chains, 20 samples each; simulated on 4 hardware")
    assert accuracy.startswith("- **Accuracy with its traffic:** full cache 100.0% [83.9–100.0] (n=20); best below it")
    assert "attending" in accuracy and "H2D" in accuracy  # never an accuracy without its traffic
    assert projected.startswith("- **Projected** (hf-eager; Figure 3):") and "ms/token on" in projected


def test_latency_captions_say_why_the_profiles_lines_coincide(hf_eager_report):
    report = (hf_eager_report / "report.md").read_text()
    for figure in ("Figure 3.", "Figure 4."):
        section = next(s for s in report.split("\n## ") if s.startswith(figure))
        assert "The lines of 4 profiles coincide at" in section and "host-bound" in section, section
    assert report.count("priced at `micro`") == 1  # the shapes are named once, at the top


def test_a_dozen_profiles_get_distinct_colours():
    from analysis.figures import _profile_styles
    from hwprofiles import list_profiles

    names = [p.name for p in list_profiles()] + ["measured-here-cpu"]
    styles = _profile_styles(names)
    assert len({s["color"] for s in styles.values()}) == len(names) >= 15


def test_the_frontiers_labels_overlap_no_error_bar():
    from analysis.serving import frontier_figure

    rows = []
    for profile, rates in (("h100-pcie", (34, 34, 64, 61, 64)), ("gh200-96gb", (66, 68, 64, 120, 124))):
        for label, rate, accuracy, low, high in zip(
                ["hier 30%", "hier 50%", "full cache", "evict 30%", "evict 50%"], rates, (0.375, 0.75, 1.0, 0, 0),
                (0.14, 0.41, 0.68, 0, 0), (0.69, 0.93, 1.0, 0.32, 0.32)):
            rows.append({"profile": profile, "label": label, "policy": label.split()[0], "hbm_budget": 0.3,
                         "max_rate_per_s": float(rate), "first_failing_rate_per_s": 2.0 * rate, "accuracy": accuracy,
                         "ci_low": low, "ci_high": high, "attended_frac": 0.5, "h2d_bytes_per_token_served": 6.8e6})
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = frontier_figure(pd.DataFrame(rows))
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    for ax in figure.axes:
        labels = [Text.get_window_extent(text, renderer) for text in ax.texts]  # the text, not its joining line
        bars = [Bbox(ax.transData.transform(np.vstack(collection.get_segments())))  # the bar, end to end
                for container in ax.containers for collection in container.lines[2]]
        assert len(labels) == 5 and len(bars) == 5
        assert not [(t, b) for t in labels for b in bars if t.overlaps(b)]
        assert all(t.x1 <= ax.get_window_extent(renderer).x1 + 1 for t in labels)  # inside the panel
