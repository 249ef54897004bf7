"""serve-sim projected to another model's shapes and served with a request-length model (simulator/project.py,
simulator/lengths.py): one request at a time (rate -> 0) is exactly `simulate --as-model`'s replay of its sample,
the serving fast path equals the DES under the new options, and the length classes carry the cited means."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _helpers import assert_same

from hwprofiles import load_profile
from simulator import simulate_run
from simulator.costs import ModelShape
from simulator.errors import ProjectionError
from simulator.lengths import LENGTH_MODELS, N_CLASSES
from simulator.options import LENGTH_MODELS as LENGTH_MODEL_NAMES
from simulator.options import OptionError, Projection, ServingConfig, SimOptions
from simulator.project import project_arrays, step_map
from simulator.serving import ServingError, simulate_serving
from simulator.workload import STEP_COLUMNS, step_arrays
from traces import open_run

MICRO = Path(__file__).resolve().parents[1] / "traces" / "samples" / "micro-hierarchy-b30-e0"


def token_times(result, request) -> np.ndarray:
    """A served request's token times, from its first token and its TBT slice (tbt_s is request-ordered)."""
    start = int(result.requests.loc[result.requests["request"] < request["request"], "tokens"].sub(1).sum())
    tbt = result.tbt_s[start:start + int(request["tokens"]) - 1]
    return request["first_token_s"] + np.concatenate([[0.0], np.cumsum(tbt)])


@pytest.mark.parametrize("profile_name", ["h100-pcie", "gh200-96gb"])
@pytest.mark.parametrize("mode", ["kernel-only", "cuda-graphs", "hf-eager"])
@pytest.mark.parametrize("projection", [Projection("qwen2-7b"), Projection("llama3-8b", "float16", 3.0, "count")])
def test_one_request_at_a_time_is_simulate_as_model(profile_name, mode, projection):
    """Poisson arrivals so sparse that no two requests overlap (rate -> 0): each request's token times are
    simulate_run's step end times for its sample under the same projection, to 1e-9, and so are its bytes."""
    options = SimOptions(overhead_mode=mode)
    config = ServingConfig(rate_per_s=1e-3, duration_s=6000.0, seed=3, options=options, projection=projection)
    served = simulate_serving(MICRO, profile_name, config)
    replay = simulate_run(MICRO, profile_name, options, projection=projection)
    assert served.summary["n_requests"] >= 3 and served.summary["max_concurrency"] == 1
    assert served.summary["model"] == projection.shape.name and served.summary["result_kind"] == "projected"
    assert served.summary["as_model"] == projection.as_model and served.summary["context_scale"] == projection.context_scale
    bytes_h2d = 0.0
    for _, request in served.requests.iterrows():
        steps = replay.steps[replay.steps["sample_id"] == request["sample_id"]].sort_values("step")
        expected = request["arrival_s"] + np.cumsum(steps["latency_s"].to_numpy())
        np.testing.assert_allclose(token_times(served, request), expected, rtol=1e-9)
        bytes_h2d += replay.samples.set_index("sample_id").loc[request["sample_id"], "bytes_h2d"]
    assert served.summary["bytes_h2d"] == pytest.approx(bytes_h2d, rel=1e-12)


def test_no_projection_is_the_traced_run():
    """Projection() (no --as-model) changes nothing: the same summary as before the option existed."""
    config = ServingConfig(rate_per_s=40.0, duration_s=1.0, seed=1)
    plain = simulate_serving(MICRO, "h100-pcie", config)
    assert plain.summary["result_kind"] == "traced" and plain.summary["as_model"] is None
    explicit = simulate_serving(MICRO, "h100-pcie", dataclasses.replace(config, projection=Projection()))
    assert_same(plain.summary, explicit.summary)


# ---------------------------------------------------------------- fast path = DES ----------------------------


def squeezed(profile_name: str, requests_in_hbm: float, config: ServingConfig):
    """The profile with HBM for the weights + that many of the largest served requests' peak KV (admission
    queues), or as shipped (None)."""
    profile = load_profile(profile_name)
    if requests_in_hbm is None:
        return profile
    from simulator.serving import load_run_work

    _, shape, works = load_run_work(MICRO, profile, projection=config.projection, lengths=config.lengths,
                                    seed=config.seed)
    peak = max(w.peak_hbm_kv_bytes for w in works)
    gpu = dataclasses.replace(profile.gpu, hbm_capacity_bytes=int(shape.weight_bytes + requests_in_hbm * peak))
    return dataclasses.replace(profile, gpu=gpu)


