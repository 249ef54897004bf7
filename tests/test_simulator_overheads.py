"""The cost model's two overhead sets: a profile's cached overheads apply exactly when the model's weights fit in
the profile's last-level cache (`simulator.costs.overheads_for`), in both engines, and the results say which."""

from __future__ import annotations

import dataclasses

import pytest

from hwprofiles import OverheadSpec, load_profile
from simulator import SimOptions, simulate_run
from simulator.costs import ModelShape, head_times, layer_times, overheads_for
from simulator.synth import synth_run
from traces.architectures import get_architecture

STREAMING = (1.3e-3, 7.2e-4)  # step, layer
CACHED = (2.7e-4, 3.8e-4)


def shape_of(model: str, dtype: str = "float32") -> ModelShape:
    arch = get_architecture(model)
    weight_bytes = arch.weight_bytes(dtype)
    return ModelShape(model, arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.head_dim, arch.hidden_size,
                      arch.vocab_size, dtype, 1024, weight_bytes, arch.n_params())


def with_overheads(profile, cache_bytes: int | None):
    cached = dict(step_overhead_cached_s=CACHED[0], layer_overhead_cached_s=CACHED[1], cache_bytes=cache_bytes) \
        if cache_bytes is not None else {}
    return dataclasses.replace(profile, overheads=OverheadSpec(*STREAMING, **cached))


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200-sxm")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`tiny` in float32: 86.9 MB of weights, 6 layers."""
    return synth_run(tmp_path_factory.mktemp("ovh") / "tiny", model="tiny", prompt_tokens=48, decode_steps=6,
                     policy="full", dtype="float32", access=False)


def test_overheads_for_picks_by_weight_bytes_against_the_cache(h200):
    shape = shape_of("tiny")  # 86,936,064 B
    assert shape.weight_bytes == 86_936_064
    cases = [
        (None, "streaming", STREAMING),  # no cached set: always the streaming one
        (32 * 2**20, "streaming", STREAMING),  # 87 MB does not fit in 32 MiB
        (shape.weight_bytes - 1, "streaming", STREAMING),
        (shape.weight_bytes, "cached", CACHED),  # fits exactly
        (128 * 2**20, "cached", CACHED),
    ]
    for cache_bytes, expected_set, (step_s, layer_s) in cases:
        chosen = overheads_for(shape, with_overheads(h200, cache_bytes))
        assert (chosen.set, chosen.step_s, chosen.layer_s) == (expected_set, step_s, layer_s), cache_bytes
    datasheet = overheads_for(shape, h200)
    assert (datasheet.set, datasheet.step_s, datasheet.layer_s) == ("streaming", 0.0, 0.0)


def test_layer_and_head_times_add_the_chosen_overheads(h200):
    shape = shape_of("tiny")
    bare_layer = float(layer_times(shape, h200, 1, 100).total_s)
    bare_head = float(head_times(shape, h200).total_s)
    for cache_bytes, (step_s, layer_s) in ((32 * 2**20, STREAMING), (128 * 2**20, CACHED)):
        profile = with_overheads(h200, cache_bytes)
        assert float(layer_times(shape, profile, 1, 100).total_s) == pytest.approx(bare_layer + layer_s, rel=1e-12)
        assert float(head_times(shape, profile).total_s) == pytest.approx(bare_head + step_s, rel=1e-12)


@pytest.mark.parametrize("engine", ["des", "fast"])
@pytest.mark.parametrize("cache_mib, expected_set", [(32, "streaming"), (128, "cached")])
def test_simulated_steps_pay_the_overheads_of_the_set_that_applies(tiny_run, h200, engine, cache_mib, expected_set):
    """Closed form: every step's latency = the same step with no overheads + L x layer + step overhead."""
    n_layers = get_architecture("tiny").n_layers
    step_s, layer_s = CACHED if expected_set == "cached" else STREAMING
    bare = simulate_run(tiny_run, h200, SimOptions(engine=engine))
    result = simulate_run(tiny_run, with_overheads(h200, cache_mib * 2**20), SimOptions(engine=engine))
    expected = bare.steps["latency_s"].to_numpy() + n_layers * layer_s + step_s
    assert result.steps["latency_s"].to_numpy() == pytest.approx(expected, rel=1e-12)
    assert result.steps["overhead_s"].to_numpy() == pytest.approx(n_layers * layer_s + step_s, rel=1e-12)
    assert result.summary["overhead_set"] == expected_set
    assert set(result.samples["overhead_set"]) == {expected_set}
    assert bare.summary["overhead_set"] == "streaming"


