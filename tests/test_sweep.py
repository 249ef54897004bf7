"""Sweeps: grid files, the cell cache, and the same grid on a process pool and on a real local Ray."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from simulator.sweep import (
    CollectCell,
    SweepError,
    cell_key,
    cell_result_path,
    grid_from_dict,
    load_grid,
    run_sweep,
)
from thoughtkv.cli import main
from thoughtkv_base import UserError

PROFILES = ["h100-pcie", "h200-sxm", "a100-80gb-pcie", "gh200-96gb", "l40s"]


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module (starting one takes seconds); the Ray executor joins it."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory) -> Path:
    from simulator.synth import synth_run as synth

    return synth(tmp_path_factory.mktemp("runs") / "hier", model="tiny", prompt_tokens=64, decode_steps=40,
                 policy="hierarchy", hbm_budget=0.3, recall_k=2, recall_rule="score", samples=2)


def write_grid(path: Path, grid: dict) -> Path:
    path.write_text(yaml.safe_dump(grid))
    return path


def fifty_cell_grid(run: Path) -> dict:
    """5 profiles x 5 what-if budgets x 2 overlap modes = 50 simulation cells."""
    return {"kind": "simulate", "runs": [str(run)], "profiles": PROFILES, "overlap": ["none", "layer-prefetch"],
            "what_if": {"budget": [0.1, 0.2, 0.3, 0.5, 1.0]}}


# ---------------------------------------------------------------- grid files ---------------------------------


def test_grid_is_the_cross_product_with_stable_distinct_keys(tmp_path, synth_run):
    grid = load_grid(write_grid(tmp_path / "g.yaml", fifty_cell_grid(synth_run)))
    assert len(grid.cells) == 50
    keys = [cell_key(c) for c in grid.cells]
    assert len(set(keys)) == 50
    assert keys == [cell_key(c) for c in load_grid(tmp_path / "g.yaml").cells]  # same file, same keys
    assert {(c.profile, c.options.overlap, dict(c.what_if)["budget"]) for c in grid.cells} == {
        (p, o, b) for p in PROFILES for o in ("none", "layer-prefetch") for b in (0.1, 0.2, 0.3, 0.5, 1.0)}
    # Where a cell runs is not what it computes: GPUs and output root stay out of the key.
    cell = CollectCell(trace_args=(("model", "x"),), out_root="/a")
    assert cell_key(cell) == cell_key(CollectCell(trace_args=(("model", "x"),), out_root="/b", num_gpus=1.0))


@pytest.mark.parametrize("change,message", [
    ({"profile": ["h100-pcie"]}, "unknown key 'profile'"),
    ({"overlap": []}, "axis 'overlap' is empty"),
    ({"what_if": {"budget": []}}, "axis 'what_if.budget' is empty"),
    ({"kind": "train"}, "kind 'train' is unknown"),
    ({"profiles": ["h100-pcie", "no-such-gpu"]}, "no-such-gpu"),
    ({"runs": ["does/not/exist"]}, "is not a trace run"),
    ({"batch": [0]}, "batch must be a positive integer"),
    ({"overlap": "sideways"}, "overlap 'sideways' is unknown"),
])
def test_bad_grids_are_refused_in_one_line(tmp_path, synth_run, change, message):
    grid = {**fifty_cell_grid(synth_run), **change}
    expected = UserError if "no-such-gpu" in message else SweepError  # an unknown profile: hwprofiles' error
    with pytest.raises(expected, match=message) as info:
        grid_from_dict(grid, base_dir=tmp_path, where="g.yaml")
    assert "\n" not in str(info.value)


def test_cli_reports_a_bad_grid_with_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("kind: simulate\nruns: [x]\nprofiles: [h100-pcie]\nbudgets: [0.1]\n")
    assert main(["sweep", "--grid", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown key 'budgets'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- executors ----------------------------------


def test_fifty_cells_local_and_ray_give_identical_tables(tmp_path, synth_run, ray_local):
    """The same 50-cell grid on a 2-process pool and on Ray: identical merged tables, and each row is what a
    direct simulate_run call gives for that cell."""
    from simulator import simulate_run

    cells = load_grid(write_grid(tmp_path / "g.yaml", fifty_cell_grid(synth_run))).cells
    local = run_sweep(cells, tmp_path / "local", executor="local", workers=2, progress=False)
    on_ray = run_sweep(cells, tmp_path / "ray", executor="ray", workers=2, progress=False)
    assert local.failed == {} and on_ray.failed == {}
    assert local.computed == on_ray.computed == 50 and len(local.table) == 50
    pd.testing.assert_frame_equal(local.table, on_ray.table)
    assert (tmp_path / "ray" / "results.parquet").is_file() and (tmp_path / "local" / "results.csv").is_file()
    by_key = local.table.set_index("cell_key")
    for cell in cells[::17]:
        direct = simulate_run(cell.run_dir, cell.profile, cell.options, what_if=dict(cell.what_if)).summary
        row = by_key.loc[cell_key(cell)]
        assert (row["profile"], row["overlap"], row["hbm_budget"]) == (cell.profile, cell.options.overlap,
                                                                       dict(cell.what_if)["budget"])
        assert row["total_s"] == direct["total_s"] and row["bytes_h2d"] == direct["bytes_h2d"]


def test_rerun_recomputes_nothing_and_resumes_only_missing_cells(tmp_path, synth_run):
    grid = fifty_cell_grid(synth_run) | {"profiles": PROFILES[:2], "overlap": "none"}
    cells = load_grid(write_grid(tmp_path / "g.yaml", grid)).cells
    first = run_sweep(cells, tmp_path / "out", workers=1, progress=False)
    assert first.computed == 10
    again = run_sweep(cells, tmp_path / "out", workers=1, progress=False)
    assert (again.computed, again.cached) == (0, 10)
    for cell in cells[3:5]:  # an interrupted sweep: two cells never finished
        cell_result_path(tmp_path / "out", cell).unlink()
    resumed = run_sweep(cells, tmp_path / "out", workers=1, progress=False)
    assert (resumed.computed, resumed.cached) == (2, 8)
    pd.testing.assert_frame_equal(resumed.table, first.table)


def test_a_failing_cell_is_reported_and_the_others_are_kept(tmp_path, synth_run, capsys):
    grid = {"kind": "simulate", "runs": [str(synth_run)], "profiles": ["h100-pcie"],
            "what_if": {"scorer": ["h2o", "no-such-scorer"]}}  # the second fails in its worker
    path = write_grid(tmp_path / "g.yaml", grid)
    assert main(["sweep", "--grid", str(path), "--out", str(tmp_path / "out"), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert "computed 1, cached 0, failed 1" in out and "no-such-scorer" in out
    assert len(pd.read_parquet(tmp_path / "out" / "results.parquet")) == 1


def test_serving_cells_run_in_a_sweep(tmp_path, synth_run):
    grid = {"kind": "serve", "runs": [str(synth_run)], "profiles": ["h100-pcie"], "rate_per_s": [50.0, 200.0],
            "duration_s": 0.5, "max_batch": 16}
    report = run_sweep(load_grid(write_grid(tmp_path / "g.yaml", grid)).cells, tmp_path / "out", workers=1,
                       progress=False)
    table = report.table.sort_values("rate_per_s")
    assert list(table["rate_per_s"]) == [50.0, 200.0] and (table["n_completed"] == table["n_requests"]).all()
    assert table["n_requests"].iloc[1] > table["n_requests"].iloc[0]


def test_collection_cells_run_thoughtkv_trace_on_ray(tmp_path, ray_local):
    """A real collection (random tiny model) as a Ray task through `thoughtkv trace`; the cell's
    run lands under OUT/runs/<key> and the table has one row per cell."""
    grid = {"kind": "collect", "gpus_per_task": 0,
            "trace_args": {"model": "random:tiny", "task": "chains", "n-samples": 1, "max-new-tokens": 4,
                           "device": "cpu", "quiet": True, "policy": "hierarchy", "hbm-budget": [0.5]}}
    path = write_grid(tmp_path / "collect.yaml", grid)
    cells = load_grid(path, out_dir=tmp_path / "out").cells
    assert "--hbm-budget" in cells[0].command() and "--quiet" in cells[0].command()
    report = run_sweep(cells, tmp_path / "out", executor="ray", progress=False)
    assert report.failed == {}, report.failed
    table = report.table
    assert list(table["trace_hbm-budget"]) == [0.5] and (table["returncode"] == 0).all()
    for run_dir in table["run_dir"]:
        assert (Path(run_dir) / "run.json").is_file() and Path(run_dir).parent == tmp_path / "out" / "runs"


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "sweeps"


def _axis_lengths(value) -> int:
    if isinstance(value, dict):
        n = 1
        for sub in value.values():
            n *= _axis_lengths(sub)
        return n
    return len(value) if isinstance(value, list) else 1


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_grids_are_valid(tmp_path, name):
    """Each shipped grid parses, and has as many cells as the product of its axes (runs synthesised small at
    the relative paths the file names)."""
    from simulator.synth import synth_run as synth

    grid_file = tmp_path / "examples" / "sweeps" / name
    grid_file.parent.mkdir(parents=True)
    grid_file.write_text((EXAMPLES / name).read_text())
    data = yaml.safe_load(grid_file.read_text())
    for run in data.get("runs", []):
        synth(grid_file.parent / run, model="tiny", prompt_tokens=16, decode_steps=2, policy="full")
    grid = load_grid(grid_file, out_dir=tmp_path / "out")
    expected = 1
    for key, value in data.items():
        if key != "profiles" or value != "all":
            expected *= _axis_lengths(value)
    assert len(grid.cells) == expected


def test_a_failed_collection_is_reported_and_retried_on_rerun(tmp_path):
    cell = CollectCell(trace_args=(("model", "random:tiny"), ("no-such-flag", 1)), out_root=str(tmp_path / "out"))
    for _ in range(2):  # not cached: the second run tries again
        report = run_sweep([cell], tmp_path / "out", workers=1, progress=False)
        assert report.computed == 0 and "exited with 2" in report.failed[cell_key(cell)]
        assert not cell_result_path(tmp_path / "out", cell).exists()


def test_a_per_sample_cell_gives_simulates_samples_table_through_the_pool(synth_run):
    """The demo's replays run as sweep cells (per_sample=True): the pool returns simulate_run's own samples."""
    import io

    from simulator import SimOptions, simulate_run
    from simulator.sweep.cells import SimulateCell
    from simulator.sweep.executors import execute_local

    what_if = (("budget", 0.5),)
    cells = [SimulateCell(str(synth_run), "h100-pcie", SimOptions(), per_sample=True),
             SimulateCell(str(synth_run), "h100-pcie", SimOptions(), what_if=what_if, per_sample=True)]
    got = {cell: pd.read_parquet(io.BytesIO(table)).drop(columns="cell_key") for cell, table in execute_local(cells, 2)}
    for cell in cells:
        expected = simulate_run(synth_run, "h100-pcie", SimOptions(), what_if=dict(cell.what_if) or None).samples
        assert len(got[cell]) == 2
        pd.testing.assert_frame_equal(got[cell].reset_index(drop=True), expected.reset_index(drop=True))
    assert cell_key(cells[0]) != cell_key(SimulateCell(str(synth_run), "h100-pcie", SimOptions()))
