"""Calibration writes the measured copy curves (tracer/calibrate build_profile) and the simulator's DMA copies
then follow them (simulator/mechanisms.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hwprofiles import load_profile_file
from simulator import mechanisms
from simulator.costs import ModelShape
from thoughtkv.cli import main
from traces.manifest import model_manifest


def test_calibration_writes_copy_curves_the_cost_model_interpolates(tmp_path):
    out = tmp_path / "curve-cpu.yaml"
    assert main(["calibrate", "--device", "cpu", "--smoke", "--out", str(out)]) == 0
    profile = load_profile_file(out)
    series = profile.provenance["series"]  # the raw sweeps (6 significant digits)
    ctx = mechanisms.context(profile, ModelShape.from_manifest(model_manifest("tiny")))
    for direction in ("h2d", "d2h"):
        curve = profile.transfer.curve(f"{direction}_pinned")
        assert curve is not None and len(curve.bytes) >= 2
        assert all(b > a for a, b in zip(curve.bytes, curve.bytes[1:]))
        assert all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:]))  # non-decreasing
        measured = np.maximum.accumulate(np.asarray(series[f"copy_{direction}"]["time_s"], dtype=float))
        np.testing.assert_allclose(curve.seconds, measured, rtol=1e-5)
        np.testing.assert_allclose(curve.bytes, series[f"copy_{direction}"]["x"], rtol=1e-5)
        # at a measured size a DMA copy costs the measured time, between sizes the interpolation
        dma = mechanisms.get_mechanism("dma-per-block")
        assert dma.copy_s(ctx, direction, curve.bytes[1]) == pytest.approx(curve.seconds[1], rel=1e-12)
        middle = (curve.bytes[0] + curve.bytes[1]) / 2
        assert dma.copy_s(ctx, direction, middle) == pytest.approx((curve.seconds[0] + curve.seconds[1]) / 2,
                                                                   rel=1e-12)
    assert "made non-decreasing in size" in out.read_text()  # the curve's source says what was done to it


def test_pageable_sweeps_become_pageable_curves_next_to_the_pinned_ones():
    """On CUDA calibration also times pageable host memory (`copy_sweep(..., pinned=False)`); every sweep it has
    becomes its curve, made non-decreasing. Here the sweeps run on the CPU path (the same code, no pinning)."""
    import time

    import torch

    from tracer.calibrate import Calibration, copy_curves, plan_for
    from tracer.calibrate.bench import Timing, copy_sweep

    timing = Timing(torch.device("cpu"), repeats=3, warmup=1, clock=time.thread_time)
    cal = Calibration("cuda", "test", "float32", 1, "tiny", plan_for("cpu", "smoke"))
    sizes = [4096, 65536, 2**20]
    for direction in ("h2d", "d2h"):
        for pinned in (True, False):
            series = copy_sweep(direction, sizes, timing, pinned=pinned)
            cal.series[series.name] = {"x": series.x, "time_s": series.time_s}
    assert set(cal.series) == {"copy_h2d", "copy_d2h", "copy_h2d_pageable", "copy_d2h_pageable"}
    curves = dict(copy_curves(cal))
    assert set(curves) == {"h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"}
    for key, curve in curves.items():
        direction, memory = key.split("_")
        raw = cal.series[f"copy_{direction}" + ("" if memory == "pinned" else "_pageable")]["time_s"]
        assert list(curve.seconds) == list(np.maximum.accumulate(raw))
    del cal.series["copy_h2d_pageable"], cal.series["copy_d2h_pageable"]
    assert set(dict(copy_curves(cal))) == {"h2d_pinned", "d2h_pinned"}  # the CPU profile: pinned only


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_calibration_writes_pageable_curves(tmp_path):
    out = tmp_path / "curve-cuda.yaml"
    assert main(["calibrate", "--device", "cuda", "--smoke", "--out", str(out)]) == 0
    profile = load_profile_file(out)
    for direction in ("h2d", "d2h"):
        assert profile.transfer.curve(f"{direction}_pageable") is not None
