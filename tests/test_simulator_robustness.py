"""Issue 19's simulator items, each reproduced: sweep caches keyed by the content of their inputs, grids checked
cell by cell before anything runs, serve-sim's numeric options and arrival files, bounded YAML, help texts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwprofiles import PROFILES_DIR
from simulator.sweep import load_grid, run_sweep
from simulator.synth import synth_run
from thoughtkv.cli import main


@pytest.fixture()
def runs(tmp_path):
    """Two small hierarchy runs; run `a` has a third sample whose parts are held back (not yet committed)."""
    a = synth_run(tmp_path / "runs" / "a", model="tiny", prompt_tokens=32, decode_steps=12, policy="hierarchy",
                  hbm_budget=0.3, recall_k=2, recall_rule="score", samples=3)
    b = synth_run(tmp_path / "runs" / "b", model="tiny", prompt_tokens=32, decode_steps=12, policy="hierarchy",
                  hbm_budget=0.5, recall_k=2, recall_rule="score", samples=2)
    held = tmp_path / "held"
    for part in a.glob("*.parquet/part-synth%2F0002.parquet"):
        (held / part.parent.name).mkdir(parents=True, exist_ok=True)
        part.rename(held / part.parent.name / part.name)
    return a, b, held


def own_profile(directory: Path, hbm_efficiency: str = "0.85") -> Path:
    """A copy of h100-pcie under another name, as a user's profile file."""
    directory.mkdir(parents=True, exist_ok=True)
    text = (PROFILES_DIR / "h100-pcie.yaml").read_text().replace("name: h100-pcie", "name: my-gpu", 1)
    path = directory / "my-gpu.yaml"
    path.write_text(text.replace("value: 0.85\n", f"value: {hbm_efficiency}\n", 1))
    return path


def sweep(grid_file: Path, out: Path):
    report = run_sweep(load_grid(grid_file).cells, out, workers=1, progress=False)
    assert report.failed == {}
    return report


