"""What a new user hit outside the simulator (devices, threads, inputs, Ctrl-C), each reproduced.

Each test runs the real command (in-process through `thoughtkv.cli.main`, or as a subprocess where a signal
or a fresh environment is the point) and checks the behaviour against an independent reference: the file
on disk, /proc/meminfo, a model's own parameter count, a second decode of the same sample.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import (
    default_sigint,
    has_committed_part,
    start_thoughtkv,
    wait_while_running,
)
from conftest import REPO

from thoughtkv.cli import SUBCOMMANDS, build_parser, main
from traces import open_run

GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
CUDA_FIX = ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128"
cpu_torch = pytest.mark.skipif(torch.version.cuda is not None, reason="needs the CPU build of torch")


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def trace_args(out: Path, *flags: str) -> list[str]:
    return ["trace", "--model", "micro", "--task", "chains", "--max-new-tokens", "6", "--block-size", "4",
            "--window-tokens", "8", "--out", str(out), "--quiet", *flags]


# -- devices and threads ----------------------------------------------------------


@cpu_torch
@pytest.mark.parametrize("device", ["cuda", "gpu", "nonsense", "cuda:1"])
@pytest.mark.parametrize("command", ["trace", "calibrate", "crosscheck", "demo"])
def test_every_device_option_refuses_in_one_line(command, device, tmp_path, capsys):
    args = {
        "trace": trace_args(tmp_path / "run", "--device", device),
        "calibrate": ["calibrate", "--smoke", "--out", str(tmp_path / "p.yaml"), "--device", device],
        "crosscheck": ["crosscheck", "--model", "tiny", "--out", str(tmp_path / "cc"), "--device", device],
        "demo": ["demo", "--out", str(tmp_path / "demo"), "--device", device],
    }[command]
    assert main(args) == 2
    err = one_line_error(capsys)
    if device == "cuda":
        assert CUDA_FIX in err and "CPU build" in err
    elif device == "cuda:1":
        assert CUDA_FIX in err or "first visible GPU" in err
    else:
        assert "unknown device" in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("threads", ["0", "-3", str(os.cpu_count() * 8)])
def test_threads_out_of_range_refused(threads, tmp_path, capsys):
    assert main(trace_args(tmp_path / "run", "--threads", threads)) == 2
    assert "--threads" in one_line_error(capsys)


def test_trace_records_threads_and_load_per_session(tmp_path):
    torch.set_num_threads(2 if (os.cpu_count() or 1) > 1 else 1)  # not the default the run must set
    out = tmp_path / "run"
    assert main(trace_args(out, "--n-samples", "1")) == 0
    assert torch.get_num_threads() == 1  # the CPU default, as calibrate
    assert main(trace_args(out, "--n-samples", "2", "--threads", "1")) == 0
    sessions = json.loads((out / "run.json").read_text())["sessions"]
    assert [s["threads"] for s in sessions] == [1, 1]
    assert [s["samples_already_done"] for s in sessions] == [0, 1]
    assert [s["samples_traced"] for s in sessions] == [1, 1]
    for session in sessions:
        assert session["load_avg_1m_start"] >= 0 and session["load_avg_1m_end"] >= 0
        assert session["cpus"] == len(os.sched_getaffinity(0))


# -- memory, model sources --------------------------------------------------------------------------------


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.mark.parametrize("spec", ["random:tiny", "micro"])
def test_weight_estimate_matches_the_real_model(spec):
    from tracer.models import load_model
    from tracer.preflight import estimated_weight_bytes

    loaded = load_model(spec, "cpu", "float32")
    real = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert estimated_weight_bytes(loaded.model.config, 4) == real


@pytest.mark.parametrize("spec,dtype,weights_gb", [("random:qwen2-7b", "float32", 30.5),
                                                    ("random:qwen2-32b", "bfloat16", 65.5)])
def test_model_too_big_for_memory_is_refused_up_front(spec, dtype, weights_gb, tmp_path, capsys):
    if weights_gb * 1e9 < mem_available_bytes():
        pytest.skip("this machine has room for it")
    started = time.perf_counter()
    assert main(trace_args(tmp_path / "run", "--model", spec, "--dtype", dtype)) == 2
    err = one_line_error(capsys)
    assert f"~{weights_gb:.1f} GB" in err and "host RAM" in err
    assert ("--dtype bfloat16" in err) == (dtype == "float32")
    assert time.perf_counter() - started < 20  # refused before allocating, not after swapping


def test_missing_model_directory(tmp_path, capsys):
    assert main(trace_args(tmp_path / "run", "--model", "/nonexistent/dir")) == 2
    assert "no such directory" in one_line_error(capsys)


def test_hf_id_offline_fails_fast_in_one_line(tmp_path):
    """Without HF_HUB_OFFLINE (conftest sets it) the Hub is probed once; this machine cannot reach it. The
    time is compared with a refusal that needs no network in the same environment (imports dominate both)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache: the id cannot be found locally

    def refused(model: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "thoughtkv", *trace_args(tmp_path / "run", "--model", model)],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        return result, time.perf_counter() - started

    result, elapsed = refused("someone/no-such-model")
    if result.returncode == 0 or "unreachable" not in result.stderr:
        pytest.skip(f"the Hub is reachable here: {result.stderr.strip()[-200:]}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "local directory to --model" in result.stderr and "--data-file" in result.stderr
    baseline, baseline_s = refused("/nonexistent/dir")
    assert baseline.returncode == 2
    assert elapsed - baseline_s < 15  # one probe of at most 3 s (+ load), not ~25 s of retries


def test_hub_dataset_offline_fails_fast_in_one_line(tmp_path):
    """The sibling for datasets: gsm8k without --data-file on a machine without the Hub printed a dozen retry
    lines over ~40 s; now one line naming --data-file, one probe later than a refusal needing no network."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")

    def refused(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.perf_counter()
        argv = ["trace", "--model", "micro", "--task", "gsm8k", "--out", str(tmp_path / "run"), "--quiet", *flags]
        result = subprocess.run([sys.executable, "-m", "thoughtkv", *argv], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=300)
        return result, time.perf_counter() - started

    result, elapsed = refused()
    if result.returncode == 0:
        pytest.skip("the Hub is reachable here")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--data-file" in result.stderr and "Retrying" not in result.stderr
    baseline, baseline_s = refused("--data-file", str(tmp_path / "missing.jsonl"))
    assert baseline.returncode == 2
    assert elapsed - baseline_s < 15  # one probe of at most 3 s (+ load), not ~40 s of retries


def test_hf_id_with_offline_set_fails_without_network(monkeypatch):
    from huggingface_hub import constants

    from tracer.preflight import PreflightError, model_is_local

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    with pytest.raises(PreflightError, match="HF_HUB_OFFLINE is set"):
        model_is_local("someone/no-such-model")
    assert time.perf_counter() - started < 1.0


# -- damaged parts, resume, --n-samples -------------------------------------------------------------------


def test_truncated_part_is_retraced_on_resume_and_validate_prints_the_command(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(trace_args(out, "--n-samples", "3")) == 0
    victim = open_run(out).sample_ids()[1]
    from traces.layout import part_path

    part = part_path(out, "steps", victim)
    reference = open_run(out).steps(victim)
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # an interrupted copy
    capsys.readouterr()

    assert main(["traces", "validate", str(out)]) == 2
    err = one_line_error(capsys)
    assert str(part) in err and "to repair, rerun `" in err
    command = shlex.split(err.split("to repair, rerun `", 1)[1].split("`", 1)[0])
    assert command[:2] == ["thoughtkv", "trace"]
    # The printed command is the run's own: parsed back it gives the settings run.json recorded.
    from tracer.cli import config_from_args

    parsed = config_from_args(build_parser().parse_args(command[1:]))
    recorded = json.loads((out / "run.json").read_text())["tracer"]
    settings = {k: v for k, v in recorded.items() if not isinstance(v, dict)}
    assert {k: getattr(parsed, k) for k in settings} == settings

    assert main(["traces", "info", str(out)]) == 2  # info finds the damage too, and says the same
    assert f"to repair, rerun `{shlex.join(command)}`" in one_line_error(capsys)

    assert main(command[1:]) == 0
    captured = capsys.readouterr()
    assert "1 committed sample(s) had a damaged part" in captured.err
    run = open_run(out)
    run.validate()
    assert sorted(run.sample_ids()) == sorted(f"chains/test/{i}" for i in range(3))
    redone = run.steps(victim)  # greedy decoding is deterministic: the same rows, timings aside
    columns = [c for c in reference.columns if not c.endswith("_us")]
    # The attention masses are float sums whose rounding depends on how many (empty, weight-0) slots the
    # paged pool had when the sample ran, which the samples before it decide: equal to float32 rounding.
    masses = [c for c in columns if c.startswith("mass_")]
    exact = [c for c in columns if c not in masses]
    assert redone[exact].equals(reference[exact])
    assert np.allclose(redone[masses].to_numpy(float), reference[masses].to_numpy(float), rtol=0, atol=1e-6,
                       equal_nan=True)  # mass_evicted: NaN where nothing was evicted


def test_resume_says_how_many_are_done(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(trace_args(out, "--n-samples", "2")) == 0
    args = [a for a in trace_args(out, "--n-samples", "3") if a != "--quiet"]
    capsys.readouterr()
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "2 of 3 samples already done" in captured.out
    assert "0/1" not in captured.err  # the bar counts the whole run, not only what is left
    assert "2/3" in captured.err and "3/3" in captured.err


@pytest.mark.skipif(not GSM8K.is_file(), reason="shared GSM8K file not present")
def test_more_samples_than_the_task_has_says_so(tmp_path, capsys):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:3]))
    out = tmp_path / "run"
    args = ["trace", "--model", "random:tiny", "--task", "gsm8k", "--data-file", str(data), "--n-samples", "5000",
            "--max-new-tokens", "2", "--out", str(out), "--quiet"]
    assert main(args) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "problems" in line]
    assert notes == ["note: task gsm8k has 3 problems; tracing those 3, not --n-samples 5,000"]
    assert len(open_run(out).sample_ids()) == 3


def test_generated_task_refuses_an_endless_sample_count(tmp_path, capsys):
    """chains is generated, so its loader has no count to stop at: 10**13 samples looped forever."""
    started = time.perf_counter()
    assert main(trace_args(tmp_path / "run", "--n-samples", str(10**13))) == 2
    assert "--n-samples 10,000,000,000,000 is more than 1,000,000" in one_line_error(capsys)
    assert time.perf_counter() - started < 10


def test_a_giant_block_is_refused_before_allocating(tmp_path, capsys):
    """Storage comes in whole blocks: --block-size 10**9 asked the allocator for terabytes (a RuntimeError)."""
    assert main(trace_args(tmp_path / "run", "--block-size", str(10**9))) == 2
    err = one_line_error(capsys)
    assert "the KV buffers need" in err and "--block-size" in err
    assert not (tmp_path / "run").exists()


def test_endless_max_new_tokens_is_refused_and_past_context_warned(tmp_path, capsys):
    started = time.perf_counter()
    assert main(trace_args(tmp_path / "a", "--max-new-tokens", str(10**12))) == 2  # looped in the KV sizing
    assert "--max-new-tokens 1,000,000,000,000 is more than 1,048,576" in one_line_error(capsys)
    assert time.perf_counter() - started < 10
    context = json.loads((REPO / "tracer" / "assets" / "micro" / "config.json").read_text())["max_position_embeddings"]
    args = trace_args(tmp_path / "b")
    args[args.index("--max-new-tokens") + 1] = str(context)  # the prompt on top passes the context
    assert main(args) == 0  # allowed (micro stops at EOS long before), but said
    assert f"may pass micro's context of {context:,} tokens" in capsys.readouterr().err


def test_synth_refuses_an_endless_sample_count(tmp_path, capsys):
    """traces synth --samples 10**13 built its sample-id list until the machine ran out of memory."""
    argv = ["traces", "synth", "--model", "tiny", "--prompt-tokens", "16", "--decode-steps", "8", "--samples",
            str(10**13), "--out", str(tmp_path / "synth")]
    assert main(argv) == 2
    assert "--samples 10,000,000,000,000 is more than 1,000,000" in one_line_error(capsys)


# -- Ctrl-C -------------------------------------------------------------------------------------------------


def test_ctrl_c_inside_one_long_torch_op_ends_within_seconds():
    """A single matmul that runs for far longer than the grace: Python cannot raise KeyboardInterrupt inside
    it, the watchdog must end the process."""
    # One matmul sized to last ~8 s on this machine (a fixed 6000 x 6000 took 1.3 s on a fast day: it ended
    # before the grace did, and Python's own KeyboardInterrupt ended the process instead of the watchdog).
    script = (
        "import sys, time, torch\n"
        "from thoughtkv.cli import hard_interrupt\n"
        "torch.set_num_threads(1)\n"
        "b = torch.randn(1500, 1500)\n"
        "for _ in range(2):\n"
        "    started = time.perf_counter(); b @ b; per_op = time.perf_counter() - started\n"
        "n = min(16000, int(1500 * (8.0 / per_op) ** (1 / 3)))\n"
        "a = torch.randn(n, n)\n"
        "print('ready', flush=True)\n"
        "with hard_interrupt('test'):\n"
        "    for _ in range(100):\n"
        "        a @ a\n"
        "print('finished', flush=True)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # well inside the first matmul
        sent = time.perf_counter()
        process.send_signal(signal.SIGINT)
        rc = process.wait(timeout=30)
        elapsed = time.perf_counter() - sent
    finally:
        process.kill()  # (a no-op once it has ended; else no orphan keeps multiplying)
    assert rc == 130 and elapsed < 4.0, (rc, elapsed)
    assert "interrupted; finished work is kept" in process.stderr.read()


def test_ctrl_c_during_trace_keeps_committed_samples(tmp_path):
    out = tmp_path / "run"
    args = trace_args(out, "--n-samples", "40")
    args[args.index("--max-new-tokens") + 1] = "120"
    process = start_thoughtkv(args, REPO, text=True)
    samples_dir = out / "samples.parquet"
    wait_while_running(process, lambda: has_committed_part(samples_dir), timeout_s=180)
    time.sleep(0.3)  # somewhere inside a later decode step
    sent = time.perf_counter()
    process.send_signal(signal.SIGINT)
    rc = process.wait(timeout=30)
    assert rc == 130 and time.perf_counter() - sent < 4.0  # the grace (1.5 s) plus a loaded machine
    assert "interrupted; finished work is kept, rerun to resume" in process.stderr.read()
    run = open_run(out)
    run.validate()
    assert 1 <= len(run.sample_ids()) < 40


# -- consistency ------------------------------------------------------------------------------------------


def test_groups_without_an_action_refuse_in_one_line_listing_the_actions(capsys):
    groups = {(): "simulate", ("profiles",): "validate", ("traces",): "synth", ("analyze",): "correlation"}
    for argv, action in groups.items():
        assert main(list(argv)) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert captured.out == "" and len(lines) == 1 and "choose one of" in lines[0] and action in lines[0], argv


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trace", "--model"])
    assert exc.value.code == 2
    assert "argument --model: expected one argument" in one_line_error(capsys)


def all_options(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from all_options(child, (*prefix, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield " ".join(prefix), action


def test_every_option_of_every_command_has_help_naming_its_default():
    missing = []
    for command, action in all_options(build_parser()):
        name = action.option_strings[-1] if action.option_strings else action.dest
        if not action.help:
            missing.append(f"{command} {name}: no help")
        elif action.option_strings and not action.required and action.default not in (None, False, []) \
                and "default" not in action.help:
            missing.append(f"{command} {name}: default {action.default!r} not in its help")
    assert not missing, "\n".join(missing)


def test_quiet_hides_the_weights_loading_bar(tmp_path, capsys):
    assert main(trace_args(tmp_path / "run")) == 0
    assert "Loading weights" not in capsys.readouterr().err


def test_readme_command_table_lists_every_subcommand():
    readme = (REPO / "README.md").read_text()
    table = readme.split("## The command line", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    for name, _module, _help in SUBCOMMANDS:
        assert f"`thoughtkv {name}" in table, name


def test_default_sweep_output_is_ignored_by_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", "sweeps/budgets/results.parquet"], cwd=REPO)
    assert result.returncode == 0


def test_readme_experiments_table_lists_every_experiment_with_its_documents():
    from thoughtkv.experiments import EXPERIMENTS

    readme = (REPO / "README.md").read_text()
    table = readme.split("| experiment | writes |", 1)[1].split("\n\n", 1)[0]
    for name, _module, docs, _help in EXPERIMENTS:
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, name
        assert all(f"docs/{doc.strip()}" in row for doc in docs.split(",")), row


def test_help_lists_the_product_commands_then_the_experiments_with_their_documents(capsys):
    from thoughtkv.experiments import EXPERIMENTS

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    experiments_at = text.index("experiments (")
    assert all(f"    {name}" in text[:experiments_at] for name, *_ in SUBCOMMANDS)
    for name, _module, docs, _help in EXPERIMENTS:
        assert f"  {name}  " in text[experiments_at:] and f"writes docs/{docs}" in text[experiments_at:], name


def test_a_command_imports_only_its_own_module():
    """`thoughtkv profiles list` builds its parser without importing another command's module (torch above
    all): the other commands are listed, not loaded."""
    script = ("import sys\nfrom thoughtkv.cli import build_parser, SUBCOMMANDS\n"
              "build_parser(['profiles', 'list']).parse_args(['profiles', 'list'])\n"
              "others = [m for _, m, _ in SUBCOMMANDS if m != 'hwprofiles.cli' and m in sys.modules]\n"
              "print(others, 'torch' in sys.modules, 'thoughtkv.experiments.real_model' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "False", "False"], result.stdout
