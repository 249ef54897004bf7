"""Trace format v1: write/read round trip, crash + resume, and rejection of damaged or mismatched runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from traces import (
    SCHEMA_VERSION,
    TraceFormatError,
    TraceWriter,
    decode_block_mass,
    encode_block_mass,
    make_manifest,
    open_run,
)
from traces.example import example_manifest, example_sample
from traces.layout import list_parts, part_path
from traces.schema import TABLE_SCHEMAS

IDS = ["gsm8k/test/0001", "gsm8k/test/0002", "odd id %/.."]
N_LAYERS = 6  # the "tiny" architecture


def sample(sample_id: str, seed: int = 0, **kw) -> dict:
    kw = {"prompt_tokens": 37, "generated_tokens": 21, "n_layers": N_LAYERS, "seed": seed, "movements": True} | kw
    return example_sample(sample_id, **kw)


def write_run(path: Path, ids=IDS, **manifest_kw) -> dict[str, dict]:
    written = {sid: sample(sid, seed=i) for i, sid in enumerate(ids)}
    with TraceWriter(path, example_manifest(sample_ids=list(ids), **manifest_kw)) as writer:
        for parts in written.values():
            writer.write_sample(**parts)
    return written


def assert_frame_matches_columns(frame: pd.DataFrame, columns: dict, sample_id: str) -> None:
    """Every column given to the writer comes back with the same values (lists compared element-wise)."""
    for name, values in columns.items():
        got = frame[name].tolist()
        want = list(values)
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            if isinstance(w, list | np.ndarray):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
            elif w is None or (isinstance(w, float) and np.isnan(w)):
                assert g is None or pd.isna(g), name
            else:
                assert g == pytest.approx(w), name
    assert (frame["sample_id"] == sample_id).all()


def test_round_trip_every_table(tmp_path):
    written = write_run(tmp_path / "run")
    run = open_run(tmp_path / "run")
    assert run.manifest["schema"] == SCHEMA_VERSION
    assert run.sample_ids() == IDS  # sample_index order = order in task.sample_ids
    run.validate()
    samples = run.samples().set_index("sample_id")
    for index, (sid, parts) in enumerate(written.items()):
        assert samples.loc[sid, "sample_index"] == index
        assert samples.loc[sid, "prompt_tokens"] == parts["sample"]["prompt_tokens"]
        assert pd.isna(samples.loc[sid, "correct"])
        assert_frame_matches_columns(run.steps(sid), parts["steps"], sid)
        assert_frame_matches_columns(run.tokens(sid), parts["tokens"], sid)
        access = run.access(sid)
        assert_frame_matches_columns(access, {k: parts["access"][k] for k in ("step", "layer")}, sid)
        # block_mass comes back as the decoded form of exactly what was written
        for got, want in zip(access["block_mass"], parts["access"]["block_mass"]):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, decode_block_mass(encode_block_mass(want)))
    steps = run.steps()
    assert len(steps) == sum(len(p["steps"]["step"]) for p in written.values())
    # nullable columns not given are stored as null; columns= selects
    assert steps["mass_evicted"].isna().all()
    assert list(run.steps(columns=["step", "bytes_h2d"]).columns) == ["step", "bytes_h2d"]


def test_files_open_without_project_code(tmp_path):
    written = write_run(tmp_path / "run")
    n_steps_rows = sum(len(p["steps"]["step"]) for p in written.values())
    assert len(pd.read_parquet(tmp_path / "run" / "steps.parquet")) == n_steps_rows
    assert sorted(pd.read_parquet(tmp_path / "run" / "samples.parquet")["sample_id"]) == sorted(IDS)
    con = duckdb.connect()
    [(count,)] = con.sql(f"SELECT count(*) FROM read_parquet('{tmp_path}/run/steps.parquet/*.parquet')").fetchall()
    assert count == n_steps_rows
    per_sample = con.sql(f"""
        SELECT s.sample_id, count(*) AS rows, sum(bytes_h2d) AS bytes_h2d
        FROM read_parquet('{tmp_path}/run/steps.parquet/*.parquet') st
        JOIN read_parquet('{tmp_path}/run/samples.parquet/*.parquet') s USING (sample_id)
        GROUP BY s.sample_id ORDER BY s.sample_id""").fetchall()
    assert per_sample == [(sid, len(written[sid]["steps"]["step"]), 0) for sid in sorted(IDS)]
    # The decode SQL given in traces/README.md reproduces decode_block_mass.
    sql = f"""
        SELECT sample_id, step, layer,
               list_transform(block_mass_q,
                              lambda c: CASE WHEN c = 0 THEN 0.0 ELSE pow(2, -16 + (c - 1) / 8) END) AS block_mass
        FROM read_parquet('{tmp_path}/run/access.parquet/*.parquet')
        WHERE sample_id = '{IDS[1]}' ORDER BY step, layer"""
    rows = con.sql(sql).fetchall()
    reference = open_run(tmp_path / "run").access(IDS[1])
    assert len(rows) == len(reference)
    for (_, _, _, masses), want in zip(rows, reference["block_mass"]):
        np.testing.assert_allclose(masses, want, rtol=1e-6)


def test_access_disabled_run(tmp_path):
    parts = sample("s")
    with TraceWriter(tmp_path / "run", example_manifest(access=False)) as writer:
        with pytest.raises(TraceFormatError, match="access disabled"):
            writer.write_sample(**parts)
        writer.write_sample(parts["sample"], parts["steps"], parts["tokens"])
    run = open_run(tmp_path / "run")
    run.validate()
    assert not run.has_access and not (tmp_path / "run" / "access.parquet").exists()
    with pytest.raises(TraceFormatError, match="without access"):
        run.access()


def test_dataframe_input_equals_dict_input(tmp_path):
    parts = sample("s")
    with TraceWriter(tmp_path / "a", example_manifest()) as writer:
        writer.write_sample(**parts)
    frames = {k: pd.DataFrame(v) for k, v in parts.items() if k != "sample"}
    with TraceWriter(tmp_path / "b", example_manifest()) as writer:
        writer.write_sample(parts["sample"], **frames)
    a, b = open_run(tmp_path / "a"), open_run(tmp_path / "b")
    pd.testing.assert_frame_equal(a.steps(), b.steps())
    pd.testing.assert_frame_equal(a.tokens(), b.tokens())


# -- crash and resume ------------------------------------------------------------------------------------------

CRASHING_WRITER = textwrap.dedent(
    """
    import os, sys
    from traces import TraceWriter
    from traces.example import example_manifest, example_sample
    run_dir, crash_before, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
    original = TraceWriter._write_part
    def write_part(self, table, sample_id, data):
        if sample_id == ids[-1] and table == crash_before:
            if table == "tokens":  # die in the middle of a file: a temp file is left behind
                (self.path / "tokens.parquet" / ".part-x.parquet.tmp-1").write_bytes(b"PAR1 half")
            os._exit(9)
        original(self, table, sample_id, data)
    TraceWriter._write_part = write_part
    writer = TraceWriter(run_dir, example_manifest(sample_ids=ids))
    for i, sid in enumerate(ids):
        if sid not in writer.done_sample_ids():
            writer.write_sample(**example_sample(sid, prompt_tokens=37, generated_tokens=21, n_layers=6, seed=i,
                                                 movements=True))
    """
)


@pytest.mark.parametrize("crash_before", ["samples", "tokens"])
def test_crash_leaves_no_half_sample_and_resume_completes(tmp_path, crash_before):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(run_dir), crash_before, *IDS])
    assert proc.returncode == 9  # the writer really died mid-sample
    run = open_run(run_dir)
    assert run.sample_ids() == IDS[:2]  # the half-written third sample is invisible ...
    run.validate()
    assert part_path(run_dir, "steps", IDS[2]).exists()  # ... although some of its parts are on disk
    first_two = run.steps()

    writer = TraceWriter(run_dir, example_manifest(sample_ids=IDS))
    assert writer.done_sample_ids() == set(IDS[:2])
    assert not part_path(run_dir, "steps", IDS[2]).exists()  # orphans and temp files are cleaned on resume
    assert not any(p.name.startswith(".") for p in (run_dir / "tokens.parquet").iterdir())
    writer.write_sample(**sample(IDS[2], seed=2))

    run = open_run(run_dir)
    run.validate()
    assert run.sample_ids() == IDS
    steps = run.steps()
    assert steps.groupby("sample_id").size().to_dict() == {sid: 21 * N_LAYERS for sid in IDS}  # none doubled
    pd.testing.assert_frame_equal(steps[steps.sample_id.isin(IDS[:2])].reset_index(drop=True), first_two)


def test_resume_refuses_duplicate_and_mismatched_runs(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, ids=IDS[:1])
    with pytest.raises(TraceFormatError, match="already in"):
        TraceWriter(run_dir, example_manifest(sample_ids=IDS[:1])).write_sample(**sample(IDS[0]))
    with pytest.raises(TraceFormatError, match=r"policy\.hbm_budget is 1\.0 in the existing run but 0\.5 now.*new --out"):
        manifest = example_manifest()
        manifest["policy"]["hbm_budget"] = 0.5
        TraceWriter(run_dir, manifest)
    with pytest.raises(TraceFormatError, match=r"model\.id is .* in the existing run but 'deepseek-ai/DeepSeek-R1-Distill-Qwen-7B' now"):
        TraceWriter(run_dir, example_manifest(architecture="qwen2-7b"))
    with pytest.raises(TraceFormatError, match="already exists"):
        TraceWriter(run_dir, example_manifest(), resume=False)
    # A rerun with more samples appends them to task.sample_ids and keeps the first run's record.
    created = json.loads((run_dir / "run.json").read_text())["created"]
    TraceWriter(run_dir, example_manifest(sample_ids=IDS))
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["task"]["sample_ids"] == IDS and manifest["created"] == created


def test_writer_refuses_foreign_directory_and_bad_rows(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(TraceFormatError, match="non-empty directory that is not a trace run"):
        TraceWriter(tmp_path / "notes", example_manifest())
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"
    writer = TraceWriter(tmp_path / "run", example_manifest())
    parts = sample("s")
    bad_cases = [
        ({"steps": {k: v for k, v in parts["steps"].items() if k != "bytes_h2d"}}, "missing required column 'bytes_h2d'"),
        ({"steps": parts["steps"] | {"bytes_hd2": parts["steps"]["bytes_h2d"]}}, "unknown column"),
        ({"steps": parts["steps"] | {"step": ["zero"] * len(parts["steps"]["step"])}}, "column 'step' cannot be stored as int32"),
        ({"tokens": parts["tokens"] | {"sample_id": ["other"] * len(parts["tokens"]["position"])}}, "sample_id 'other'"),
        ({"access": None}, "no access rows"),
    ]
    for change, message in bad_cases:
        with pytest.raises(TraceFormatError, match=message):
            writer.write_sample(**(parts | change))
    assert writer.done_sample_ids() == set()
    assert list_parts(tmp_path / "run", "samples") == {}


# -- rejection of damaged runs -------------------------------------------------------------------------------


def _rewrite_part(run_dir: Path, table: str, sample_id: str, change) -> None:
    path = part_path(run_dir, table, sample_id)
    pq.write_table(change(pq.read_table(path)), path)


def _damage_steps_rows(run_dir: Path) -> None:
    _rewrite_part(run_dir, "steps", IDS[0], lambda t: t.slice(0, t.num_rows - 1))


def _negative_bytes(run_dir: Path) -> None:
    def change(t: pa.Table) -> pa.Table:
        column = pa.array(np.full(t.num_rows, -1, dtype=np.int64))
        return t.set_column(t.schema.get_field_index("bytes_d2h"), "bytes_d2h", column)

    _rewrite_part(run_dir, "steps", IDS[0], change)


def _block_id_out_of_range(run_dir: Path) -> None:
    def change(t: pa.Table) -> pa.Table:
        ids = pa.array([[10_000]] * t.num_rows, type=pa.list_(pa.int32()))
        return t.set_column(t.schema.get_field_index("evicted_block_ids"), "evicted_block_ids", ids)

    _rewrite_part(run_dir, "steps", IDS[0], change)


def _short_access_row(run_dir: Path) -> None:
    def change(t: pa.Table) -> pa.Table:
        rows = t.column("block_mass_q").to_pylist()
        rows[5] = rows[5][:-1]
        return t.set_column(3, "block_mass_q", pa.array(rows, type=pa.list_(pa.uint8())))

    _rewrite_part(run_dir, "access", IDS[0], change)


DAMAGE = {
    # name: (damage(run_dir), where the error must point, what it must say)
    "truncated part": (
        lambda d: part_path(d, "steps", IDS[0]).write_bytes(part_path(d, "steps", IDS[0]).read_bytes()[:-100]),
        "steps.parquet", "unreadable Parquet",
    ),
    "garbage run.json": (lambda d: (d / "run.json").write_text("{not json"), "run.json", "not valid JSON"),
    "wrong schema version": (
        lambda d: (d / "run.json").write_text(
            json.dumps(json.loads((d / "run.json").read_text()) | {"schema": "thoughtkv.trace/2"})
        ),
        "run.json", r"schema is 'thoughtkv.trace/2' but this thoughtkv reads 'thoughtkv.trace/1'",
    ),
    "missing manifest key": (
        lambda d: (d / "run.json").write_text(
            json.dumps({k: v for k, v in json.loads((d / "run.json").read_text()).items() if k != "policy"})
        ),
        "run.json", "missing required key 'policy'",
    ),
    "missing column": (
        lambda d: _rewrite_part(d, "steps", IDS[0], lambda t: t.drop_columns(["bytes_h2d"])),
        "steps.parquet", "missing column 'bytes_h2d'",
    ),
    "wrong dtype": (
        lambda d: _rewrite_part(d, "tokens", IDS[0], lambda t: t.set_column(
            t.schema.get_field_index("token_id"), "token_id", t.column("token_id").cast(pa.float64()))),
        "tokens.parquet", "column 'token_id' has type double, expected int32",
    ),
    "missing part": (lambda d: part_path(d, "tokens", IDS[1]).unlink(), "tokens.parquet", "has no tokens part"),
    "missing steps row": (_damage_steps_rows, "steps.parquet", "must cover steps 0..20 x layers 0..5"),
    "negative bytes": (_negative_bytes, "steps.parquet", "'bytes_d2h' has negative values"),
    "block id out of range": (_block_id_out_of_range, "steps.parquet", "'evicted_block_ids' has block ids outside"),
    "short access row": (_short_access_row, "access.parquet", r"ceil\(logical_len / block_size\)"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_run_is_rejected_with_file_and_problem(tmp_path, name):
    run_dir = tmp_path / "run"
    write_run(run_dir, ids=IDS[:2])
    damage, where, message = DAMAGE[name]
    damage(run_dir)
    with pytest.raises(TraceFormatError, match=message) as info:
        open_run(run_dir).validate()
    text = str(info.value)
    assert where in text and "\n" not in text


def test_missing_run_and_schemas_cover_every_table(tmp_path):
    with pytest.raises(TraceFormatError, match="no such run directory"):
        open_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="run.json: missing"):
        open_run(tmp_path / "empty")
    write_run(tmp_path / "run", ids=IDS[:1])
    for table, schema in TABLE_SCHEMAS.items():
        assert pq.read_schema(part_path(tmp_path / "run", table, IDS[0])).names == schema.names


def test_make_manifest_fills_and_checks(tmp_path):
    manifest = example_manifest(architecture="qwen2-7b", sample_ids=["x"])
    assert manifest["schema"] == SCHEMA_VERSION and manifest["created"].endswith("+00:00")
    assert manifest["model"]["kv_bytes_per_token"] == 57_344  # DeepSeek-R1-Distill-Qwen-7B, bf16
    assert manifest["access"] == {"enabled": True, "encoding": "log2-u8", "floor_log2": -16, "levels_per_octave": 8}
    parts = {k: manifest[k] for k in ("model", "task", "policy", "hardware")}
    with pytest.raises(TraceFormatError, match="missing required key policy.recall_rule"):
        make_manifest(kind="traced", seed=0, **parts | {"policy": {k: v for k, v in parts["policy"].items() if k != "recall_rule"}})
    with pytest.raises(TraceFormatError, match="policy.block_size must be a positive integer"):
        make_manifest(kind="traced", seed=0, **parts | {"policy": parts["policy"] | {"block_size": 0}})
    with pytest.raises(TraceFormatError, match="cannot be stored in run.json"):
        make_manifest(kind="traced", seed=0, **parts | {"task": parts["task"] | {"source": object()}})
    with pytest.raises(TraceFormatError, match="kind 'real'"):
        make_manifest(kind="real", seed=0, **parts)