@pytest.mark.parametrize("case", [
    dict(projection=Projection("qwen2-7b"), lengths="r1-7b/gsm8k", profile="h100-pcie", hbm=None, mode="cuda-graphs",
         rate=6.0, transfer="dma-per-block", overlap="none"),
    dict(projection=Projection("qwen2-7b"), lengths="r1-7b/gsm8k", profile="gh200-96gb", hbm=3.5,
         mode="kernel-only", rate=10.0, transfer="dma-batched", overlap="none"),
    dict(projection=Projection("qwen2-1.5b", "float16", 2.0, "count"), lengths=None, profile="h100-pcie", hbm=2.5,
         mode="hf-eager", rate=30.0, transfer="dma-per-block", overlap="none"),
    dict(projection=Projection(), lengths="r1-7b/math-500", profile="gh200-96gb", hbm=None, mode="cuda-graphs",
         rate=5.0, transfer="zero-copy", overlap="none"),
], ids=["7b-gsm8k-pcie", "7b-gsm8k-c2c-squeezed", "1.5b-scale2-count-squeezed", "micro-math500-zero-copy"])
def test_fast_path_equals_the_des_projected(case):
    config = ServingConfig(rate_per_s=case["rate"], duration_s=1.5, seed=7, max_batch=32, lengths=case["lengths"],
                           projection=case["projection"],
                           options=SimOptions(overhead_mode=case["mode"], transfer=case["transfer"],
                                              overlap=case["overlap"]))
    profile = squeezed(case["profile"], case["hbm"], config)
    des = simulate_serving(MICRO, profile, dataclasses.replace(
        config, options=dataclasses.replace(config.options, engine="des")))
    fast = simulate_serving(MICRO, profile, dataclasses.replace(
        config, options=dataclasses.replace(config.options, engine="fast")))
    assert des.summary["n_requests"] > 3 and des.summary["tokens"] > 0
    if case["hbm"] is not None:  # admission pressure exercised: requests waited for HBM
        assert des.summary["queue_delay_p99_s"] > 0
    assert_same(des.summary, fast.summary)
    # link_wait_s sums differences of clock readings of ~1 s (7B iterations): its float noise is ~1e-12 s, which
    # is above 1e-9 of a wait of 1e-4 s; every other column holds at 1e-9 relative.
    pd.testing.assert_frame_equal(des.requests, fast.requests, rtol=1e-9, atol=1e-11)
    pd.testing.assert_frame_equal(des.timeline, fast.timeline, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(des.tbt_s, fast.tbt_s, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- the length model ---------------------------


def test_length_model_names_are_the_options_choices():
    assert tuple(LENGTH_MODELS) == LENGTH_MODEL_NAMES


@pytest.mark.parametrize("name", list(LENGTH_MODELS))
def test_length_classes_carry_the_cited_mean(name):
    model = LENGTH_MODELS[name]
    classes = model.classes()
    outputs = np.array([o for _, o in classes])
    assert len(classes) == N_CLASSES and (np.diff(outputs) >= 0).all()
    assert outputs.mean() == pytest.approx(model.mean_output_tokens, abs=0.5)  # rounding to whole tokens
    assert outputs.max() <= model.max_output_tokens and outputs.min() >= 1
    assert {p for p, _ in classes} == {model.prompt_tokens}
    assert outputs.max() / outputs.min() > 4  # a distribution, not one length


def test_served_requests_follow_the_length_classes():
    """Each request generates one class's output tokens (as many tokens as steps), the classes' prompts; the
    share of requests per class is uniform (chi-square far below its 0.1% point)."""
    config = ServingConfig(rate_per_s=400.0, duration_s=2.0, seed=5, lengths="r1-7b/gsm8k",
                           projection=Projection("qwen2-7b"))
    served = simulate_serving(MICRO, "h200-sxm", config)
    outputs = [o for _, o in LENGTH_MODELS["r1-7b/gsm8k"].classes()]
    requests = served.requests
    assert set(requests["tokens"]) <= set(outputs) and (requests["prompt_tokens"] == 128).all()
    counts = requests["tokens"].map({o: i for i, o in enumerate(outputs)}).value_counts().reindex(
        range(len(outputs)), fill_value=0).to_numpy()
    expected = len(requests) / len(outputs)
    assert ((counts - expected) ** 2 / expected).sum() < 37.7  # chi2(15 dof) 99.9% point
    assert served.summary["lengths"] == "r1-7b/gsm8k" and served.summary["result_kind"] == "projected"


def test_resampling_to_the_traced_lengths_is_the_identity():
    """lengths = the sample's own (prompt, steps): the same arrays as projecting without resampling."""
    run = open_run(MICRO)
    shape = ModelShape.from_manifest(run.manifest["model"])
    sample = run.samples().iloc[0]
    grid = step_arrays(run.steps(sample["sample_id"], columns=list(STEP_COLUMNS)), shape.n_layers)
    target = Projection("qwen2-7b").shape
    plain = project_arrays(grid, shape, target)
    resampled = project_arrays(grid, shape, target, lengths=(int(sample["prompt_tokens"]), len(grid.query_tokens)))
    for key, value in vars(plain).items():
        np.testing.assert_array_equal(getattr(resampled, key), value, err_msg=key)


@pytest.mark.parametrize("source,target", [(165, 165), (165, 40), (12, 700), (1, 5), (5, 1), (2, 2)])
def test_step_map_keeps_relative_positions(source, target):
    rows = step_map(source, target)
    assert len(rows) == target and rows[0] == 0 and (np.diff(rows) >= 0).all()
    assert rows.max() <= source - 1
    if target > 1 and source > 1:
        assert rows[-1] == source - 1  # the last step replays the last traced step
        assert (rows[1:] >= 1).all()  # decode steps replay decode steps, never the prefill
        if target >= source:
            assert set(rows[1:]) == set(range(1, source))  # every traced decode step is used
        j = np.arange(1, target)
        assert np.all(np.abs(rows[1:] / (source - 1) - j / (target - 1)) <= 1 / (source - 1) + 1e-12)


def test_length_scaled_bytes_grow_with_the_length():
    """A request twice as long moves about twice the bytes per step at the end of its decode (shares of a longer
    context), and its KV peak is prompt + output tokens x the shares."""
    run = open_run(MICRO)
    shape = ModelShape.from_manifest(run.manifest["model"])
    sample = run.samples().iloc[0]
    grid = step_arrays(run.steps(sample["sample_id"], columns=list(STEP_COLUMNS)), shape.n_layers)
    target = Projection("qwen2-7b").shape
    short = project_arrays(grid, shape, target, lengths=(100, 400))
    long = project_arrays(grid, shape, target, lengths=(200, 800))
    assert long.logical_len[-1, 0] == 999 and short.logical_len[-1, 0] == 499
    assert long.hbm_kv_bytes[-1].sum() == pytest.approx(999 / 499 * short.hbm_kv_bytes[-1].sum(), rel=1e-12)


# ---------------------------------------------------------------- refusals -----------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(lengths="r1-7b/unknown"), "lengths 'r1-7b/unknown' is unknown"),
    (dict(lengths="r1-7b/gsm8k", arrivals_csv="a.csv"), "--lengths draws"),
    (dict(lengths="r1-7b/gsm8k", projection=Projection("qwen2-7b", context_scale=2.0)), "drop --context-scale"),
])
def test_bad_serving_projection_options_are_one_line(change, message):
    with pytest.raises(OptionError, match=message) as info:
        ServingConfig(**change)
    assert "\n" not in str(info.value)


