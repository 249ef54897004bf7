"""Inputs a new user tried that slipped through: each is now one line on stderr, exit 2, and nothing
written or lost; the signals say what they say on Ctrl-C.

Each test runs the real command (in-process through `thoughtkv.cli.main`, or as a subprocess where a second
process or a signal is the point) and checks the files on disk, not only the message.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from _helpers import has_committed_part, start_thoughtkv, wait_while_running
from conftest import REPO

from thoughtkv.cli import main
from thoughtkv_base import SEED_MAX
from tracer.model_defaults import BUNDLED_MODELS
from traces import open_run

SAMPLE_RUN = REPO / "traces" / "samples" / "micro-hierarchy-b30-e0"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith(("warning:", "note:"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def trace(out: Path, *flags: str, model: str = "micro", task: str = "chains") -> list[str]:
    return ["trace", "--model", model, "--task", task, "--max-new-tokens", "4", "--out", str(out), "--quiet", *flags]


# -- --data-file ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, problem", [
    (b'{"question": "caf\xe9", "answer": "#### 1"}\n', "not UTF-8 text"),
    (b"", "no records"),
    (b"\n   \n\t\n", "no records"),
    (None, "is a directory"),
])
def test_a_bad_data_file_is_refused_before_anything_is_written(content, problem, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    if content is None:
        data.mkdir()
    else:
        data.write_bytes(content)
    out = tmp_path / "run"
    assert main(trace(out, "--data-file", str(data), task="gsm8k")) == 2
    assert problem in one_line_error(capsys)
    assert not out.exists()


def test_a_prompt_past_the_models_context_is_refused_unless_allowed(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"question": " ".join(["c"] * 1500), "answer": "#### 4"}) + "\n")
    out = tmp_path / "run"
    assert main(trace(out, "--data-file", str(data), task="gsm8k")) == 2
    err = one_line_error(capsys)
    assert "longer than micro's context of 1,024 tokens" in err and "--allow-past-context" in err
    assert "Token indices sequence length" not in capsys.readouterr().err
    assert not out.exists()
    assert main(trace(out, "--data-file", str(data), "--allow-past-context", "--max-new-tokens", "1",
                      task="gsm8k")) == 0
    assert len(open_run(out).sample_ids()) == 1


# -- seeds: one rule (thoughtkv_base.check_seed) for every command that takes one ----------------------------


def seed_commands(tmp_path: Path, seed: str) -> dict[str, list[str]]:
    return {
        "trace": trace(tmp_path / "t", "--seed", seed),
        "serve-sim": ["serve-sim", str(SAMPLE_RUN), "--profile", "h100-pcie", "--duration-s", "4", "--seed", seed,
                      "--out", str(tmp_path / "s")],
        "traces synth": ["traces", "synth", "--model", "tiny", "--prompt-tokens", "8", "--decode-steps", "2",
                         "--seed", seed, "--out", str(tmp_path / "y")],
    }


@pytest.mark.parametrize("seed", ["-1", str(SEED_MAX + 1), "99999999999999999999"])
def test_every_command_refuses_the_same_seeds(seed, tmp_path, capsys):
    errors = {}
    for name, argv in seed_commands(tmp_path, seed).items():
        assert main(argv) == 2, name
        errors[name] = one_line_error(capsys)
    assert all(f"--seed {seed} must be a whole number in [0, {SEED_MAX}]" in e for e in errors.values()), errors
    assert not any((tmp_path / d).exists() for d in "tsy")


def test_every_command_accepts_the_largest_seed(tmp_path, capsys):
    for name, argv in seed_commands(tmp_path, str(SEED_MAX)).items():
        assert main(argv) == 0, (name, capsys.readouterr().err)


# -- a local model that cannot be traced ---------------------------------------------------------------------


@pytest.mark.parametrize("keep_layer_types", [True, False])
def test_a_model_with_no_layers_is_one_line(keep_layer_types, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODELS["micro"], model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 0
    if not keep_layer_types:
        config.pop("layer_types", None)
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    assert main(trace(out, model=str(model))) == 2
    assert "num_hidden_layers" in one_line_error(capsys)
    assert not out.exists()


# -- recall flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, problem", [
    (["--policy", "hierarchy", "--recall-budget", "0.1", "--recall-k", "8"], "give one of them"),
    (["--policy", "full", "--recall-budget", "0.1"], "--recall-budget applies to the hierarchy policy only"),
    (["--policy", "evict", "--hbm-budget", "0.3", "--recall-k", "2"], "--recall-k applies to the hierarchy"),
])
@pytest.mark.parametrize("command", ["trace", "traces synth"])
def test_recall_flags_that_would_be_ignored_are_refused(command, flags, problem, tmp_path, capsys):
    out = tmp_path / "run"
    argv = trace(out, *flags) if command == "trace" else [
        "traces", "synth", "--model", "tiny", "--prompt-tokens", "8", "--decode-steps", "2", "--out", str(out), *flags]
    assert main(argv) == 2
    assert problem in one_line_error(capsys)
    assert not out.exists()


def test_a_recall_budget_below_one_block_warns_once(tmp_path, capsys):
    """The issue's run: 10% of a ~60-token context is less than one 16-token block, so nothing is recalled."""
    out = tmp_path / "run"
    assert main(["trace", "--model", "micro_long", "--task", "chains_long", "--policy", "hierarchy", "--hbm-budget",
                 "0.3", "--recall-budget", "0.1", "--block-size", "16", "--window-tokens", "8", "--max-new-tokens",
                 "40", "--out", str(out), "--quiet"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "recall nothing" in line]
    assert len(warnings) == 1 and "less than one 16-token block" in warnings[0]
    run = open_run(out)
    assert run.manifest["tracer"]["recall_rounds_to_zero"]["zero_recall_step_share"] == 1.0
    assert run.steps()["recalled_tokens"].sum() == 0  # the warning says what the run then did


def test_the_recall_rounding_note_follows_the_policy_contract():
    from tracer.run import recall_rounding_note
    from traces.policy import PolicySpec, recall_blocks

    spec = PolicySpec(policy="hierarchy", hbm_budget=0.3, block_size=16, recall_budget=0.1)
    note = recall_rounding_note(spec, [(55, 150)])
    first = note["first_length_with_recall"]
    assert recall_blocks(spec, first) == 1 and recall_blocks(spec, first - 1) == 0
    assert note["zero_recall_step_share"] == pytest.approx((first - 56) / 150)
    assert recall_rounding_note(spec, [(55, 2000)]) is None  # most steps recall: no warning
    assert recall_rounding_note(PolicySpec(policy="hierarchy", recall_k=0), [(55, 10)]) is None


# -- simulate on a run with a deleted table ------------------------------------------------------------------


def test_simulate_says_what_validate_says_about_a_missing_access_table(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    shutil.rmtree(run / "access.parquet")
    assert main(["traces", "validate", str(run)]) == 2
    validate_error = one_line_error(capsys)
    assert "has no access part" in validate_error
    sim = tmp_path / "sim"
    assert main(["simulate", str(run), "--profile", "h100-pcie", "--out", str(sim)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert any("no access part" in w and "traces validate` refuses this run" in w for w in warnings)
    assert main(["simulate", str(run), "--profile", "h100-pcie", "--what-if", "budget=0.3", "--out",
                 str(tmp_path / "sim2")]) == 2
    assert "no access part" in one_line_error(capsys)
    assert not (tmp_path / "sim2").exists()


# -- two traces on one --out, and SIGTERM --------------------------------------------------------------------


def test_a_second_trace_on_the_same_out_exits_2_and_the_first_finishes(tmp_path):
    out = tmp_path / "run"
    args = trace(out, "--n-samples", "12", "--max-new-tokens", "200")
    first = start_thoughtkv(args, REPO, text=True)
    try:
        wait_while_running(first, lambda: (out / "run.json").is_file(), timeout_s=120)
        second = start_thoughtkv(args, REPO, text=True)
        assert second.wait(timeout=120) == 2
        err = second.stderr.read().strip().splitlines()
        assert len(err) == 1 and "another `thoughtkv trace` is writing this run now" in err[0]
        assert first.wait(timeout=300) == 0
    finally:
        first.kill()
    run = open_run(out)
    run.validate()
    assert len(run.sample_ids()) == 12


def test_sigterm_during_trace_says_what_ctrl_c_says_and_exits_143(tmp_path):
    out = tmp_path / "run"
    process = start_thoughtkv(trace(out, "--n-samples", "40", "--max-new-tokens", "120"), REPO, text=True)
    try:
        wait_while_running(process, lambda: has_committed_part(out / "samples.parquet"), timeout_s=180)
        time.sleep(0.3)  # inside a later decode step
        process.send_signal(signal.SIGTERM)
        rc = process.wait(timeout=30)
    finally:
        process.kill()
    assert rc == 143
    assert "terminated (SIGTERM); finished work is kept, rerun to resume" in process.stderr.read()
    run = open_run(out)
    run.validate()
    done = len(run.sample_ids())
    assert 1 <= done < 40
    assert main(trace(out, "--n-samples", str(done + 1), "--max-new-tokens", "120")) == 0  # resumes
    assert len(open_run(out).sample_ids()) == done + 1
