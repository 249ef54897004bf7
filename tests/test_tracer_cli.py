"""`thoughtkv trace` end to end: argument errors exit 2 in one line; a real run on a random-weight Qwen2 with
GSM8K from the shared file validates; killing it mid-run and rerunning loses and doubles nothing."""

from __future__ import annotations

import pytest
from _helpers import (
    has_committed_part,
    kill_if_running,
    start_thoughtkv,
    wait_while_running,
)
from conftest import REPO

from thoughtkv.cli import main
from traces import open_run

GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K.is_file(), reason="shared GSM8K file not present")



@pytest.mark.parametrize(
    "flags,message",
    [
        (["--hbm-budget", "1.5"], "--hbm-budget"),
        (["--hbm-budget", "0"], "--hbm-budget"),
        (["--scorer", "lru"], "unknown scorer"),
        (["--policy", "lfu"], "unknown policy"),
        (["--evict-ratio", "1.0", "--policy", "hierarchy"], "--evict-ratio"),
        (["--block-size", "0"], "--block-size"),
        (["--task", "nope"], "unknown task"),
        (["--model", "random:nope"], "unknown architecture"),
        (["--model", "/nonexistent/model"], "no such directory"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(flags, message, tmp_path, capsys):
    args = ["trace", "--model", "random:tiny", "--task", "gsm8k", "--data-file", str(GSM8K), "--out",
            str(tmp_path / "run"), "--max-new-tokens", "2", "--quiet", *flags]
    if not GSM8K.is_file() and "--task" not in flags:
        pytest.skip("shared GSM8K file not present")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing written for a refused run


@needs_gsm8k
def test_trace_kill_and_resume(tmp_path):
    out = tmp_path / "run"
    args = ["trace", "--model", "random:tiny", "--task", "gsm8k",
               "--data-file", str(GSM8K), "--n-samples", "3", "--policy", "hierarchy", "--hbm-budget", "0.5",
               "--evict-ratio", "0.1", "--block-size", "8", "--recall-k", "2", "--max-new-tokens", "12",
               "--out", str(out), "--quiet"]
    process = start_thoughtkv(args, REPO)
    parts = out / "samples.parquet"
    wait_while_running(process, lambda: has_committed_part(parts), timeout_s=240)
    killed = kill_if_running(process)
    before = {p.name: p.read_bytes() for p in parts.iterdir() if p.suffix == ".parquet"}
    assert before, process.stderr.read().decode()[-2000:]
    assert killed and len(before) < 3  # it really died mid-run

    assert main(args) == 0  # the same command, in-process: resumes
    run = open_run(out)
    run.validate()
    samples = run.samples()
    assert sorted(samples.sample_id) == [f"gsm8k/test/{i}" for i in range(3)]
    for name, data in before.items():  # committed samples were skipped, not rewritten
        assert (parts / name).read_bytes() == data
    steps = run.steps()
    assert not steps.duplicated(["sample_id", "step", "layer"]).any()
    assert (steps.groupby("sample_id").step.max() + 1).to_dict() == dict(zip(samples.sample_id, samples.generated_tokens))
    assert samples.correct.isna().all() and run.manifest["model"]["random_weights"] is True
    assert steps.bytes_d2h.sum() > 0 and steps.bytes_h2d.sum() > 0
    block_bytes = run.manifest["model"]["kv_bytes_per_token"] // run.manifest["model"]["n_layers"] * 8
    recalled_blocks = steps.recalled_block_ids.map(len).sum()
    assert steps.bytes_h2d.sum() == recalled_blocks * block_bytes
    tokens = run.tokens()
    assert len(tokens) == int((samples.prompt_tokens + samples.generated_tokens).sum())
