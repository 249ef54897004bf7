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
