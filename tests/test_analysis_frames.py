"""analysis.frames and analysis.tables on constructed runs and simulator rows with hand-computed answers."""

import numpy as np
import pandas as pd
import pytest

from analysis import frames, stats, tables
from traces.policy import PolicySpec


def make_tokens(per_sample_layers: dict[str, list[list[float]]]) -> pd.DataFrame:
    """sample -> [layer][position] importance -> the tokens table's shape (one row per position)."""
    rows = []
    for sample_id, layers in per_sample_layers.items():
        matrix = np.array(layers, dtype=float)
        for position in range(matrix.shape[1]):
            rows.append({"sample_id": sample_id, "position": position, "importance_by_layer": matrix[:, position]})
    return pd.DataFrame(rows).sample(frac=1.0, random_state=0)  # readers need not return rows in order


def make_run(policy, budget, ratio, correct, n, scorer="h2o", evicted_frac=0.0, model="m"):
    low, high = stats.wilson_interval(correct, n)
    return {
        "run_dir": f"/runs/{policy}-{budget}-{ratio}-{scorer}", "run_label": f"{policy}-{budget}", "model": model,
        "policy": policy, "hbm_budget": budget, "evict_ratio": ratio, "block_size": 16,
        "scorer": None if policy == "full" else scorer, "recall_k": None if policy != "hierarchy" else 4,
        "n_samples": n, "n_scored": n, "n_correct": correct, "accuracy": correct / n if n else np.nan,
        "ci_low": low, "ci_high": high, "evicted_frac": evicted_frac, "device": "cpu",
        "policy_key": PolicySpec(policy=policy, hbm_budget=budget, evict_ratio=ratio, block_size=16, scorer=scorer,
                                 recall_k=4 if policy == "hierarchy" else 0).identity(),  # as load.run_row writes it
    }


def sim_row(run: dict, profile: str, sample_id: str, steps: int, decode_s: float, prefill_s: float, stall_s: float,
            **extra) -> dict:
    total = decode_s + prefill_s
    row = {
        "run_dir": run["run_dir"], "run_label": run["run_label"], "result_kind": "traced", "model": run["model"],
        "policy": run["policy"], "hbm_budget": run["hbm_budget"], "evict_ratio": run["evict_ratio"],
        "block_size": 16, "recall_k": run["recall_k"] or 0, "scorer": str(run["scorer"]), "profile": profile,
        "policy_key": run["policy_key"],
        "overlap": "none", "async_offload": True, "batch": 1, "sample_id": sample_id, "steps": steps,
        "total_s": total, "decode_s": decode_s, "prefill_s": prefill_s, "ms_per_token": 1e3 * decode_s / (steps - 1),
        "compute_s": 0.25 * (total - stall_s), "hbm_s": 0.75 * (total - stall_s), "overhead_s": 0.0,
        "link_stall_s": stall_s, "link_stall_frac": stall_s / total, "bytes_h2d": 10, "bytes_d2h": 5,
        "kv_bytes_per_seq_full": 1000, "kv_hbm_bytes_per_seq": int(1000 * run["hbm_budget"]),
        "max_concurrency_full": 10, "max_concurrency_policy": int(10 / run["hbm_budget"]),
        "max_concurrency_ddr": None, "mass_lost_evicted": None, "mass_lost_not_recalled": None,
    }
    row.update(extra)
    return row


# -- importance ---------------------------------------------------------------------------------------------