def test_a_run_is_charged_the_overheads_calibrated_for_its_own_policy(tmp_path):
    """simulate_run takes the per-policy overheads from provenance: a hierarchy trace on a profile whose
    hierarchy path costs 1 ms more per layer takes exactly n_layers x 1 ms more per step than on the same
    profile without per-policy calibration (transfers and everything else equal)."""
    run_dir = tmp_path / "h"
    synth_run(run_dir, model="qwen2-1.5b", prompt_tokens=64, decode_steps=8, policy="hierarchy", hbm_budget=0.5,
              recall_k=2, samples=1, seed=0)
    base = load_profile("h100-pcie")
    by_decoder = {"tiered/hierarchy": {"step_overhead_s": base.overheads.step_overhead_s,
                                       "layer_overhead_s": base.overheads.layer_overhead_s + 1e-3}}
    calibrated = dataclasses.replace(base, provenance={"kind": "measured", "overheads_by_decoder": by_decoder})
    plain = simulate_run(run_dir, base)
    per_policy = simulate_run(run_dir, calibrated)
    assert plain.samples["overhead_source"].iloc[0].startswith("profile overheads")
    assert per_policy.samples["overhead_source"].iloc[0] == "tiered/hierarchy"
    n_layers = get_architecture("qwen2-1.5b").n_layers
    steps = int(per_policy.samples["steps"].iloc[0])
    extra = per_policy.samples["total_s"].iloc[0] - plain.samples["total_s"].iloc[0]
    assert extra == pytest.approx(steps * n_layers * 1e-3, rel=1e-9)


def test_the_token_overhead_is_charged_per_token_of_kv_a_layer_step_reads_or_writes(h200):
    shape = shape_of("tiny")
    token_s = 1.5e-7
    profile = dataclasses.replace(h200, overheads=OverheadSpec(*STREAMING, token_overhead_s=token_s))
    for query, attended, batch in ((1, 100, 1), (1, 900, 4), (64, 64, 1)):
        bare = float(layer_times(shape, with_overheads(h200, None), query, attended, batch).total_s)
        charged = float(layer_times(shape, profile, query, attended, batch).total_s)
        assert charged - bare == pytest.approx(token_s * batch * (attended + query), rel=1e-9)


def hierarchy_on_calibrated(tmp_path, recall_k: int, seed: int, layer_overhead_s: dict[str, float],
                            placement_layer_overhead_s: float | None = None):
    """A synthetic qwen2-1.5b hierarchy run (50% HBM, 40 steps) and h100-pcie with and without per-decoder
    calibration (`layer_overhead_s` per decoder; the placement overhead on the hierarchy's, when given)."""
    run_dir = tmp_path / "h"
    synth_run(run_dir, model="qwen2-1.5b", prompt_tokens=64, decode_steps=40, policy="hierarchy", hbm_budget=0.5,
              recall_k=recall_k, samples=1, seed=seed)
    base = load_profile("h100-pcie")
    by_decoder = {name: {"step_overhead_s": base.overheads.step_overhead_s, "layer_overhead_s": value}
                  for name, value in layer_overhead_s.items()}
    if placement_layer_overhead_s is not None:
        by_decoder["tiered/hierarchy"]["placement_layer_overhead_s"] = placement_layer_overhead_s
    calibrated = dataclasses.replace(base, provenance={"kind": "measured", "overheads_by_decoder": by_decoder})
    return run_dir, base, calibrated


@pytest.mark.parametrize("engine", ["des", "fast"])
def test_placement_and_recall_overheads_are_charged_where_the_trace_moved_and_recalled(tmp_path, engine):
    """A hierarchy trace on a profile whose calibration says: evict decoder X per layer, hierarchy X + R (its
    sweep recalls every step), placement P. Independently of the cost model: the extra time over the same profile
    without per-policy calibration is R per layer-step whose row recalled (bytes_h2d > 0) + P per layer-step whose
    row lists moved blocks + (X - the profile's own layer overhead) per layer-step."""
    import numpy as np

    from traces import open_run

    x, r, p = 2e-4, 3e-4, 5e-4
    run_dir, base, calibrated = hierarchy_on_calibrated(tmp_path, recall_k=2, seed=0, layer_overhead_s={
        "tiered/evict": x, "tiered/hierarchy": x + r}, placement_layer_overhead_s=p)
    plain = simulate_run(run_dir, base, SimOptions(engine=engine))
    charged = simulate_run(run_dir, calibrated, SimOptions(engine=engine))
    steps = open_run(run_dir).steps()
    recalled = int((steps["bytes_h2d"] > 0).sum())
    moved = int(sum(len(a) + len(b) + len(c) > 0 for a, b, c in zip(
        steps["offloaded_block_ids"], steps["evicted_block_ids"], steps["promoted_block_ids"])))
    assert 0 < recalled < len(steps) and 0 < moved < len(steps)  # the test must see both kinds of step
    expected = recalled * r + moved * p + len(steps) * (x - base.overheads.layer_overhead_s)
    extra = charged.samples["total_s"].iloc[0] - plain.samples["total_s"].iloc[0]
    assert extra == pytest.approx(expected, rel=1e-9)
    assert np.isfinite(charged.steps["latency_s"]).all()


