"""`thoughtkv traces info|validate`: output on a good run, exit 2 and one line on a bad one."""

from __future__ import annotations

import pytest

from thoughtkv.cli import main
from traces import TraceWriter
from traces.example import example_manifest, example_sample
from traces.layout import part_path

IDS = ["a", "b", "c"]


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    with TraceWriter(path, example_manifest(sample_ids=IDS)) as writer:
        for i, (sid, correct) in enumerate(zip(IDS, [True, False, None])):
            parts = example_sample(sid, prompt_tokens=30, generated_tokens=10, n_layers=6, seed=i)
            parts["sample"] |= {"correct": correct, "gold": "42", "predicted": "42" if correct else "7"}
            parts["steps"]["bytes_h2d"] = parts["steps"]["bytes_h2d"] + 1000  # 10 steps x 6 layers -> 60,000 per sample
            writer.write_sample(**parts)
    return path


def test_info_summarises_run(run_dir, capsys):
    assert main(["traces", "info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "samples     3 committed" in out
    assert "accuracy    1/2 = 50.0%" in out  # the unscored sample is not counted
    assert "H2D=180,000 bytes" in out
    assert "180 (step, layer) rows" in out
    assert "kv_bytes_per_token=" in out and "max relative error 4.4%" in out


def test_validate_ok_and_damaged(run_dir, capsys):
    assert main(["traces", "validate", str(run_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {run_dir}: 3 committed samples")
    path = part_path(run_dir, "access", "b")
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    assert main(["traces", "validate", str(run_dir)]) == 2
    err = capsys.readouterr().err  # the progress bar also writes to stderr
    errors = [line for line in err.splitlines() if line.startswith("thoughtkv traces: error: ")]
    assert len(errors) == 1 and "access.parquet" in errors[0] and "unreadable Parquet" in errors[0]
    assert "Traceback" not in err


def test_missing_run_exits_2(tmp_path, capsys):
    assert main(["traces", "info", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_traces_package_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, traces, traces.cli, traces.example, traces.reader, traces.writer\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch was imported'\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
