"""`thoughtkv traces regrade`: re-scoring stored texts, atomically, keeping the old columns in run.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _helpers import (
    kill_if_running,
    start_thoughtkv,
    wait_while_running,
)
from conftest import REPO

from thoughtkv.cli import main
from tracer.regrade import HIDDEN_PREFIX, regrade_run
from traces import TraceWriter, open_run
from traces.example import example_manifest, example_sample

SAMPLES = sorted(p for p in (REPO / "traces" / "samples").iterdir() if (p / "run.json").is_file())
CORPUS = [json.loads(line) for line in (REPO / "tests" / "data" / "grading_corpus.jsonl").read_text().splitlines()]
GSM8K_CASES = [c for c in CORPUS if c["style"] == "gsm8k"]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("sample_run", SAMPLES, ids=[p.name for p in SAMPLES])
def test_regrade_of_the_shipped_chains_runs_changes_nothing(sample_run, tmp_path, capsys):
    run_dir = tmp_path / sample_run.name
    shutil.copytree(sample_run, run_dir)
    assert open_run(run_dir).manifest["task"]["name"] == "chains"
    assert main(["traces", "regrade", str(run_dir)]) == 0
    assert "no change, nothing written" in capsys.readouterr().out
    assert _files(run_dir) == _files(sample_run)  # byte for byte, run.json included


def _old_gsm8k_run(run_dir: Path, cases: list[dict], access: bool = True) -> list[dict]:
    """A finished gsm8k run whose samples were scored by an older grader (recorded columns of our choosing:
    predicted "old-i", and the opposite of the right verdict for every third sample)."""
    ids = [f"gsm8k/test/{i}" for i in range(len(cases))]
    manifest = example_manifest(sample_ids=ids, kind="traced", access=access)
    manifest["task"]["name"] = "gsm8k"
    manifest["model"]["random_weights"] = False
    old = []
    with TraceWriter(run_dir, manifest) as writer:
        for i, (sample_id, case) in enumerate(zip(ids, cases)):
            parts = example_sample(sample_id, prompt_tokens=6, generated_tokens=3, block_size=16, seed=i,
                                   n_layers=manifest["model"]["n_layers"])
            row = {**parts["sample"], "gold": case["gold"], "generated_text": case["text"],
                   "predicted": f"old-{i}", "correct": (not case["correct"]) if i % 3 == 0 else case["correct"]}
            old.append({"predicted": row["predicted"], "correct": row["correct"]})
            writer.write_sample(row, parts["steps"], parts["tokens"], parts["access"] if access else None)
    return old


def test_regrade_rescores_with_the_current_grader_and_keeps_the_old_columns(tmp_path):
    run_dir = tmp_path / "run"
    old = _old_gsm8k_run(run_dir, GSM8K_CASES)
    before = _files(run_dir)
    summary = regrade_run(run_dir)
    assert summary.written and summary.n_changed == len(GSM8K_CASES)  # every predicted string differs
    run = open_run(run_dir)
    run.validate()
    samples = run.samples()
    assert samples["correct"].tolist() == [c["correct"] for c in GSM8K_CASES]  # the corpus's verdicts
    assert samples["answered_after_think"].tolist() == [c["after_think"] for c in GSM8K_CASES]
    assert samples["grader"].str.startswith("math-verify ").all()
    (entry,) = run.manifest["grading_history"]
    assert entry["grader_before"] == ["unrecorded"] and entry["grader_after"] == samples["grader"].iloc[0]
    for i, sample_id in enumerate(samples["sample_id"]):
        assert entry["columns_before"][sample_id] == {**old[i], "grader": None, "answered_after_think": None}
    # Only the samples table and run.json were rewritten; nothing hidden is left behind.
    after = _files(run_dir)
    assert {k for k in after if after[k] != before.get(k)} <= {"run.json", *(k for k in after if k.startswith("samples."))}
    assert not list(run_dir.glob(f"{HIDDEN_PREFIX}*"))
    # A second regrade finds nothing to change and writes nothing.
    assert regrade_run(run_dir).written is False and _files(run_dir) == after


def test_a_failure_before_the_swap_leaves_the_old_run_and_the_next_regrade_finishes(tmp_path):
    run_dir = tmp_path / "run"
    _old_gsm8k_run(run_dir, GSM8K_CASES[:9])
    before = _files(run_dir)
    with pytest.raises(RuntimeError, match="staged"):
        regrade_run(run_dir, fail_at="staged")
    assert list(run_dir.glob(f"{HIDDEN_PREFIX}*"))  # the staged table is there, hidden
    run = open_run(run_dir)
    run.validate()
    assert {k: v for k, v in _files(run_dir).items() if not k.startswith(".")} == before  # old run untouched
    summary = regrade_run(run_dir)
    assert summary.recovered == 1 and summary.written
    assert open_run(run_dir).samples()["correct"].tolist() == [c["correct"] for c in GSM8K_CASES[:9]]
    assert len(open_run(run_dir).manifest["grading_history"]) == 1
    assert not list(run_dir.glob(f"{HIDDEN_PREFIX}*"))


def test_a_failure_after_the_swap_shows_the_new_table_and_the_history_is_recovered(tmp_path):
    run_dir = tmp_path / "run"
    old = _old_gsm8k_run(run_dir, GSM8K_CASES[:9])
    with pytest.raises(RuntimeError, match="swapped"):
        regrade_run(run_dir, fail_at="swapped")
    run = open_run(run_dir)
    run.validate()
    assert run.samples()["correct"].tolist() == [c["correct"] for c in GSM8K_CASES[:9]]  # all new, no mix
    assert "grading_history" not in run.manifest
    summary = regrade_run(run_dir)
    assert summary.recovered == 1 and not summary.written and summary.n_changed == 0
    (entry,) = open_run(run_dir).manifest["grading_history"]
    assert entry["recovered"] is True
    assert [entry["columns_before"][f"gsm8k/test/{i}"]["predicted"] for i in range(9)] == [o["predicted"] for o in old]
    assert not list(run_dir.glob(f"{HIDDEN_PREFIX}*"))


def test_a_real_kill_mid_regrade_leaves_a_readable_run(tmp_path):
    run_dir = tmp_path / "run"
    cases = (GSM8K_CASES * 2)[:60]  # enough parts that the staged table takes a while to write
    _old_gsm8k_run(run_dir, cases, access=False)
    old_correct = open_run(run_dir).samples()["correct"].tolist()
    process = start_thoughtkv(["traces", "regrade", str(run_dir)], REPO)

    def mid_way() -> bool:  # part-way through writing the new (hidden) table
        hidden = list(run_dir.glob(f"{HIDDEN_PREFIX}*"))
        return bool(hidden) and len(list(hidden[0].glob("part-*"))) >= 10

    wait_while_running(process, mid_way, timeout_s=120, poll_s=0.01)
    killed = kill_if_running(process)
    assert killed, process.stderr.read().decode()[-2000:]
    run = open_run(run_dir)
    run.validate()
    correct = run.samples()["correct"].tolist()
    assert len(correct) == len(cases)
    assert correct in (old_correct, [c["correct"] for c in cases])  # all old or all new, never a mix
    assert main(["traces", "regrade", str(run_dir)]) == 0
    assert open_run(run_dir).samples()["correct"].tolist() == [c["correct"] for c in cases]
    assert not list(run_dir.glob(f"{HIDDEN_PREFIX}*"))


def test_regrade_refuses_what_it_cannot_grade(tmp_path, capsys):
    run_dir = tmp_path / "synthetic"
    manifest = example_manifest(sample_ids=["s/0"])
    with TraceWriter(run_dir, manifest) as writer:
        parts = example_sample("s/0", prompt_tokens=4, generated_tokens=2, n_layers=manifest["model"]["n_layers"])
        writer.write_sample(parts["sample"], parts["steps"], parts["tokens"], parts["access"])
    assert main(["traces", "regrade", str(run_dir)]) == 0
    assert "nothing to regrade" in capsys.readouterr().out
    assert main(["traces", "regrade", str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
