"""`thoughtkv calibrate`: the fit recovers known terms, the microbenchmarks measure real work, the profile it
writes is one the hardware-profile loader accepts and means what was measured."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import yaml

from thoughtkv.cli import main
from tracer.calibrate.fit import fit_fixed_plus_linear


@pytest.fixture(autouse=True)
def one_thread():
    """The thread-CPU-time clock is only valid when torch runs on the calling thread alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fit_recovers_overhead_and_bandwidth_exactly():
    sizes = np.array([4e3 * 4**i for i in range(9)])
    overhead_s, bytes_per_s = 7e-6, 53e9
    fit = fit_fixed_plus_linear(sizes, overhead_s + sizes / bytes_per_s)
    assert fit.fixed == pytest.approx(overhead_s, rel=1e-9)
    assert fit.rate == pytest.approx(bytes_per_s, rel=1e-9)
    assert fit.max_rel_residual < 1e-9


def test_fit_recovers_terms_from_noisy_timings():
    rng = np.random.default_rng(0)
    sizes = np.repeat([4e3 * 4**i for i in range(9)], 5)
    overhead_s, bytes_per_s = 7e-6, 25e9
    noisy = (overhead_s + sizes / bytes_per_s) * rng.uniform(0.95, 1.05, sizes.shape)
    fit = fit_fixed_plus_linear(sizes, noisy)
    # Relative weighting: the 4 KB copies (dominated by the overhead) pin the intercept, the 256 MB ones the rate.
    assert fit.fixed == pytest.approx(overhead_s, rel=0.05)
    assert fit.rate == pytest.approx(bytes_per_s, rel=0.03)
    assert fit.max_rel_residual < 0.1


def test_fit_clamps_a_negative_intercept_to_zero():
    layers = np.array([1.0, 2.0, 4.0, 8.0])
    times = np.array([0.9e-3, 2.0e-3, 4.1e-3, 8.0e-3])  # slightly convex: unconstrained intercept < 0
    fit = fit_fixed_plus_linear(layers, times)
    assert fit.fixed == 0.0
    assert fit.slope == pytest.approx(1e-3, rel=0.05)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_fixed_plus_linear(np.array([1.0]), np.array([1.0]))
    with pytest.raises(ValueError):
        fit_fixed_plus_linear(np.array([1.0, 2.0]), np.array([1.0, 0.0]))


def test_copies_of_more_bytes_take_longer():
    from tracer.calibrate.bench import Timing, copy_sweep

    timing = Timing(torch.device("cpu"), repeats=5, warmup=1, clock=time.thread_time)
    series = copy_sweep("h2d", [64 * 2**10, 16 * 2**20], timing)
    small, large = series.time_s
    assert large > 4 * small  # 256x the bytes; far more than noise


def test_overhead_grows_with_layers():
    from tracer.calibrate.bench import Timing
    from tracer.calibrate.overhead import dynamic_cache_decoder, overhead_sweeps

    timing = Timing(torch.device("cpu"), warmup=2, clock=time.thread_time)
    series = overhead_sweeps([1, 6], torch.float32, 9, timing, {"hf": dynamic_cache_decoder})["hf"].quiet
    one, six = series.time_s
    assert six > 1.5 * one


