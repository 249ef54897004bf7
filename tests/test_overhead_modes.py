"""Overhead modes: the shipped figures are held to the measurements they cite, validated like profiles, and
applied (host model, GPU time, labels) the same way everywhere."""

from __future__ import annotations

import math

import pytest
import yaml

from hwprofiles import ProfileError, load_profile
from hwprofiles.overhead_modes import (
    GPU_TIME_MODE,
    HOST_MODES,
    MODES_DIR,
    OVERHEAD_MODES,
    apply_mode,
    check_mode,
    load_mode,
    mode_of,
)
from hwprofiles.schema import mode_from_dict


def test_hf_eager_op_counts_are_what_a_transformers_generate_step_issues():
    """ops per layer (launches.py, Qwen2 and Llama alike), per step (forward + generate's own) and before the first
    matmul, recounted here with the same dispatch counter."""
    from tracer.calibrate.host import generate_step_ops
    from tracer.calibrate.launches import launches_per_decode_step

    spec = load_mode("hf-eager")
    greedy = generate_step_ops()
    assert spec.ops_per_layer == greedy["per_layer"] == launches_per_decode_step("qwen2")["per_layer"] \
        == launches_per_decode_step("llama")["per_layer"]
    assert spec.ops_per_step == greedy["per_step"] and spec.lead_ops == greedy["lead"]
    # the issue's HF run sampled with top-k: its ops per token are a 32-layer step's with sampling
    sampled = generate_step_ops(sample=True)
    hf_run = next(r for r in spec.runs if r.run.startswith("transformers generate"))
    assert hf_run.ops_per_token == 32 * sampled["per_layer"] + sampled["per_step"]


def test_the_cited_host_cost_is_the_geometric_mean_of_its_measured_runs():
    spec = load_mode("hf-eager")
    per_op = [r.time_per_token_s / r.ops_per_token for r in spec.runs]
    assert len(per_op) >= 2 and spec.op_s == pytest.approx(math.sqrt(per_op[0] * per_op[1]))
    assert 15e-6 < spec.op_s < 35e-6  # tens of microseconds per eager op (25-39 ms over ~1,200-1,600 ops)
    # the geometric mean puts every run at the same worst relative error: no run is fitted at another's expense
    errors = [spec.op_s / p - 1 for p in per_op]
    assert max(errors) == pytest.approx(1 / (1 + min(errors)) - 1, rel=1e-9)


def test_every_mode_file_is_valid_and_cites_every_number():
    for mode in HOST_MODES:
        data = yaml.safe_load((MODES_DIR / f"{mode}.yaml").read_text(encoding="utf-8"))
        for name, field in data["host"].items():
            assert len(field["source"]) > 30, f"{mode}: {name}"
        assert load_mode(mode).name == mode
    assert load_mode(GPU_TIME_MODE).decode_hbm_fraction == pytest.approx(1397.31 / 1700, abs=1e-3)


def _mode_dict(**changes):
    data = yaml.safe_load((MODES_DIR / "hf-eager.yaml").read_text(encoding="utf-8"))
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[leaf] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    ("host.ops_per_layer.value", 36.5, "whole number"),
    ("host.ops_per_layer.value", 10**7, "plausible range"),
    ("host.step_host.unit", "GB", "not a time unit"),
    ("host.lead_ops.value", 400, "lead_ops"),
    ("host_op_from.0.time_per_token.value", 39_000, "plausible range"),  # 39 s per token: a unit mistake
    ("host_op_from.0.ops_per_token.value", 3, "not a host's cost per op"),
    ("host_op_from.1.time_per_token.source", "", "source"),
    ("host.ops_per_layr", {"value": 1, "unit": "count", "source": "x"}, "did you mean"),
])
def test_absurd_or_uncited_mode_figures_are_one_line_errors(path, value, message):
    with pytest.raises(ProfileError, match=message):
        mode_from_dict(_mode_dict(**{path: value}), "hf-eager.yaml")


def test_unknown_modes_are_one_line_errors():
    assert check_mode(None) is None and [check_mode(m) for m in OVERHEAD_MODES] == list(OVERHEAD_MODES)
    with pytest.raises(ProfileError, match="--overhead-mode 'eager'"):
        check_mode("eager")
    with pytest.raises(ProfileError, match="no figures file"):
        load_mode("kernel-only")


def test_simulator_options_know_the_same_modes():
    from simulator.options import OVERHEAD_MODES as OPTION_MODES

    assert OPTION_MODES == OVERHEAD_MODES


def test_apply_mode_sets_the_host_model_gpu_time_and_labels():
    datasheet = load_profile("h200-sxm")
    assert mode_of(datasheet) == "kernel-only" and not datasheet.host_model.active
    eager = apply_mode(datasheet, "hf-eager")
    spec = load_mode("hf-eager")
    fraction = load_mode(GPU_TIME_MODE).decode_hbm_fraction
    assert mode_of(eager) == "hf-eager" and eager.host_model.term == "cited"
    assert (eager.host_model.ops_per_layer, eager.host_model.op_s) == (spec.ops_per_layer, spec.op_s)
    assert eager.gpu.hbm_efficiency == pytest.approx(datasheet.gpu.hbm_efficiency * fraction)
    assert eager.overheads.layer_overhead_s == 0 and eager.overheads.step_overhead_s == 0
    graphs = apply_mode(eager, "cuda-graphs")  # from another mode: the efficiency is scaled once, not twice
    assert graphs.gpu.hbm_efficiency == pytest.approx(datasheet.gpu.hbm_efficiency * fraction)
    assert graphs.host_model.op_s == 0 and graphs.host_model.step_s == load_mode("cuda-graphs").step_s
    back = apply_mode(graphs, "kernel-only")
    assert back.gpu == datasheet.gpu and not back.host_model.active and mode_of(back) == "kernel-only"
    assert apply_mode(eager, None) is eager and apply_mode(eager, "hf-eager") is eager
    with pytest.raises(ProfileError, match="no measured overheads"):
        apply_mode(datasheet, "measured")
    with pytest.raises(ProfileError, match="is measured"):
        apply_mode(load_profile("measured-cpu"), "hf-eager")


def test_a_measured_host_term_comes_from_the_calibrated_profile(tmp_path):
    """`thoughtkv calibrate` measures this host's cost per eager op; --host-term <that profile> charges it."""
    from thoughtkv.cli import main

    out = tmp_path / "here-cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    figures = load_profile(out).provenance["figures"]
    assert 1e-7 < figures["host_op_s"] < 1e-3 and figures["host_ops_per_token"] == 4 * 36 + 32  # smoke: 4 layers
    here = apply_mode(load_profile("a100-80gb-pcie"), "hf-eager", "here-cpu", profiles_dir=tmp_path)
    assert here.host_model.term == "here-cpu" and here.host_model.op_s == pytest.approx(figures["host_op_s"])
    with pytest.raises(ProfileError, match="no measured host cost per op"):
        apply_mode(load_profile("a100-80gb-pcie"), "hf-eager", "h100-sxm")
