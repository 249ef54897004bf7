"""Framework-overhead modes: the shipped hf-eager estimate is held to the measurement it cites."""

from __future__ import annotations

import pytest

from hwprofiles import ProfileError
from hwprofiles.overhead_modes import OVERHEAD_MODES, check_mode, load_estimate


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hf_eager_launch_counts_are_what_a_transformers_decode_step_launches(family):
    from tracer.calibrate.launches import launches_per_decode_step

    measured = launches_per_decode_step(family)
    estimate = load_estimate("hf-eager")
    assert estimate.launches_per_layer == measured["per_layer"]
    assert estimate.launches_per_step == measured["per_step"]


def test_hf_eager_estimate_cites_every_number_and_is_in_seconds():
    estimate = load_estimate("hf-eager")
    assert all(len(source) > 40 for source in estimate.sources.values())
    assert 1e-6 < estimate.launch_overhead_s < 1e-5  # a few microseconds per launch
    assert estimate.layer_overhead_s == pytest.approx(estimate.launches_per_layer * estimate.launch_overhead_s)


def test_unknown_modes_are_one_line_errors():
    assert check_mode(None) is None and [check_mode(m) for m in OVERHEAD_MODES] == list(OVERHEAD_MODES)
    with pytest.raises(ProfileError, match="--overhead-mode 'eager'"):
        check_mode("eager")
    with pytest.raises(ProfileError, match="no estimate file"):
        load_estimate("kernel-only")


def test_apply_mode_sets_overheads_and_labels_the_profile():
    from hwprofiles import load_profile
    from hwprofiles.overhead_modes import apply_mode, mode_of

    datasheet = load_profile("h200-sxm")
    assert mode_of(datasheet) == "kernel-only" and datasheet.overheads.layer_overhead_s == 0
    eager = apply_mode(datasheet, "hf-eager")
    estimate = load_estimate("hf-eager")
    assert mode_of(eager) == "hf-eager"
    assert eager.overheads.layer_overhead_s == pytest.approx(estimate.launches_per_layer * estimate.launch_overhead_s)
    assert eager.overheads.step_overhead_s == pytest.approx(estimate.launches_per_step * estimate.launch_overhead_s)
    assert mode_of(apply_mode(eager, "kernel-only")) == "kernel-only"
    assert apply_mode(eager, "kernel-only").overheads.layer_overhead_s == 0
    with pytest.raises(ProfileError, match="no measured overheads"):
        apply_mode(datasheet, "measured")