def test_calibrate_quick_writes_a_profile_the_loader_accepts(tmp_path):
    from hwprofiles import load_profile, load_profile_file

    out = tmp_path / "quick-cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    profile = load_profile_file(out)
    assert profile.name == "quick-cpu"
    assert load_profile(str(out)).link == profile.link
    prov = profile.provenance
    assert prov["kind"] == "measured" and prov["device"] == "cpu" and prov["threads"] == 1
    assert prov["clock"] == "thread_cpu" and prov["statistic"] == "median" and prov["torch"] == str(torch.__version__) and prov["date"]
    fits, figures = prov["fits"], prov["figures"]
    # The profile means what was measured (YAML rounds to 12 significant digits, provenance to 6).
    assert profile.link.h2d_bytes_per_s == pytest.approx(fits["copy_h2d"]["rate"], rel=1e-5)
    assert profile.link.transfer_overhead_s == pytest.approx(
        (fits["copy_h2d"]["fixed"] + fits["copy_d2h"]["fixed"]) / 2, rel=1e-5)
    assert profile.gpu.hbm_bytes_per_s == pytest.approx(figures["model_weights_read_bytes_per_s"], rel=1e-5)
    assert profile.gpu.matmul_flops_per_s == pytest.approx(figures["model_gemm_flops_per_s"], rel=1e-5)
    assert profile.gpu.matmul_peak_flops_per_s >= figures["gemm_flops_per_s"] * (1 - 1e-5)  # 6-digit provenance
    assert prov["overhead_decoder"] == "tiered/full"
    # Overheads = the weight-streaming sweep minus the weights' own read time at the measured bandwidth.
    cold = fits["overhead_with_weights/tiered/full"]
    bandwidth = figures["model_weights_read_bytes_per_s"]
    # ... and minus the per-token cost of the tokens its layers attended (charged per token, token_overhead_s):
    # zero when the token sweep's slope is, which is why this once held without it, on a quiet machine.
    attended = figures.get("attended_tokens/overhead_with_weights/tiered/full", 0.0)
    expected_layer = max(0.0, cold["slope"] - figures["layer_weight_bytes"] / bandwidth
                         - profile.overheads.token_overhead_s * attended)
    expected_step = max(0.0, cold["fixed"] - figures["head_weight_bytes"] / bandwidth)
    # The inputs come from provenance, rounded to 6 digits; the subtraction cancels most of them (a fixed cost of
    # ~1 ms minus ~0.95 ms of weight reads), so the 6-digit rounding shows at ~1e-8 s in the difference.
    assert profile.overheads.layer_overhead_s == pytest.approx(expected_layer, rel=1e-4, abs=2e-8)
    assert profile.overheads.step_overhead_s == pytest.approx(expected_step, rel=1e-4, abs=2e-8)
    by_decoder = prov["overheads_by_decoder"]
    assert set(by_decoder) == {"dynamic-cache", "tiered/full", "tiered/evict", "tiered/hierarchy", "tiered/hierarchy-k1"}
    # The per-token cost is swept per decoder: the scoring policies (evict, hierarchy) take evict's sweep, the
    # others the full cache's; each decoder's layer overhead is left at zero tokens by its own per-token cost.
    kv_s = figures["kv_bytes_per_token_layer"] / bandwidth
    for decoder, swept in (("dynamic-cache", "tiered/full"), ("tiered/full", "tiered/full"),
                           ("tiered/evict", "tiered/evict"), ("tiered/hierarchy", "tiered/evict"),
                           ("tiered/hierarchy-k1", "tiered/evict")):
        slope = fits[f"token_cost/{swept}"]["slope"]
        assert by_decoder[decoder]["token_overhead_s"] == pytest.approx(max(0.0, slope / 2 - kv_s), rel=1e-4, abs=1e-12)
        cold_decoder = fits[f"overhead_with_weights/{decoder}"]
        tokens = figures.get(f"attended_tokens/overhead_with_weights/{decoder}", 0.0)
        assert by_decoder[decoder]["layer_overhead_s"] == pytest.approx(max(0.0, cold_decoder["slope"] - figures[
            "layer_weight_bytes"] / bandwidth - by_decoder[decoder]["token_overhead_s"] * tokens), rel=1e-4, abs=2e-8)
    assert profile.overheads.token_overhead_s == pytest.approx(by_decoder["tiered/full"]["token_overhead_s"], rel=1e-5,
                                                               abs=1e-12)
    assert all(v["warm_layer_overhead_s"] > 0 for v in by_decoder.values())
    assert not profile.link.full_duplex  # the CPU path copies synchronously on the compute thread
    # The cached overheads: the same decoder's no-weights fit, for models that fit in the last-level cache.
    from tracer.calibrate import last_level_cache

    llc = last_level_cache()
    if llc is None:  # no Linux sysfs: all three fields are omitted
        assert not profile.overheads.has_cached
        return
    o = profile.overheads
    # The cached set applies up to the working set whose reads ran >= 2x the largest one's (at most the LLC).
    sweep = prov["series"]["working_set_read"]
    rates = [x / t for x, t in zip(sweep["x"], sweep["time_s"])]
    resident = [x for x, r in zip(sweep["x"][:-1], rates[:-1]) if r >= 2 * rates[-1]]
    if not resident:
        assert not o.has_cached
        return
    assert o.cache_bytes == pytest.approx(min(max(resident), llc[0]), rel=1e-5)  # provenance: 6 digits
    full = by_decoder["tiered/full"]
    assert o.step_overhead_cached_s == pytest.approx(full["warm_step_overhead_s"], rel=1e-4, abs=1e-9)
    assert o.layer_overhead_cached_s == pytest.approx(full["warm_layer_overhead_s"], rel=1e-4, abs=1e-9)
    raw = yaml.safe_load(out.read_text())["overheads"]
    assert raw["cache_bytes"]["unit"] == "MiB" and "/sys/devices/system/cpu/" in raw["cache_bytes"]["source"]
    assert "no weights streamed" in raw["step_overhead_cached"]["source"]
    # The placement is timed apart on the policies that move blocks (smoke: one block completes in the sweep).
    for decoder in ("tiered/evict", "tiered/hierarchy"):
        assert by_decoder[decoder]["placement_layer_overhead_s"] >= 0
    assert "placement_layer_overhead_s" not in by_decoder["tiered/full"]


