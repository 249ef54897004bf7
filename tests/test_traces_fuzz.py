"""Random bytes and truncations thrown at a trace run: the reader either reads it or raises TraceFormatError,
never any other exception."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces import TraceFormatError, TraceWriter, open_run
from traces.example import example_manifest, example_sample

IDS = ["s/0", "s/1"]


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fuzz") / "run"
    with TraceWriter(run_dir, example_manifest(sample_ids=IDS)) as writer:
        for i, sid in enumerate(IDS):
            writer.write_sample(**example_sample(sid, prompt_tokens=20, generated_tokens=6, n_layers=6, seed=i,
                                                 movements=True))
    return run_dir


def read_everything(run_dir: Path) -> None:
    run = open_run(run_dir)
    run.validate()
    run.samples(), run.steps(), run.tokens(), run.access()


damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0, exclude_max=True), st.just(b"")),
    st.tuples(st.just("overwrite"), st.floats(0.0, 1.0, exclude_max=True), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("replace"), st.just(0.0), st.binary(max_size=512)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file_index=st.integers(0, 20), damages=st.lists(damage, min_size=1, max_size=3))
def test_damaged_bytes_only_ever_raise_trace_format_error(pristine_run, file_index, damages):
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        shutil.copytree(pristine_run, run_dir)
        files = sorted(p for p in run_dir.rglob("*") if p.is_file())
        target = files[file_index % len(files)]
        data = target.read_bytes()
        for kind, where, payload in damages:
            cut = int(where * len(data))
            if kind == "truncate":
                data = data[:cut]
            elif kind == "overwrite":
                data = data[:cut] + payload + data[cut + len(payload):]
            else:
                data = payload
        target.write_bytes(data)
        try:
            read_everything(run_dir)
        except TraceFormatError as exc:
            assert "\n" not in str(exc)


def test_pristine_run_reads(pristine_run):
    read_everything(pristine_run)  # the fuzz test above starts from a run that is valid
