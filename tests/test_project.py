"""Projection to other model shapes (simulator/project.py, `simulate --as-model`): a micro-model run projected to
qwen2-7b equals, to 1e-9, a 7B trace written independently here with the same per-step fractions."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from simulator import simulate_run
from simulator.errors import ProjectionError
from simulator.options import Projection, SimOptions
from simulator.project import layer_map
from traces import TraceWriter, model_manifest, open_run

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "samples"
MICRO = SAMPLES / "micro-hierarchy-b30-e0"
COMPARED = ("total_s", "prefill_s", "decode_s", "ms_per_token", "compute_s", "hbm_s", "overhead_s", "link_stall_s",
            "bytes_h2d", "bytes_d2h", "peak_hbm_bytes", "peak_ddr_bytes", "kv_bytes_per_seq_full",
            "kv_hbm_bytes_per_seq", "kv_ddr_bytes_per_seq", "max_concurrency_full", "max_concurrency_policy",
            "max_concurrency_ddr")


def synthetic_7b(source: Path, out: Path, n_samples: int = 3) -> Path:
    """The source run's per-step shares of each tier, written as a qwen2-7b (bf16) trace: target layer l copies
    source layer l * L_src // 28; every token column is share x logical length (the traced lengths), every byte
    column the same tokens x the 7B's KV bytes per token and layer."""
    run = open_run(source)
    manifest = json.loads((source / "run.json").read_text())
    src_kvpl = manifest["model"]["kv_bytes_per_token"] / manifest["model"]["n_layers"]
    model = model_manifest("qwen2-7b", dtype="bfloat16")
    tgt_layers, tgt_kvpl = model["n_layers"], model["kv_bytes_per_token"] // model["n_layers"]
    sample_ids = run.sample_ids()[:n_samples]
    manifest.update(kind="synthetic", model=model, access={"enabled": False, **{k: v for k, v in
                                                                                manifest["access"].items()
                                                                                if k != "enabled"}})
    manifest["task"] = dict(manifest["task"], sample_ids=sample_ids)
    writer = TraceWriter(out, manifest)
    samples = run.samples().set_index("sample_id")
    for sample_id in sample_ids:
        steps = run.steps(sample_id).sort_values(["step", "layer"])
        n_src = manifest_layers = int(steps["layer"].max()) + 1
        assert manifest_layers == 3
        rows = []
        for step, group in steps.groupby("step", sort=True):
            group = group.set_index("layer")
            length = float(group["logical_len"].iloc[0])
            for layer in range(tgt_layers):
                src = group.loc[layer * n_src // tgt_layers]
                share = {c: float(src[c]) / length for c in ("hbm_tokens", "ddr_tokens", "recalled_tokens",
                                                             "evicted_tokens")}
                byte_share = {c: float(src[c]) / src_kvpl / length for c in ("bytes_h2d", "bytes_d2h", "hbm_kv_bytes",
                                                                           "ddr_kv_bytes")}
                row = {c: src[c] for c in steps.columns if c not in ("sample_id", "layer")}
                row.update(step=step, layer=layer, logical_len=int(length),
                           **{c: int(round(v * length)) for c, v in share.items()},
                           **{c: int(round(v * length * tgt_kvpl)) for c, v in byte_share.items()})
                rows.append(row)
        columns = {c: [r[c] for r in rows] for c in rows[0]}
        sample = samples.loc[sample_id].to_dict()
        sample["sample_id"] = sample_id
        sample.pop("sample_index", None)
        writer.write_sample(sample, columns, run.tokens(sample_id).drop(columns=["sample_id"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    micro = root / "micro"
    shutil.copytree(MICRO, micro)
    return micro, synthetic_7b(micro, root / "synth-7b")


@pytest.mark.parametrize("profile", ["h100-pcie", "gh200-96gb"])
@pytest.mark.parametrize("transfer", ["dma-per-block", "zero-copy"])
def test_projected_micro_run_equals_the_synthetic_7b(runs, profile, transfer):
    micro, synth = runs
    options = SimOptions(transfer=transfer)
    n = len(open_run(synth).sample_ids())
    projected = simulate_run(micro, profile, options, projection=Projection("qwen2-7b"))
    reference = simulate_run(synth, profile, options)
    got = projected.samples.iloc[:n]
    want = reference.samples
    assert (got["result_kind"] == "projected").all()
    assert got["run_label"].str.endswith("[as qwen2-7b bfloat16]").all() and micro.name in got["run_label"].iloc[0]
    assert (got["model"] == want["model"]).all()
    for column in COMPARED:
        for a, b in zip(got[column], want[column]):
            if a is None or (isinstance(a, float) and math.isnan(a)):
                assert b is None or math.isnan(b), column
            else:
                assert math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12), (column, a, b)


def test_layers_map_proportionally_and_bad_projections_are_one_line_errors():
    assert layer_map(3, 28).tolist() == [0] * 10 + [1] * 9 + [2] * 9
    assert layer_map(28, 28).tolist() == list(range(28))
    with pytest.raises(ProjectionError, match="--as-model 'gpt5' is not a known architecture; use one of qwen2-7b"):
        Projection("gpt5")
    with pytest.raises(ProjectionError, match="--context-scale 0 must be a number > 0"):
        Projection("qwen2-7b", context_scale=0)
    with pytest.raises(ProjectionError, match="--as-dtype 'int3' is unknown"):
        Projection("qwen2-7b", as_dtype="int3")


def test_context_scale_scales_lengths_and_bytes(runs):
    micro, _ = runs
    one = simulate_run(micro, "h100-pcie", projection=Projection("qwen2-7b")).samples.iloc[0]
    four = simulate_run(micro, "h100-pcie", projection=Projection("qwen2-7b", context_scale=4)).samples.iloc[0]
    assert four["kv_bytes_per_seq_full"] == pytest.approx(4 * one["kv_bytes_per_seq_full"], rel=1e-9)
    assert four["bytes_h2d"] == pytest.approx(4 * one["bytes_h2d"], rel=1e-6)
    assert four["ms_per_token"] > one["ms_per_token"]
    assert "context x4" in four["run_label"]
    assert np.isfinite(four["total_s"])


def test_simulate_cli_as_model_and_transfer(runs, tmp_path, capsys):
    import pandas as pd

    from thoughtkv.cli import main

    micro, _ = runs
    out = tmp_path / "sim"
    assert main(["simulate", str(micro), "--profile", "gh200-96gb", "--transfer", "zero-copy", "--as-model",
                 "qwen2-7b", "--out", str(out)]) == 0
    summary = pd.read_parquet(out / "summary.parquet").iloc[0]
    assert summary["result_kind"] == "projected" and summary["transfer"] == "zero-copy"
    assert summary["run_label"].endswith("[as qwen2-7b bfloat16]")
    capsys.readouterr()
    assert main(["simulate", str(micro), "--profile", "h100-pcie", "--context-scale", "2", "--out", str(out)]) == 2
    assert "--as-dtype, --context-scale and --recalls go with --as-model" in capsys.readouterr().err
    assert main(["simulate", str(micro), "--profile", "l40s", "--transfer", "cpu-attention", "--out", str(out)]) == 2
    assert "needs transfer.host_attention_flops in profile l40s" in capsys.readouterr().err


def test_recalls_by_count_keep_the_traced_recall_volume(runs):
    """--recalls count at a context scale: each layer-step recalls the traced tokens (not the traced share), so
    the link moves what a fixed recall_k would; at scale 1 both modes are the same projection."""
    from simulator.costs import ModelShape
    from simulator.project import project_arrays, target_shape
    from simulator.workload import STEP_COLUMNS, step_arrays

    micro, _ = runs
    run = open_run(micro)
    source = ModelShape.from_manifest(run.manifest["model"])
    sample = run.sample_ids()[0]
    arrays = step_arrays(run.steps(sample, columns=list(STEP_COLUMNS)), source.n_layers)
    target = target_shape("qwen2-7b")
    share = project_arrays(arrays, source, target, 8.0, "share")
    count = project_arrays(arrays, source, target, 8.0, "count")
    columns = layer_map(source.n_layers, target.n_layers)
    traced = arrays.recalled_tokens[:, columns]
    np.testing.assert_allclose(share.recalled_tokens, 8.0 * traced, rtol=1e-12)
    np.testing.assert_allclose(count.recalled_tokens, np.minimum(traced, count.ddr_tokens), rtol=1e-12)
    staged_less = (share.recalled_tokens - count.recalled_tokens) * target.kv_bytes_per_token_layer
    np.testing.assert_allclose(count.hbm_kv_bytes, share.hbm_kv_bytes - staged_less, rtol=1e-9)
    same = project_arrays(arrays, source, target, 1.0, "count")
    for name, values in vars(project_arrays(arrays, source, target, 1.0, "share")).items():
        np.testing.assert_array_equal(getattr(same, name), values)
    by_count = simulate_run(micro, "h100-pcie", projection=Projection("qwen2-7b", context_scale=8, recalls="count"))
    by_share = simulate_run(micro, "h100-pcie", projection=Projection("qwen2-7b", context_scale=8))
    assert by_count.summary["bytes_h2d"] < by_share.summary["bytes_h2d"]
    assert by_count.summary["run_label"].endswith("recalls by count]")
    with pytest.raises(ProjectionError, match="--recalls 'some' is unknown"):
        Projection("qwen2-7b", recalls="some")