def test_step_arrays_count_the_blocks_each_row_moved():
    import pandas as pd

    from simulator.workload import NUMERIC_STEP_COLUMNS, step_arrays

    rows = []
    for step in range(2):
        for layer in range(2):
            row = {c: 1.0 for c in NUMERIC_STEP_COLUMNS}
            row.update(step=step, layer=layer, offloaded_block_ids=[3] * (step + layer), evicted_block_ids=[],
                       promoted_block_ids=[5] if layer == 1 else [])
            rows.append(row)
    arrays = step_arrays(pd.DataFrame(rows), 2)
    assert arrays.moved_blocks.tolist() == [[0, 2], [1, 3]]
    no_ids = step_arrays(pd.DataFrame(rows).drop(columns=["offloaded_block_ids", "evicted_block_ids",
                                                          "promoted_block_ids"]), 2)
    assert no_ids.moved_blocks.tolist() == [[0, 0], [0, 0]]


def test_a_recall_costs_its_fixed_part_plus_a_part_per_recalled_block(tmp_path):
    """Calibration's hierarchy decoders recall 4 and 1 blocks a layer-step: hierarchy X + R4, hierarchy-k1
    X + R1 over evict X. A trace's layer-step recalling n blocks then pays (R1 - b) + n b with b = (R4 - R1) / 3,
    counted here from the trace's own recalled_block_ids."""
    from traces import open_run

    x, r4, r1 = 2e-4, 5e-4, 2e-4
    run_dir, base, calibrated = hierarchy_on_calibrated(tmp_path, recall_k=3, seed=1, layer_overhead_s={
        "tiered/evict": x, "tiered/hierarchy": x + r4, "tiered/hierarchy-k1": x + r1})
    plain = simulate_run(run_dir, base)
    charged = simulate_run(run_dir, calibrated)
    steps = open_run(run_dir).steps()
    per_block = (r4 - r1) / 3
    blocks = [len(ids) for ids in steps["recalled_block_ids"]]
    assert len({b for b in blocks if b}) >= 2  # layer-steps recall different numbers of blocks
    expected = sum((r1 - per_block) + per_block * b for b in blocks if b) + len(steps) * (x - base.overheads.layer_overhead_s)
    extra = charged.samples["total_s"].iloc[0] - plain.samples["total_s"].iloc[0]
    assert extra == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("engine", ["des", "fast"])
def test_a_scoring_policy_is_charged_its_own_decoders_per_token_cost(tmp_path, engine):
    """Calibration sweeps the per-token cost per decoder (evict scores every attended token; the full cache
    does not): a hierarchy trace takes evict's, not the profile's global one. With evict's T and the profile's
    0, the extra time is T per token each layer-step read or wrote, counted from the trace's own columns."""
    from traces import open_run

    token_s = 2e-7
    run_dir, base, calibrated = hierarchy_on_calibrated(tmp_path, recall_k=2, seed=0, layer_overhead_s={
        "tiered/evict": 2e-4, "tiered/hierarchy": 5e-4})
    assert base.overheads.token_overhead_s == 0
    by_decoder = calibrated.provenance["overheads_by_decoder"]
    with_tokens = dataclasses.replace(calibrated, provenance={"kind": "measured", "overheads_by_decoder": {
        **by_decoder, "tiered/evict": {**by_decoder["tiered/evict"], "token_overhead_s": token_s},
        "tiered/hierarchy": {**by_decoder["tiered/hierarchy"], "token_overhead_s": 9e-7}}})  # not the base: unused
    plain = simulate_run(run_dir, calibrated, SimOptions(engine=engine))
    charged = simulate_run(run_dir, with_tokens, SimOptions(engine=engine))
    steps = open_run(run_dir).steps()
    tokens = float((steps["hbm_tokens"] + steps["recalled_tokens"] + steps["query_tokens"]).sum())
    extra = charged.samples["total_s"].iloc[0] - plain.samples["total_s"].iloc[0]
    assert extra == pytest.approx(token_s * tokens, rel=1e-9)


def test_a_profile_timed_with_another_cache_geometry_is_named_in_one_warning(tmp_path):
    """A measured profile records the block size, window and sinks its tiered decoders ran with; simulating a
    run with other ones says so, in one line that gives the calibrate flags, and the same geometry says nothing."""
    from traces import open_run

    run_dir, base, calibrated = hierarchy_on_calibrated(tmp_path, recall_k=2, seed=0, layer_overhead_s={
        "tiered/evict": 2e-4, "tiered/hierarchy": 5e-4})
    policy = open_run(run_dir).manifest["policy"]
    same = {k: policy[k] for k in ("block_size", "sink_tokens", "window_tokens")}
    other = {**same, "block_size": same["block_size"] * 4}
    for geometry, expected in ((same, 0), (other, 1)):
        profile = dataclasses.replace(calibrated, provenance={**calibrated.provenance, "cache_geometry": geometry})
        warnings = simulate_run(run_dir, profile).warnings
        geometry_lines = [w for w in warnings if "timed its tiered decoders" in w]
        assert len(geometry_lines) == expected
        if expected:
            line = geometry_lines[0]
            assert "\n" not in line and f"block size {other['block_size']}" in line
            assert f"--block-size {same['block_size']}" in line
        # Modes that do not charge the measured overheads have nothing to warn about.
        assert not [w for w in simulate_run(run_dir, profile, SimOptions(overhead_mode="kernel-only")).warnings
                    if "timed its tiered decoders" in w]