def test_sweep_cache_covers_the_content_of_runs_profiles_and_version(tmp_path, runs, monkeypatch):
    a, b, held = runs
    profile = own_profile(tmp_path / "profiles")
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(a), str(b)],
                                         "profiles": ["h100-pcie", str(profile)]}))
    out = tmp_path / "out"
    first = sweep(grid_file, out)
    assert (first.computed, first.cached) == (4, 0)
    again = sweep(grid_file, out)
    assert (again.computed, again.cached) == (0, 4)
    steps_before = first.table.set_index(["run_dir", "profile"])["steps"].sort_index()

    # The run grows by one committed sample: its two cells recompute (with the new sample), b's stay cached.
    for part in held.glob("*/*.parquet"):
        part.rename(a / part.parent.name / part.name)
    grown = sweep(grid_file, out)
    assert (grown.computed, grown.cached) == (2, 2)
    steps_after = grown.table.set_index(["run_dir", "profile"])["steps"].sort_index()
    assert (steps_after.loc[str(a)] == steps_before.loc[str(a)] * 3 // 2).all()
    assert (steps_after.loc[str(b)] == steps_before.loc[str(b)]).all()

    # The profile file changes: the cells on that profile recompute, the others stay cached.
    own_profile(tmp_path / "profiles", hbm_efficiency="0.5")
    edited = sweep(grid_file, out)
    assert (edited.computed, edited.cached) == (2, 2)
    def total_s(report, profile: str) -> pd.Series:
        table = report.table
        return table[table["profile"] == profile].set_index("run_dir")["total_s"].sort_index()

    assert (total_s(edited, "my-gpu") > total_s(grown, "my-gpu")).all()  # less HBM bandwidth: slower
    assert (total_s(edited, "h100-pcie") == total_s(grown, "h100-pcie")).all()

    # Another project version: everything recomputes, then stays cached under it.
    monkeypatch.setattr("thoughtkv_base.__version__", "99.0.0")
    upgraded = sweep(grid_file, out)
    assert (upgraded.computed, upgraded.cached) == (4, 0)
    again = sweep(grid_file, out)
    assert (again.computed, again.cached) == (0, 4)


def test_a_damaged_cached_cell_is_computed_again(tmp_path, runs, capsys):
    a, b, _ = runs
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(a), str(b)], "profiles": ["h100-pcie"]}))
    first = sweep(grid_file, tmp_path / "out")
    damaged = sorted((tmp_path / "out" / "cells").glob("*.parquet"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])  # a crash mid-write of a non-atomic copy, a full disk...
    assert main(["sweep", "--grid", str(grid_file), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "2 simulate cells" in printed and "1 already done" in printed
    again = sweep(grid_file, tmp_path / "out")
    assert (again.computed, again.cached) == (1, 1)
    pd.testing.assert_frame_equal(again.table, first.table)


def test_simulate_refuses_an_unreadable_results_file_in_out_before_any_work(tmp_path, runs, capsys):
    a, _, _ = runs
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.parquet").write_text("not parquet\n")
    assert main(["simulate", str(a), "--profile", "h100-pcie", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "results.parquet is not a readable results table" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["results.parquet"]  # nothing else written
    assert (out / "results.parquet").read_text() == "not parquet\n"


@pytest.mark.parametrize("what_if", [{"budget": [0.3, -1]}, {"budget": [0.3, "abc"]}, {"budget": [0, 0.3]},
                                     {"block": [16, 24]}, {"colour": ["red"]}])
def test_a_grid_with_one_bad_cell_is_refused_before_any_runs(tmp_path, runs, capsys, what_if):
    a, _, _ = runs
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(a)], "profiles": ["h100-pcie"],
                                         "what_if": what_if}))
    assert main(["sweep", "--grid", str(grid_file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "what-if" in err, err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


@pytest.mark.parametrize("change, message", [
    ({"offload_tier": "cxl-expander"}, "no memory tier 'cxl-expander'"),
    ({"overlap": "layer-prefetch", "what_if": {"recall_rule": ["query"]}}, "layer-prefetch"),
])
def test_grid_cells_are_checked_against_their_run_and_profile(tmp_path, runs, capsys, change, message):
    a, _, _ = runs
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(a)], "profiles": ["h100-pcie"], **change}))
    assert main(["sweep", "--grid", str(grid_file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_grid_on_a_run_without_committed_samples_is_refused(tmp_path, capsys):
    from traces import TraceWriter

    run = synth_run(tmp_path / "src", model="tiny", prompt_tokens=16, decode_steps=2, policy="full")
    empty = tmp_path / "empty"
    TraceWriter(empty, json.loads((run / "run.json").read_text()))  # run.json, no sample yet
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "serve", "runs": [str(empty)], "profiles": ["h100-pcie"]}))
    assert main(["sweep", "--grid", str(grid_file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no committed samples" in err and len(err.splitlines()) == 1


def test_a_sweep_where_every_cell_fails_names_no_results_file(tmp_path, runs, capsys):
    a, _, _ = runs
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(yaml.safe_dump({"kind": "simulate", "runs": [str(a)], "profiles": ["h100-pcie"],
                                         "what_if": {"scorer": ["no-such-scorer"]}}))  # fails in its worker
    assert main(["sweep", "--grid", str(grid_file), "--out", str(tmp_path / "out"), "--workers", "1"]) == 1
    printed = capsys.readouterr().out
    assert "failed 1" in printed and "results.parquet" not in printed and "nothing written" in printed
    assert not (tmp_path / "out" / "results.parquet").exists()


# ---------------------------------------------------------------- serve-sim ---------------------------------


@pytest.mark.parametrize("extra, names, not_names", [
    (["--rate", "nan"], ["--rate-per-s"], []),
    (["--rate", "inf"], ["--rate-per-s"], []),
    (["--rate-per-s", "-1"], ["--rate-per-s"], ["--duration", "--max-batch"]),
    (["--duration-s", "0"], ["--duration-s"], ["--rate", "--max-batch"]),
    (["--max-batch", "0"], ["--max-batch"], ["--rate", "--duration"]),
    (["--tbt-slo-s", "-1"], ["--tbt-slo-s"], []),
    (["--tbt-slo-s", "nan"], ["--tbt-slo-s"], []),
    (["--ttft-slo-s", "0"], ["--ttft-slo-s"], []),
    (["--seed", "-3"], ["--seed"], []),
    (["--offload-tier", "nvme-9"], ["no memory tier"], []),
])
def test_serve_sim_bad_numbers_are_one_line_naming_the_option(tmp_path, runs, capsys, extra, names, not_names):
    a, _, _ = runs
    assert main(["serve-sim", str(a), "--profile", "h100-pcie", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(n in err for n in names) and not any(n in err for n in not_names), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text, message", [
    ("arrival_s,prompt_tokens,output_tokens\n", "no requests"),
    ("arrival_s,prompt_tokens,output_tokens\n0.0,32,5\n0.5,abc,5\n", "line 3: prompt tokens 'abc'"),
    ("arrival_s,prompt_tokens,output_tokens\nsoon,32,5\n", "arrival times"),
    ("arrival_s,prompt_tokens,output_tokens\n0.0,32,inf\n", "line 2: output tokens"),
    ("arrival_s,prompt_tokens,output_tokens\n0.0,32,2.5\n", "whole number"),
    ("arrival_s,prompt_tokens,output_tokens\n0.0,32,0\n", "must be >= 1"),
    ("arrival_s,prompt_tokens,output_tokens\nnan,32,3\n", "line 2: arrival time"),
    ("", "empty"),
])
def test_serve_sim_bad_arrival_files_are_one_line(tmp_path, runs, capsys, text, message):
    a, _, _ = runs
    csv = tmp_path / "arrivals.csv"
    csv.write_text(text)
    assert main(["serve-sim", str(a), "--profile", "h100-pcie", "--arrivals-csv", str(csv),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_serve_sim_arrival_file_that_works(tmp_path, runs, capsys):
    a, _, _ = runs
    csv = tmp_path / "arrivals.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,32,5\n0.25,32,13\n")
    assert main(["serve-sim", str(a), "--profile", "h100-pcie", "--arrivals-csv", str(csv), "--rate-per-s", "9",
                 "--out", str(tmp_path / "o")]) == 0
    assert "--rate-per-s unused" in capsys.readouterr().err  # the CSV decides; said, not silently ignored
    summary = pd.read_parquet(tmp_path / "o" / "serving_summary.parquet")
    assert int(summary["n_completed"].iloc[0]) == 2 and int(summary["tokens"].iloc[0]) == 5 + 13


# ---------------------------------------------------------------- bounded YAML -------------------------------


def billion_laughs(levels: int = 9) -> str:
    lines = ["lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bombs_in_profiles_and_grids_are_refused_within_a_second(tmp_path, capsys):
    profile = own_profile(tmp_path / "profiles")
    text = profile.read_text()
    bomb = billion_laughs()
    profile.write_text(bomb + text.replace("description: ", "description: *lol8\nold_description: ", 1))
    grid = tmp_path / "g.yaml"
    grid.write_text(bomb + "kind: simulate\nruns: [x]\nprofiles: *lol8\n")
    for argv in (["profiles", "validate", str(profile)], ["simulate", str(tmp_path), "--profile", str(profile)],
                 ["sweep", "--grid", str(grid), "--out", str(tmp_path / "out")]):
        start = time.perf_counter()
        assert main(argv) == 2
        assert time.perf_counter() - start < 1.0
        err = capsys.readouterr().err.strip()
        assert "alias" in err and len(err.splitlines()) == 1, err


def test_yaml_bounds_refuse_big_and_recursive_files_but_read_benign_anchors(tmp_path):
    from hwprofiles import ProfileError
    from hwprofiles.loader import MAX_YAML_BYTES, read_yaml_file

    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * (MAX_YAML_BYTES + 1) + "\n")
    with pytest.raises(ProfileError, match="too large"):
        read_yaml_file(big)
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [1, *a]\n")
    with pytest.raises(ProfileError, match="recursive alias"):
        read_yaml_file(loop)
    shared = tmp_path / "shared.yaml"
    shared.write_text("base: &b {x: 1, y: [2, 3]}\nfirst: *b\nsecond: [*b, *b]\n")
    assert read_yaml_file(shared) == {"base": {"x": 1, "y": [2, 3]}, "first": {"x": 1, "y": [2, 3]},
                                      "second": [{"x": 1, "y": [2, 3]}] * 2}
    for path in PROFILES_DIR.glob("*.yaml"):  # every shipped profile reads as plain yaml.safe_load does
        assert read_yaml_file(path) == yaml.safe_load(path.read_text())


# ---------------------------------------------------------------- help texts ---------------------------------


@pytest.mark.parametrize("module", ["simulator.cli", "simulator.serving_cli", "simulator.sweep_cli",
                                    "simulator.synth"])
def test_every_simulator_option_has_help_that_points_somewhere(module):
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = (action.help or "").lower()
        assert text.strip(), f"{action.option_strings or action.dest}: no help"
        for pointer in ("--help", "see above", "see below", "see the command"):
            assert pointer not in text, f"{action.option_strings}: help points to {pointer!r}: {action.help}"


# ---------------------------------------------------------------- property tests of the input surfaces -------

CELL_TEXT = st.one_of(st.sampled_from(["", "nan", "inf", "-inf", "-1", "0", "1", "2.5", "1e309", "9" * 30, "abc",
                                       "2023-11-16 18:15:46.68", "\"", ",", " 3 "]),
                      st.integers(-10, 10**6).map(str), st.floats(allow_nan=True).map(repr),
                      st.text(max_size=6))
HEADERS = st.lists(st.sampled_from(["arrival_s", "prompt_tokens", "output_tokens", "TIMESTAMP", "ContextTokens",
                                    "GeneratedTokens", "other"]), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def works(tmp_path_factory):
    from hwprofiles import load_profile
    from simulator.serving import load_run_work

    run = synth_run(tmp_path_factory.mktemp("fz") / "r", model="tiny", prompt_tokens=16, decode_steps=6,
                    policy="full", samples=2)
    return load_run_work(run, load_profile("h100-pcie"))[2]


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=HEADERS, rows=st.lists(st.lists(CELL_TEXT, min_size=1, max_size=5), max_size=5))
def test_any_arrival_csv_gives_arrivals_or_one_serving_error(tmp_path_factory, works, header, rows):
    from simulator.errors import ServingError
    from simulator.lengths import csv_classes, read_arrivals_csv

    path = tmp_path_factory.mktemp("csv") / "a.csv"
    path.write_text("\n".join([",".join(header), *(",".join(r) for r in rows)]) + "\n")
    try:
        requests = read_arrivals_csv(path)
    except ServingError as exc:
        assert "\n" not in str(exc) and "np.float64" not in str(exc)
        return
    assert len(requests) and (requests.arrival_s >= 0).all() and (requests.output_tokens >= 1).all()
    assert (requests.prompt_tokens >= 0).all() and (requests.arrival_s[1:] >= requests.arrival_s[:-1]).all()
    classes, request_class = csv_classes(requests, [(w.prompt_tokens, w.n_steps) for w in works])
    assert [classes[c][1:] for c in request_class] == list(zip(requests.prompt_tokens, requests.output_tokens))


GRID_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
              st.sampled_from(["none", "layer-prefetch", "ddr", "auto", "des", "fast", "h100-pcie", "all", "abc"])),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.sampled_from(
        ["budget", "block", "recall_k", "scorer", "policy", "x"]), children, max_size=2)), max_leaves=6)


@settings(max_examples=120, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["simulate", "serve"]), values=st.dictionaries(st.sampled_from(
    ["overlap", "async_offload", "batch", "engine", "offload_tier", "transfer", "what_if", "rate_per_s",
     "duration_s", "max_batch", "tbt_slo_s", "seed", "batch_copies", "profiles"]), GRID_VALUES, max_size=4))
def test_any_grid_gives_valid_cells_or_one_line(tmp_path_factory, works, kind, values):
    """Random values for a grid's keys: every cell built is one its command accepts, or the grid is refused
    in one line (a UserError) within seconds."""
    from simulator.sweep import grid_from_dict
    from thoughtkv_base import UserError

    run = synth_run(tmp_path_factory.getbasetemp() / "grid-run", model="tiny", prompt_tokens=16, decode_steps=4,
                    policy="hierarchy", hbm_budget=0.5, recall_k=1, recall_rule="score", samples=1)
    data = {"kind": kind, "runs": [str(run)], "profiles": ["h100-pcie"], **values}
    start = time.perf_counter()
    try:
        grid = grid_from_dict(data, base_dir=Path("."), where="g.yaml")
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    finally:
        assert time.perf_counter() - start < 5.0
    assert grid.cells