def test_top_share_and_cdf_by_layer_on_constructed_tokens():
    tokens = make_tokens({
        # layer 0: top 20% of 10 tokens = 2 tokens holding (50+20)/100; layer 1 uniform.
        "a": [[1, 50, 2, 3, 20, 4, 5, 6, 4, 5], [1] * 10],
        # layer 0: (9+1)/ (9+1+0*8) = 1.0; layer 1: (3+3)/(3+3+1*8)
        "b": [[9, 1, 0, 0, 0, 0, 0, 0, 0, 0], [3, 3, 1, 1, 1, 1, 1, 1, 1, 1]],
    })
    top = frames.top_share_by_layer(tokens, 0.2).set_index("layer")
    assert top.loc[0, "top_share"] == pytest.approx((0.70 + 1.0) / 2)
    assert top.loc[1, "top_share"] == pytest.approx((0.2 + 6 / 14) / 2)
    assert top.loc[0, "top_share_min"] == pytest.approx(0.70) and top.loc[0, "top_share_max"] == pytest.approx(1.0)
    assert (top["n_samples"] == 2).all()

    cdf = frames.importance_cdf(tokens, grid_points=11)  # grid at 0, 0.1, ..., 1.0
    layer0 = cdf[cdf["layer"] == 0].set_index("rank_frac")["cum_share"]
    assert layer0.loc[0.0] == 0.0 and layer0.loc[1.0] == pytest.approx(1.0)
    assert layer0.loc[0.2] == pytest.approx((0.70 + 1.0) / 2)  # the CDF at 20% is the top-20% share
    assert layer0.is_monotonic_increasing


def test_block_mass_heatmap_averages_layers_and_leaves_future_blocks_blank():
    access = pd.DataFrame([
        {"sample_id": "s", "step": 0, "layer": 0, "block_mass": np.array([1.0])},  # prefill: left out
        {"sample_id": "s", "step": 1, "layer": 0, "block_mass": np.array([0.6, 0.4])},
        {"sample_id": "s", "step": 1, "layer": 1, "block_mass": np.array([0.2, 0.8])},
        {"sample_id": "s", "step": 2, "layer": 0, "block_mass": np.array([0.1, 0.2, 0.7])},
        {"sample_id": "s", "step": 2, "layer": 1, "block_mass": np.array([0.3, 0.3, 0.4])},
        {"sample_id": "other", "step": 1, "layer": 0, "block_mass": np.array([1.0, 0, 0, 0])},
    ])
    heatmap = frames.block_mass_heatmap(access, "s")
    assert heatmap.shape == (2, 3)
    assert heatmap[0, :2] == pytest.approx([0.4, 0.6]) and np.isnan(heatmap[0, 2])
    assert heatmap[1] == pytest.approx([0.2, 0.25, 0.55])


# -- accuracy ---------------------------------------------------------------------------------------------------


def test_methods_and_pooled_accuracy_with_wilson_intervals():
    runs = pd.DataFrame([
        make_run("full", 1.0, 0.0, 17, 20),
        make_run("evict", 0.3, 0.0, 6, 20),
        make_run("hierarchy", 0.3, 0.5, 12, 20),
        make_run("hierarchy", 0.3, 0.5, 14, 20) | {"run_dir": "/runs/seed2"},  # a second seed: pooled
        make_run("hierarchy", 0.1, 0.5, 0, 0),  # unscored: left out
    ])
    accuracy = frames.accuracy_frame(runs)
    assert set(accuracy["method"]) == {"full cache", "pure eviction", "hierarchy, evict 50%"}
    pooled = frames.pooled_accuracy(accuracy).set_index("method")
    assert pooled.loc["hierarchy, evict 50%", "n_scored"] == 40
    assert pooled.loc["hierarchy, evict 50%", "accuracy"] == pytest.approx(26 / 40)
    assert (pooled.loc["hierarchy, evict 50%", "ci_low"], pooled.loc["hierarchy, evict 50%", "ci_high"]) == \
        pytest.approx(stats.wilson_interval(26, 40))
    assert pooled.loc["full cache", "is_full"]

    evicted = {"/runs/full-1.0-0.0-h2o": 0.0, "/runs/evict-0.3-0.0-h2o": 0.7, "/runs/hierarchy-0.3-0.5-h2o": 0.2,
               "/runs/seed2": 0.4}
    table = tables.capacity_accuracy_table(accuracy.assign(evicted_frac=accuracy["run_dir"].map(evicted)))
    assert list(table["method"]) == ["full cache", "pure eviction", "hierarchy, evict 50%"]
    hierarchy = table.set_index("method").loc["hierarchy, evict 50%"]
    assert hierarchy["n"] == 40 and hierarchy["evicted_frac"] == pytest.approx(0.3)  # n-weighted mean
    shown = tables.display_capacity_accuracy(table)
    assert shown.loc[0, "accuracy [95% CI]"] == "85.0 [64.0, 94.8]"  # 17/20, Wilson by hand: 0.6396-0.9476