def test_projection_flags_refused_alike_in_both_commands():
    import argparse

    from simulator import cli, serving_cli
    from simulator.options import from_args

    for module in (cli, serving_cli):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        with pytest.raises(ProjectionError, match="go with --as-model"):
            from_args(parser.parse_args(["RUN", "--context-scale", "2"]), Projection)
        with pytest.raises(ProjectionError, match="not a known architecture"):
            from_args(parser.parse_args(["RUN", "--as-model", "gpt5"]), Projection)
    with pytest.raises(ServingError):  # a ProjectionError is serve-sim's error too (exit 2, one line)
        Projection(context_scale=0.5)


def test_grids_take_the_projection_and_lengths_keys():
    """A serve grid with as_model / lengths axes: one cell per value, each carrying one Projection and the length
    model through the worker's dict round trip, its result projected; a simulate grid takes as_model too."""
    import io

    from simulator.sweep import cell_from_dict, cell_to_dict, grid_from_dict, run_cell_to_parquet

    grid = grid_from_dict({"kind": "serve", "runs": [str(MICRO)], "profiles": ["h100-pcie"], "as_model": "qwen2-7b",
                           "lengths": ["r1-7b/gsm8k", "r1-7b/math-500"], "rate_per_s": 5, "duration_s": 1},
                          base_dir=Path("."), where="grid")
    assert [c.config.lengths for c in grid.cells] == ["r1-7b/gsm8k", "r1-7b/math-500"]
    assert all(c.config.projection == Projection("qwen2-7b") for c in grid.cells)
    assert all(cell_from_dict(cell_to_dict(c)) == c for c in grid.cells)
    result = pd.read_parquet(io.BytesIO(run_cell_to_parquet(cell_to_dict(grid.cells[0]), "k")))
    assert result["as_model"].iloc[0] == "qwen2-7b" and result["lengths"].iloc[0] == "r1-7b/gsm8k"
    simulate = grid_from_dict({"kind": "simulate", "runs": [str(MICRO)], "profiles": ["h100-pcie"],
                               "as_model": "qwen2-7b", "context_scale": [1, 2]}, base_dir=Path("."), where="grid")
    assert [c.projection.context_scale for c in simulate.cells] == [1, 2]
    assert cell_from_dict(cell_to_dict(simulate.cells[1])) == simulate.cells[1]
    with pytest.raises(Exception, match="go with --as-model"):
        grid_from_dict({"kind": "simulate", "runs": [str(MICRO)], "profiles": ["h100-pcie"], "context_scale": 2},
                       base_dir=Path("."), where="grid")
