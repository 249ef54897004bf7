"""`thoughtkv traces synth`, `thoughtkv simulate` and the what-if replay, end to end on small synthetic runs."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from simulator import SimOptions, simulate_run
from simulator.placement import SCORERS, Placement, merge_blocks
from thoughtkv.cli import main
from traces.access_model import AccessModel
from traces.policy import PolicySpec, hbm_target_tokens, movable_range
from traces.reader import open_run
from traces.schema import TIER_DDR, TIER_EVICTED, TIER_HBM

REQUIRED_COLUMNS = (
    "run_dir run_label result_kind model policy hbm_budget evict_ratio block_size recall_k scorer profile overlap "
    "async_offload batch sample_id steps total_s ms_per_token tokens_per_s compute_s hbm_s link_stall_s "
    "link_stall_frac bytes_h2d bytes_d2h link_util_h2d link_util_d2h peak_hbm_bytes peak_ddr_bytes hbm_overflow "
    "kv_bytes_per_seq_full kv_hbm_bytes_per_seq max_concurrency_full max_concurrency_policy max_concurrency_ddr "
    "mass_lost_evicted mass_lost_not_recalled"
).split()


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    rc = main(["traces", "synth", "--model", "qwen2-1.5b", "--prompt-tokens", "80", "--decode-steps", "30",
               "--policy", "hierarchy", "--hbm-budget", "0.4", "--recall-k", "2", "--scorer", "recency",
               "--recall-rule", "score", "--samples", "2", "--seed", "5", "--out", str(out)])
    assert rc == 0
    return out


def test_synth_writes_a_valid_consistent_trace(synth_dir):
    run = open_run(synth_dir)
    run.validate()
    steps = run.steps()
    block_bytes = 16 * run.manifest["model"]["kv_bytes_per_token"] // run.manifest["model"]["n_layers"]
    recalled = steps["recalled_block_ids"].map(len)
    offloaded = steps["offloaded_block_ids"].map(len)
    assert (steps["bytes_h2d"] == recalled * block_bytes).all()
    assert (steps["bytes_d2h"] == offloaded * block_bytes).all()
    assert recalled.sum() > 0 and offloaded.sum() > 0
    tokens = steps["hbm_tokens"] + steps["ddr_tokens"] + steps["evicted_tokens"]
    assert (tokens == steps["logical_len"]).all()


def test_synth_resumes_without_rewriting(synth_dir):
    before = {p: p.stat().st_mtime_ns for p in synth_dir.rglob("*.parquet")}
    assert main(["traces", "synth", "--model", "qwen2-1.5b", "--prompt-tokens", "80", "--decode-steps", "30",
                 "--policy", "hierarchy", "--hbm-budget", "0.4", "--recall-k", "2", "--scorer", "recency",
                 "--recall-rule", "score", "--samples", "2", "--seed", "5", "--out", str(synth_dir)]) == 0
    assert {p: p.stat().st_mtime_ns for p in synth_dir.rglob("*.parquet")} == before


def test_simulate_cli_table_and_results(synth_dir, tmp_path, capsys):
    out = tmp_path / "res"
    timeline = tmp_path / "timeline.json"
    rc = main(["simulate", str(synth_dir), "--profile", "h100-sxm", "--profile", "gh200-96gb", "--out", str(out),
               "--timeline", str(timeline)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "h100-sxm" in printed and "gh200-96gb" in printed
    results = pd.read_parquet(out / "results.parquet")
    assert set(REQUIRED_COLUMNS) <= set(results.columns)
    assert len(results) == 4 and set(results["result_kind"]) == {"synthetic"}  # a synth run, never "traced"
    assert results["mass_lost_evicted"].isna().all()
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"sample_id", "step", "latency_s", "compute_s", "link_stall_s"} <= set(steps.columns)
    assert len(steps) == 2 * 2 * 31
    assert len(pd.read_csv(out / "summary.csv")) == 2
    events = json.loads(timeline.read_text())["traceEvents"]
    track_names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"GPU", "link H2D", "link D2H"} <= track_names
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")

    # A second call with other options adds rows; the first call's rows are kept.
    assert main(["simulate", str(synth_dir), "--profile", "h100-sxm", "--out", str(out), "--what-if",
                 "budget=0.2"]) == 0
    merged = pd.read_parquet(out / "results.parquet")
    assert len(merged) == 6 and set(merged["result_kind"]) == {"synthetic", "projected"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--profile", "no-such-gpu"], "unknown hardware profile"),
        (["--profile", "h100-sxm", "--all-profiles"], "not both"),
        ([], "no hardware given"),
        (["--profile", "h100-sxm", "--what-if", "block=24"], "multiple of the traced block size"),
        (["--profile", "h100-sxm", "--what-if", "scorer=keynorm"], "cannot be computed from recorded masses"),
        (["--profile", "h100-sxm", "--what-if", "colour=red"], "unknown key"),
        (["--profile", "h100-sxm", "--batch", "0"], "--batch"),
        (["--profile", "example-measured-cpu", "--engine", "fast"], "--engine fast"),  # async offload, half duplex
        (["--profile", "h100-sxm", "--recall-buffer-blocks", "-1"], "--recall-buffer-blocks"),
        (["--profile", "h100-sxm", "--recall-buffer-blocks", "4", "--what-if", "budget=0.3"], "--recall-buffer-blocks"),
        (["--profile", "h100-sxm", "--overlap", "layer-prefetch", "--what-if", "recall_rule=query"], "prefetch"),
    ],
)
def test_bad_input_is_one_line_exit_2(synth_dir, tmp_path, capsys, extra, message):
    assert main(["simulate", str(synth_dir), "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_wrong_trace_version_is_refused(synth_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(synth_dir, copy)
    manifest = json.loads((copy / "run.json").read_text())
    manifest["schema"] = "thoughtkv.trace/0"
    (copy / "run.json").write_text(json.dumps(manifest))
    assert main(["simulate", str(copy), "--profile", "h100-sxm"]) == 2
    assert "schema" in capsys.readouterr().err
    assert not (copy / "sim").exists()  # nothing written for a refused input


# ---------------------------------------------------------------- what-if ------------------------------------


def test_replaying_the_traced_policy_reproduces_the_trace(synth_dir):
    """recency + score-rule recall do not depend on the quantised masses: the replay must match exactly."""
    traced = simulate_run(synth_dir, "h100-sxm", SimOptions(engine="des"))
    replayed = simulate_run(synth_dir, "h100-sxm", SimOptions(engine="fast"), what_if={})
    assert replayed.summary["result_kind"] == "projected"
    for column in ("bytes_h2d", "bytes_d2h", "peak_hbm_bytes", "peak_ddr_bytes"):
        assert replayed.summary[column] == traced.summary[column]
    assert replayed.summary["total_s"] == pytest.approx(traced.summary["total_s"], rel=1e-9)


def test_what_if_projects_traffic_and_mass_lost(synth_dir):
    full = simulate_run(synth_dir, "h100-sxm", what_if="policy=full").summary
    assert full["bytes_h2d"] == full["bytes_d2h"] == 0 and full["mass_lost_evicted"] == 0
    tight = simulate_run(synth_dir, "h100-sxm", what_if="policy=evict,budget=0.2,scorer=h2o,window=16,sink=0").summary
    looser = simulate_run(synth_dir, "h100-sxm", what_if="policy=evict,budget=0.6,scorer=h2o,window=16,sink=0").summary
    assert 0 < looser["mass_lost_evicted"] < tight["mass_lost_evicted"] < 1
    assert tight["kv_hbm_bytes_per_seq"] < looser["kv_hbm_bytes_per_seq"] < full["kv_hbm_bytes_per_seq"]
    coarse = simulate_run(synth_dir, "h100-sxm", what_if="block=32,recall_k=1").summary
    assert coarse["block_size"] == 32 and coarse["bytes_h2d"] % (32 * 28672 // 28) == 0


def test_fast_equals_des_on_synthetic_traces(synth_dir, tmp_path):
    from simulator.synth import synth_run

    runs = [synth_dir, synth_run(tmp_path / "ev", model="llama3-8b", prompt_tokens=40, decode_steps=20,
                                 policy="evict", hbm_budget=0.5, seed=9)]
    for run in runs:
        for overlap in ("none", "layer-prefetch"):
            for async_offload in (True, False):
                des = simulate_run(run, "b200", SimOptions(overlap=overlap, async_offload=async_offload, engine="des"))
                fast = simulate_run(run, "b200", SimOptions(overlap=overlap, async_offload=async_offload, engine="fast"))
                np.testing.assert_allclose(fast.steps["latency_s"], des.steps["latency_s"], rtol=1e-9)


# ---------------------------------------------------------------- placement registry -------------------------


@pytest.mark.parametrize("scorer", sorted(SCORERS))
@pytest.mark.parametrize("policy", ["evict", "hierarchy"])
def test_placement_invariants(scorer, policy):
    n_layers, bs = 3, 8
    config = PolicySpec(policy=policy, hbm_budget=0.3, evict_ratio=0.2, block_size=bs, recall_k=2,
                             scorer=scorer, sink_tokens=4, window_tokens=8)
    model = AccessModel(n_layers=n_layers, block_size=bs, seed=1)
    masses = [model.masses(s, 50 + s) for s in range(40)]
    scorer_obj = None
    if scorer == "oracle":
        from simulator.placement import OracleScorer, future_mass

        scorer_obj = OracleScorer(future=future_mass(masses))
    placement = Placement(config, n_layers, scorer_obj)
    evicted_before = np.zeros((n_layers, 0), dtype=bool)
    for s, mass in enumerate(masses):
        logical = 50 + s
        placed = placement.step(s, logical, mass, record_ids=True)
        n_blocks = mass.shape[1]
        assert (placed.hbm_blocks + placed.ddr_blocks + placed.evicted_blocks == n_blocks).all()
        assert (placed.hbm_tokens + placed.ddr_tokens + placed.evicted_tokens == logical).all()
        total = placed.mass_hbm + placed.mass_ddr + placed.mass_evicted + placed.mass_not_recalled
        np.testing.assert_allclose(total, 1.0, rtol=1e-9)
        tier = placement.tier
        first, end = movable_range(config, logical)
        protected_tokens = logical - (end - first) * bs
        room = max(0, hbm_target_tokens(config, logical) - protected_tokens) // bs
        assert ((tier[:, first:end] == TIER_HBM).sum(1) <= room).all()  # movable residents fit the budget
        assert (tier[:, :first] == TIER_HBM).all() and (tier[:, end:] == TIER_HBM).all()  # sink, window
        if policy == "evict":
            assert not (tier == TIER_DDR).any() and placed.n_recalled.sum() == 0
        was = np.zeros_like(tier, dtype=bool)
        was[:, : evicted_before.shape[1]] = evicted_before
        assert (tier[was] == TIER_EVICTED).all()  # eviction is final
        evicted_before = tier == TIER_EVICTED


def test_merge_blocks_sums_groups():
    mass = np.array([[0.1, 0.2, 0.3, 0.4, 0.5]])
    np.testing.assert_allclose(merge_blocks(mass, 2), [[0.3, 0.7, 0.5]])