def test_scorer_named_only_when_several_and_models_never_pooled():
    runs = pd.DataFrame([make_run("evict", 0.3, 0.0, 5, 10, scorer="h2o"), make_run("evict", 0.3, 0.0, 6, 10, scorer="tova")])
    assert set(frames.accuracy_frame(runs)["method"]) == {"pure eviction [h2o]", "pure eviction [tova]"}
    runs = pd.DataFrame([make_run("evict", 0.3, 0.0, 5, 10, model="a"), make_run("evict", 0.3, 0.0, 6, 10, model="b")])
    assert set(frames.accuracy_frame(runs)["method"]) == {"a: pure eviction", "b: pure eviction"}


# -- simulator results ----------------------------------------------------------------------------------------------


@pytest.fixture
def study():
    runs = [make_run("full", 1.0, 0.0, 18, 20), make_run("evict", 0.25, 0.0, 8, 20),
            make_run("hierarchy", 0.25, 0.5, 15, 20), make_run("hierarchy", 0.5, 0.5, 17, 20)]
    speed = {"fast-gpu": 1.0, "slow-gpu": 4.0}
    rows = []
    for run in runs:
        stall = 0.0 if run["policy"] != "hierarchy" else 0.02
        for profile, speed_factor in speed.items():
            factor = speed_factor * (0.5 + 0.5 * run["hbm_budget"])  # less KV in HBM: faster decode
            # two samples of different length: pooled ms/token = total decode / total decode steps
            rows.append(sim_row(run, profile, "s0", steps=11, decode_s=0.1 * factor, prefill_s=0.01, stall_s=stall))
            rows.append(sim_row(run, profile, "s1", steps=31, decode_s=0.9 * factor, prefill_s=0.01, stall_s=stall))
            rows.append(sim_row(run, profile, "ALL", steps=42, decode_s=1.0 * factor, prefill_s=0.02, stall_s=2 * stall))
        rows.append(sim_row(run, "fast-gpu", "s0", steps=11, decode_s=99.0, prefill_s=0.0, stall_s=0.0, batch=8))
    return pd.DataFrame(runs), pd.DataFrame(rows)


def test_latency_frame_pools_samples_and_skips_summary_and_other_configs(study):
    runs, sim = study
    latency = frames.latency_frame(sim, runs)
    assert len(latency) == 4 * 2  # runs x profiles; batch-8 rows and "ALL" summary rows not counted
    row = latency[(latency["policy"] == "evict") & (latency["profile"] == "slow-gpu")].iloc[0]
    factor = 4.0 * 0.625
    assert row["ms_per_token"] == pytest.approx(1e3 * factor * (0.1 + 0.9) / (10 + 30))  # not the mean of per-sample values
    assert row["n_samples"] == 2
    assert row["accuracy"] == pytest.approx(8 / 20)
    total_s = factor * (0.1 + 0.9) + 0.02
    parts = row[["compute_ms", "hbm_ms", "overhead_ms", "link_stall_ms"]].sum()
    assert parts == pytest.approx(1e3 * total_s / 42)  # the breakdown adds up to the mean step time
    assert frames.focus_method(latency) == "hierarchy, evict 50%"  # the method with most budgets


def test_breakdown_picks_the_focus_method_at_the_smallest_budget(study):
    runs, sim = study
    breakdown = frames.breakdown_frame(frames.latency_frame(sim, runs))
    assert list(breakdown["profile"]) == ["fast-gpu", "slow-gpu"]  # fastest first
    assert (breakdown["hbm_budget"] == 0.25).all() and (breakdown["method"] == "hierarchy, evict 50%").all()
    assert breakdown["link_stall_ms"].iloc[0] == pytest.approx(1e3 * 0.04 / 42)