def test_last_level_cache_reads_the_highest_level_from_sysfs(tmp_path):
    from tracer.calibrate import last_level_cache

    def index(i, level, kind, size):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")

    index(0, 1, "Data", "32K")
    index(1, 1, "Instruction", "32K")
    index(2, 2, "Unified", "1024K")
    assert last_level_cache(tmp_path)[0] == 2**20
    index(3, 3, "Unified", "32768K")
    n_bytes, source = last_level_cache(tmp_path)
    assert n_bytes == 32 * 2**20 and str(tmp_path / "index3" / "size") in source and "level 3" in source
    assert last_level_cache(tmp_path / "missing") is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "{tmp}/profile.txt"], "must end in .yaml"),
        (["--out", "{tmp}/Bad Name.yaml"], "profile name"),
        (["--out", "{tmp}/existing.yaml"], "exists; pass --force"),
        (["--threads", "0", "--out", "{tmp}/t.yaml"], "--threads 0"),
        (["--architecture", "nope", "--out", "{tmp}/a.yaml"], "unknown architecture"),
    ],
)
def test_calibrate_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    (tmp_path / "existing.yaml").write_text("keep me\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["calibrate", "--device", "cpu", "--smoke", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert (tmp_path / "existing.yaml").read_text() == "keep me\n"  # nothing overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.yaml"]  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_calibrate_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "g.yaml")]) == 2
    err = capsys.readouterr().err  # tracer.preflight: the one --device check, with the README's fix
    assert ("CPU build" in err and "download.pytorch.org" in err) or "sees no GPU" in err


def test_effective_cache_is_the_largest_working_set_read_twice_as_fast_as_memory():
    from tracer.calibrate import Calibration, effective_cache_bytes, plan_for

    mib = 2**20
    cal = Calibration("cpu", "cpu", "float32", 1, "tiny", plan_for("cpu", "smoke"))
    sizes = [mib * 2**i for i in range(6)]  # 1 .. 32 MiB; the last one is "memory"
    bandwidths = [50e9, 30e9, 21e9, 19e9, 12e9, 10e9]  # 21 >= 2 x 10: 4 MiB is the last resident size
    cal.series["working_set_read"] = {"x": sizes, "time_s": [x / b for x, b in zip(sizes, bandwidths)]}
    assert effective_cache_bytes(cal) == 4 * mib
    cal.series["working_set_read"]["time_s"] = [x / 10e9 for x in sizes]  # no size faster than memory
    assert effective_cache_bytes(cal) is None


def test_the_tiered_overhead_decoders_run_with_the_geometry_they_are_given():
    """A trace's per-layer cost depends on its block size and window, so calibration times its decoders with
    the runs' geometry: evict at budget 0.5 of a 105-token prompt keeps a different number of tokens with
    blocks of 4 and a 16-token window than with the defaults (16, 32), as the tracer itself would."""
    from tracer.cache import TieredCache
    from tracer.calibrate import cache_geometry, decoder_factory
    from tracer.calibrate.bench import Timing
    from tracer.calibrate.overhead import overhead_sweeps
    from tracer.decode import DecodeJob, decode_batch, use_tiered_attention
    from tracer.models import load_model
    from tracer.recorder import Recorder
    from tracer.run import TraceConfig, make_settings

    timing = Timing(torch.device("cpu"), repeats=1, warmup=1, clock=time.thread_time)
    attended = {}
    for geometry in (cache_geometry(), cache_geometry(block_size=4, window_tokens=16)):
        sweep = overhead_sweeps([1], torch.float32, 4, timing, {"evict": decoder_factory("tiered/evict", geometry)},
                                prompt_tokens=105)["evict"]
        attended[geometry["block_size"]] = sweep.attended_tokens
    assert cache_geometry() == {"block_size": 16, "sink_tokens": 4, "window_tokens": 32}
    assert attended[4] != attended[16]
    # The independent reference: the tracer's own decode of the same prompt with that geometry attends as many.
    model = load_model("random:tiny", "cpu", "float32").model
    use_tiered_attention(model)
    config = TraceConfig(model="random:tiny", task="chains", out="-", policy="evict", hbm_budget=0.5, block_size=4,
                         window_tokens=16, recall_k=4)
    recorder = Recorder()
    job = DecodeJob(0, list(range(105)), make_settings(config), recorder)
    for _ in decode_batch(model, [job], TieredCache(model.config.num_hidden_layers, job.settings), 1, 7, set()):
        pass
    import pandas as pd

    steps = pd.DataFrame(recorder.steps_table())
    timed = steps[(steps["layer"] == 0) & steps["step"].between(2, 5)]  # after the prefill and the warm-up step
    assert attended[4] == pytest.approx((timed["hbm_tokens"] + timed["recalled_tokens"]).mean())


@pytest.mark.parametrize("flag", ["--block-size", "--window-tokens"])
def test_a_bad_cache_geometry_is_one_line_and_exit_2(tmp_path, capsys, flag):
    out = tmp_path / "p.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(out), flag, "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and not out.exists()
