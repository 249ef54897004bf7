"""`thoughtkv crosscheck`: the error statistics on constructed cases, the per-policy profile, the device-side
model init, and the whole command on CPU (small): measured = median of the repeats, simulated = simulate_run
of the same trace, resume keeps finished measurements."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.crosscheck import CrosscheckError, dominant_term, error_stats, step_errors, summarise
from simulator.costs import profile_for_policy as profile_with_overheads
from thoughtkv.cli import main
from thoughtkv.crosscheck import RunSpec, run_specs


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two OpenMP threads on a shared 2-core box stall at random
    yield
    torch.set_num_threads(before)


def _constructed(n: int = 100):
    """Step i (1..n) is measured at 10 ms and simulated with relative error i/n, alternating sign."""
    steps = np.arange(n)
    errors = (steps + 1) / n
    signs = np.where(steps % 2 == 0, 1.0, -1.0)
    measured = pd.DataFrame({"label": "a", "sample_id": "s", "step": steps, "measured_s": 0.010})
    simulated = pd.DataFrame({"label": "a", "sample_id": "s", "step": steps, "profile_kind": "calibrated",
                              "profile": "p", "simulated_s": 0.010 * (1 + signs * errors)})
    return measured, simulated, errors, signs


def test_error_statistics_on_a_constructed_case():
    measured, simulated, errors, signs = _constructed()
    table = step_errors(measured, simulated)
    np.testing.assert_allclose(table["rel_error"], errors, rtol=1e-12)
    stats = error_stats(table)
    assert stats["n_steps"] == 100
    assert stats["median_rel_error"] == pytest.approx((0.50 + 0.51) / 2)
    # 95th percentile, linear interpolation: position 0.95 * 99 = 94.05 between 0.95 and 0.96.
    assert stats["p95_rel_error"] == pytest.approx(0.95 + 0.05 * 0.01)
    assert stats["mean_signed_rel_error"] == pytest.approx(float(np.mean(signs * errors)))


def test_step_errors_refuses_unmeasured_steps():
    measured, simulated, _, _ = _constructed(10)
    with pytest.raises(CrosscheckError, match="no measured step"):
        step_errors(measured.iloc[:-1], simulated)


def test_summary_splits_the_error_into_layers_and_the_rest():
    measured, simulated, _, _ = _constructed(4)
    measured["layers_s"] = 0.008  # the other 2 ms: LM head + step overhead
    simulated = simulated.assign(simulated_s=0.008, sim_layers_s=0.006, sim_rest_s=0.002)
    summary = summarise(step_errors(measured, simulated))
    row = summary[summary["label"] == "ALL"].iloc[0].to_dict()
    assert row["median_rel_error"] == pytest.approx(0.2)
    assert row["layers_signed_rel_error"] == pytest.approx(-0.2)
    assert row["rest_signed_rel_error"] == pytest.approx(0.0)
    assert "decoder layers" in dominant_term(row) and "under" in dominant_term(row)


def test_run_specs_measure_full_once_and_each_budget_otherwise():
    specs = run_specs(["full", "evict", "hierarchy"], ["0.5", "256"])
    assert [s.label for s in specs] == ["full", "evict-b0.5", "evict-b256", "hierarchy-b0.5", "hierarchy-b256"]
    assert specs[0] == RunSpec("full", "1.0")


def test_profile_with_overheads_takes_the_policy_decode_path():
    from hwprofiles import load_profile

    base = load_profile("h200-sxm")
    by_decoder = {"tiered/hierarchy": {"step_overhead_s": 1e-4, "layer_overhead_s": 2e-5}}
    profile = base.__class__(**{**base.__dict__, "provenance": {"kind": "measured",
                                                                "overheads_by_decoder": by_decoder}})
    chosen, source = profile_with_overheads(profile, "hierarchy")
    assert (chosen.overheads.step_overhead_s, chosen.overheads.layer_overhead_s) == (1e-4, 2e-5)
    assert source == "tiered/hierarchy" and chosen.gpu == base.gpu
    same, note = profile_with_overheads(profile, "evict")  # not calibrated: the profile's own overheads
    assert same.overheads == base.overheads and "no per-policy" in note


def test_profile_with_overheads_keeps_the_cached_set_per_policy():
    import dataclasses

    from hwprofiles import OverheadSpec, load_profile

    base = load_profile("h200-sxm")
    by_decoder = {"tiered/evict": {"step_overhead_s": 1e-3, "layer_overhead_s": 5e-4,
                                   "warm_step_overhead_s": 3e-4, "warm_layer_overhead_s": 4e-4}}
    profile = dataclasses.replace(base, overheads=OverheadSpec(9e-4, 6e-4, 2e-4, 3e-4, 32 * 2**20),
                                  provenance={"kind": "measured", "overheads_by_decoder": by_decoder})
    chosen, _ = profile_with_overheads(profile, "evict")
    assert chosen.overheads == OverheadSpec(1e-3, 5e-4, 3e-4, 4e-4, 32 * 2**20)
    no_cache = dataclasses.replace(profile, overheads=OverheadSpec(9e-4, 6e-4))  # e.g. CUDA: stays without one
    assert not profile_with_overheads(no_cache, "evict")[0].overheads.has_cached


def test_random_model_initialised_on_the_device_matches_the_tracer_loader():
    from tracer.calibrate.measured import load_random_on_device
    from tracer.models import load_model

    on_device = load_random_on_device("random:tiny", torch.device("cpu"), None, seed=0)
    reference = load_model("random:tiny", "cpu", None, seed=0)
    assert on_device.manifest == reference.manifest
    a, b = on_device.model, reference.model
    assert torch.equal(a.model.rotary_emb.inv_freq, b.model.rotary_emb.inv_freq)  # a buffer, not a parameter
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied as configured
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.shape == q.shape and torch.isfinite(p).all(), name
        assert float(p.detach().float().std()) == pytest.approx(float(q.detach().float().std()), rel=0.2, abs=1e-6), name
    with torch.no_grad():
        assert torch.isfinite(a(torch.arange(12)[None]).logits).all()


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "quick-cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(path)]) == 0
    return path


def _crosscheck(out, profile, *extra):
    return main(["crosscheck", "--model", "tiny", "--device", "cpu", "--policy", "full", "hierarchy",
                 "--hbm-budget", "0.5", "--steps", "5", "--repeats", "2", "--profile", str(profile),
                 "--out", str(out), "--quiet", *extra])


def test_crosscheck_end_to_end_on_cpu(tmp_path, quick_profile, capsys):
    from hwprofiles import load_profile_file
    from simulator import SimOptions, simulate_run
    from simulator.costs import profile_for_policy as with_overheads

    out = tmp_path / "cc"
    assert _crosscheck(out, quick_profile, "--datasheet-profile", "h200-sxm") == 0
    printed = capsys.readouterr().out
    assert "calibrated profile quick-cpu: median" in printed
    report = json.loads((out / "summary.json").read_text())
    assert report["clock"] == "thread_cpu" and report["repeats_identical"] is True
    assert (out / "scatter.png").stat().st_size > 0
    table = pd.read_parquet(out / "steps.parquet")
    assert sorted(table["label"].unique()) == ["full", "hierarchy-b0.5"]
    assert set(table["profile_kind"]) == {"calibrated", "datasheet", "datasheet+hf-eager", "datasheet+overheads"}
    assert (table.loc[table["profile_kind"] == "datasheet+hf-eager", "overheads"] == "hf-eager").all()
    datasheet = table[table["profile_kind"] == "datasheet"]
    assert (datasheet["profile"] == "h200-sxm").all() and (datasheet["overheads"] == "none").all()
    table = table[table["profile_kind"] == "calibrated"]

    # measured_s is the per-step median of the two repeats' timings.
    reps = pd.concat([pd.read_parquet(out / "measured" / f"hierarchy-b0.5-rep{r}.parquet") for r in (0, 1)])
    median = reps.groupby("step")["measured_s"].median()
    mine = table[table["label"] == "hierarchy-b0.5"].set_index("step")["measured_s"]
    np.testing.assert_allclose(mine.sort_index(), median.sort_index(), rtol=1e-12)
    assert (reps["measured_s"] > 0).all() and (reps["layers_s"] < reps["measured_s"]).all()

    # The repeats were measured round-robin: every configuration's repeat 0 before any repeat 1.
    written = sorted((out / "measured").glob("*.parquet"), key=lambda path: path.stat().st_mtime_ns)
    assert [path.stem for path in written] == ["full-rep0", "hierarchy-b0.5-rep0", "full-rep1", "hierarchy-b0.5-rep1"]

    # simulated_s is the simulator's own per-step latency for that trace on the per-policy profile.
    profile, _ = with_overheads(load_profile_file(quick_profile), "hierarchy")
    direct = simulate_run(out / "runs" / "hierarchy-b0.5-rep0", profile, SimOptions(async_offload=False)).steps
    sim = table[table["label"] == "hierarchy-b0.5"].set_index("step")["simulated_s"].sort_index()
    np.testing.assert_allclose(sim, direct.set_index("step")["latency_s"].sort_index(), rtol=1e-12)
    assert report["summary"][-1]["label"] == "ALL"
    assert table["rel_error"].median() == pytest.approx(report["calibrated"]["median_rel_error"])

    # Rerunning resumes: finished measurements are kept, not redone.
    timing = out / "measured" / "full-rep0.parquet"
    before = timing.stat().st_mtime_ns
    assert _crosscheck(out, quick_profile, "--datasheet-profile", "h200-sxm") == 0
    assert timing.stat().st_mtime_ns == before
    # Other settings in the same --out are refused.
    assert _crosscheck(out, quick_profile, "--block-size", "8") == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--scorer", "oracle"], "--scorer oracle"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--profile", "no-such-profile"], "thoughtkv calibrate --device cpu"),
        (["--profile", "h200-sxm"], "a datasheet profile"),
        (["--hbm-budget", "1.5"], "--hbm-budget"),
    ],
)
def test_crosscheck_bad_arguments_are_one_line_errors(tmp_path, capsys, extra, message):
    argv = ["crosscheck", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path / "cc"), "--quiet", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "cc" / "runs").exists()


def test_a_packaged_model_is_crosschecked_with_its_real_weights():
    """`--model tiny` is the random-weight architecture; `--model smollm2-135m` (an architecture too, for synth
    and calibration) is the packaged pretrained model, never random weights of its shape."""
    from thoughtkv.crosscheck import normalise_model

    assert normalise_model("tiny") == "random:tiny"
    assert normalise_model("smollm2-135m") == "smollm2-135m"
    assert normalise_model("micro") == "micro"