def test_pareto_and_capacity_frames(study):
    runs, sim = study
    latency = frames.latency_frame(sim, runs)
    points = frames.pareto_frame(latency)
    on_latency = points[points["on_frontier_latency"]]
    # fast-gpu at 25 ms x (0.625, 0.625, 0.75, 1.0): evict@0.25 ties hierarchy@0.25 in time but is less accurate;
    # every slow-gpu point (>= 62.5 ms) is beaten by fast-gpu's full cache (25 ms, 90%).
    assert set(zip(on_latency["policy"], on_latency["hbm_budget"], on_latency["profile"])) == {
        ("hierarchy", 0.25, "fast-gpu"), ("hierarchy", 0.5, "fast-gpu"), ("full", 1.0, "fast-gpu")}
    on_bytes = points.drop_duplicates("run_dir").set_index("policy")
    # bytes: evict 250 B (40%), hierarchy@0.25 250 B (75%) beats it; hierarchy@0.5 500 B 85%; full 1000 B 90%
    assert bool(on_bytes.loc["full", "on_frontier_bytes"])
    assert not bool(on_bytes.loc["evict", "on_frontier_bytes"])

    capacity = frames.capacity_frame(latency)
    row = capacity[(capacity["hbm_budget"] == 0.25) & (capacity["policy"] == "evict") & (capacity["profile"] == "fast-gpu")].iloc[0]
    assert row["max_concurrency"] == 40  # no DDR limit (null) -> the HBM limit
    assert row["throughput_tokens_per_s"] == pytest.approx(40 * row["tokens_per_s"])


def test_latency_table_one_row_per_profile(study):
    runs, sim = study
    table = tables.latency_table(frames.latency_frame(sim, runs), hbm_budget=0.3)
    assert list(table["profile"]) == ["fast-gpu", "slow-gpu"]
    assert list(table.columns) == [
        "profile", "full cache (ms/token)", "pure eviction @ 25% (ms/token)", "hierarchy, evict 50% @ 25% (ms/token)",
        "link stall share, hierarchy, evict 50% @ 25%",
    ]
    assert table.loc[1, "full cache (ms/token)"] == pytest.approx(1e3 * 4.0 / 40)
    assert table.loc[0, "pure eviction @ 25% (ms/token)"] == pytest.approx(1e3 * 0.625 / 40)


def test_mass_lost_joins_projected_rows_to_the_measured_policy(study):
    runs, sim = study
    full = runs.iloc[0].to_dict()
    projected = []
    for target, lost in [(runs.iloc[1], 0.30), (runs.iloc[2], 0.10)]:
        what_if = {**full, "policy": target["policy"], "hbm_budget": target["hbm_budget"],
                   "evict_ratio": target["evict_ratio"], "recall_k": target["recall_k"], "scorer": target["scorer"],
                   "policy_key": target["policy_key"]}  # as simulate writes it for a what-if of that policy
        for sample_id, factor in [("s0", 0.5), ("s1", 1.5)]:
            projected.append(sim_row(what_if, "fast-gpu", sample_id, 11, 0.1, 0.01, 0.0, result_kind="projected",
                                     mass_lost_evicted=lost * factor * 0.5, mass_lost_not_recalled=lost * factor * 0.5))
    frame = frames.mass_lost_frame(pd.concat([sim, pd.DataFrame(projected)], ignore_index=True), runs)
    frame = frame.set_index("method")
    assert frame.loc["pure eviction", "mass_lost"] == pytest.approx(0.30)
    assert frame.loc["pure eviction", "accuracy"] == pytest.approx(8 / 20)
    assert frame.loc["hierarchy, evict 50%", "mass_lost"] == pytest.approx(0.10)
    assert len(frame) == 2  # the hierarchy@0.5 run has no projection


def test_sim_vs_measured_pairs_only_the_named_profile(study):
    runs, sim = study
    run_dir = runs.iloc[0]["run_dir"]
    measured = pd.DataFrame({"run_dir": run_dir, "sample_id": ["s0", "s1"], "measured_s": [0.1, 1.0],
                             "profile": "fast-gpu"})
    frame = frames.sim_vs_measured_frame(sim, measured)
    assert list(frame["sample_id"]) == ["s0", "s1"]
    assert frame["rel_err"].tolist() == pytest.approx([(0.11 - 0.1) / 0.1, (0.91 - 1.0) / 1.0])
    table = tables.sim_vs_measured_table(frame)
    assert table.loc[0, "median_abs_rel_err"] == pytest.approx((0.1 + 0.09) / 2)


def test_markdown_and_latex_renderings():
    shown = pd.DataFrame({"method": ["a|b", "c_d"], "share": ["10%", "20%"]})
    markdown = tables.to_markdown(shown).splitlines()
    assert markdown[0] == "| method | share |" and markdown[1] == "| :--- | ---: |"
    assert markdown[2] == "| a\\|b | 10% |"
    latex = tables.to_latex(shown, caption="Cap", label="tab:x")
    for rule in ("\\toprule", "\\midrule", "\\bottomrule", "\\caption{Cap}", "\\label{tab:x}"):
        assert rule in latex
    assert "c\\_d & 20\\% \\\\" in latex


def test_results_recorded_with_other_paths_are_pointed_at_the_given_runs():
    from analysis.load import align_run_dirs

    runs = ["/home/me/demo/runs/full", "/home/me/demo/runs/evict-b50", "/data/a/full-x", "/data/b/full-x"]
    sim = pd.DataFrame({"run_dir": ["demo/runs/full", "/old/place/runs/evict-b50", "/home/me/demo/runs/full",
                                    "/else/full-x", "/tmp/unknown"]})
    aligned = align_run_dirs(sim, runs)["run_dir"].tolist()
    assert aligned == ["/home/me/demo/runs/full", "/home/me/demo/runs/evict-b50", "/home/me/demo/runs/full",
                       "/else/full-x", "/tmp/unknown"]  # two runs are named full-x: ambiguous, left alone


def test_capacity_uses_a_batched_replay_where_one_was_simulated(study):
    runs, sim = study
    capacity = frames.capacity_frame(frames.latency_frame(sim, runs), sim).set_index(["policy", "hbm_budget", "profile"])
    full_fast = capacity.loc[("full", 1.0, "fast-gpu")]
    assert full_fast["throughput_source"] == "simulated at batch 8"
    assert full_fast["throughput_tokens_per_s"] == pytest.approx(8 * 10 / 99.0)  # 8 sequences x 10 decode tokens
    full_slow = capacity.loc[("full", 1.0, "slow-gpu")]
    assert full_slow["throughput_source"] == "bound"
    assert full_slow["throughput_tokens_per_s"] == pytest.approx(10 * full_slow["tokens_per_s"])


def test_focus_method_prefers_the_more_accurate_of_equally_sampled_methods():
    latency = pd.DataFrame({
        "method": ["pure eviction", "pure eviction", "h, evict 0%", "h, evict 0%", "h, evict 10%", "h, evict 10%"],
        "hbm_budget": [0.25, 0.5] * 3, "is_full": False, "accuracy": [0.9, 0.9, 0.4, 0.3, 0.2, 0.1],
    })
    assert frames.focus_method(latency) == "h, evict 0%"  # eviction is never the focus when another ties
    assert frames.focus_method(latency.drop(columns="accuracy")) == "h, evict 10%"  # no accuracy: by name


def test_hierarchy_runs_that_recall_differently_are_different_methods():
    import pandas as pd

    from analysis.frames import add_method

    base = dict(policy="hierarchy", evict_ratio=0.0, scorer="h2o", recall_k=4, recall_rule="quest")
    rows = [dict(base, recall_budget=0.1), dict(base, recall_budget=0.2), dict(base, recall_budget=0.2,
                                                                              recall_rule="quest-per-head"),
            dict(policy="full", evict_ratio=0.0, scorer=None, recall_k=4, recall_budget=None, recall_rule="quest")]
    methods = add_method(pd.DataFrame(rows))["method"].tolist()
    assert methods[0].endswith("recall ≤ 10%") and methods[1].endswith("recall ≤ 20%")
    assert methods[2].endswith("recall ≤ 20% quest-per-head") and len(set(methods)) == 4
    same = add_method(pd.DataFrame([rows[0], rows[0]]))["method"].tolist()
    assert same[0] == same[1] and "recall" not in same[0]  # one recall setting: not named
