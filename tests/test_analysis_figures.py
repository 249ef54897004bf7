"""The figures draw the numbers of their frames: read the plotted data back from the matplotlib artists."""

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection

from analysis import figures, frames, stats
from analysis.style import series_style


def pooled(rows):
    frame = pd.DataFrame(rows, columns=["method", "hbm_budget", "is_full", "n_correct", "n_scored"])
    intervals = [stats.wilson_interval(k, n) for k, n in zip(frame["n_correct"], frame["n_scored"])]
    return frame.assign(accuracy=frame["n_correct"] / frame["n_scored"], ci_low=[lo for lo, _ in intervals],
                        ci_high=[hi for _, hi in intervals])


def test_capacity_accuracy_draws_accuracy_ci_and_full_band():
    accuracy = pooled([
        ("full cache", 1.0, True, 18, 20),
        ("pure eviction", 0.2, False, 5, 20), ("pure eviction", 0.4, False, 11, 20),
        ("hierarchy, evict 0%", 0.2, False, 15, 20), ("hierarchy, evict 0%", 0.4, False, 17, 20),
    ])
    figure = figures.capacity_accuracy(accuracy)
    ax = figure.axes[0]
    containers = {c.get_label(): c for c in ax.containers}  # one ErrorbarContainer per method
    eviction = containers["pure eviction (n=20)"].lines[0]
    assert eviction.get_ydata() == pytest.approx([0.25, 0.55])
    assert eviction.get_xdata() == pytest.approx([0.2, 0.4], abs=0.02)  # dodged sideways by < 2 points
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    tops = sorted(float(seg[:, 1].max()) for bars_ in bars for seg in bars_.get_segments())
    expected = sorted(stats.wilson_interval(k, 20)[1] for k in (5, 11, 15, 17))
    assert tops == pytest.approx(expected)
    band = next(p for p in ax.patches if "95% CI" in p.get_label())
    y_extent = band.get_path().get_extents(band.get_transform() - ax.transData)
    assert (y_extent.y0, y_extent.y1) == pytest.approx(stats.wilson_interval(18, 20))
    assert "n=20" in band.get_label()


def test_pareto_marks_exactly_the_frontier_points():
    points = pd.DataFrame({
        "run_dir": ["a", "b", "c", "d"], "profile": ["p", "p", "q", "q"], "method": ["m1", "m2", "m1", "m2"],
        "hbm_budget": [0.2, 0.5, 0.2, 0.5], "ms_per_token": [1.0, 2.0, 3.0, 1.5], "accuracy": [0.5, 0.9, 0.4, 0.8],
        "kv_hbm_bytes_per_seq": [2**20, 2**21, 2**20, 2**21],
    })
    points["on_frontier_latency"] = stats.pareto_frontier(points, "ms_per_token", "accuracy")
    points["on_frontier_bytes"] = stats.pareto_frontier(points, "kv_hbm_bytes_per_seq", "accuracy")
    figure = figures.pareto(points)
    latency_ax = figure.axes[0]
    frontier = next(c for c in latency_ax.collections if c.get_label() == "Pareto frontier")
    assert sorted(map(tuple, frontier.get_offsets().tolist())) == [(1.0, 0.5), (1.5, 0.8), (2.0, 0.9)]
    bytes_frontier = next(c for c in figure.axes[1].collections if c.get_label() == "Pareto frontier")
    assert sorted(map(tuple, bytes_frontier.get_offsets().tolist())) == [(1.0, 0.5), (2.0, 0.9)]  # MiB


def test_importance_mean_curve_and_annotation():
    cdf = pd.DataFrame({"layer": [0, 0, 0, 1, 1, 1], "rank_frac": [0, 0.2, 1] * 2, "cum_share": [0, 0.6, 1, 0, 0.8, 1]})
    top = pd.DataFrame({"layer": [0, 1], "top_share": [0.6, 0.8]})
    figure = figures.importance_long_tail(cdf, top, heatmap=np.array([[1.0, np.nan], [0.5, 0.5]]), block_size=16)
    ax = figure.axes[0]
    mean = next(line for line in ax.get_lines() if line.get_label() == "mean over layers")
    assert mean.get_ydata() == pytest.approx([0, 0.7, 1])
    assert "hold\n70% of the mass" in ax.texts[0].get_text()
    image = figure.axes[1].images[0]
    assert image.get_array().shape == (2, 2)
    assert image.get_extent()[:2] == [0, 32]  # 2 blocks of 16 tokens


def test_series_styles_differ_without_colour():
    # Greyscale-readable: consecutive series never share both marker and line style.
    styles = [series_style(i) for i in range(14)]
    pairs = {(s["marker"], str(s["linestyle"])) for s in styles}
    assert len({s["marker"] for s in styles}) == 14 and len(pairs) == 14


def test_sim_vs_measured_histogram_counts_every_sample():
    frame = pd.DataFrame({"profile": "p", "simulated_s": [1.1, 0.9, 2.0], "measured_s": [1.0, 1.0, 2.0]})
    frame["rel_err"] = (frame["simulated_s"] - frame["measured_s"]) / frame["measured_s"]
    errors = stats.error_stats(frame["simulated_s"], frame["measured_s"])
    figure = figures.sim_vs_measured(frame, errors)
    heights = [patch.get_height() for patch in figure.axes[1].patches]
    assert sum(heights) == 3
    assert "median |error| 10.0%" in figure.axes[1].get_title()


def test_breakdown_bars_are_shares_that_add_up_with_the_total_written_out():
    latency = pd.DataFrame({
        "profile": ["p", "q"], "method": "h", "hbm_budget": 0.3, "is_full": False, "ms_per_token": [2.0, 5.0],
        "compute_ms": [1.0, 1.0], "hbm_ms": [0.5, 2.0], "overhead_ms": [0.1, 0.1], "link_stall_ms": [0.4, 1.9],
        "step_ms": [2.0, 5.0],
    })
    breakdown = frames.breakdown_frame(latency)
    figure = figures.projected_latency(latency, breakdown, ["h"])
    ax = figure.axes[-1]
    widths = {}
    for bar in ax.patches:
        widths.setdefault(round(bar.get_y() + bar.get_height() / 2), []).append(bar.get_width())
    assert widths[0] == pytest.approx([0.5, 0.25, 0.05, 0.2])  # p: parts / 2 ms, in stacking order
    assert widths[1] == pytest.approx([0.2, 0.4, 0.02, 0.38])
    assert [t.get_text() for t in ax.texts] == ["2 ms", "5 ms"]


def test_the_real_model_fidelity_figure_draws_one_series_per_budget_and_rule():
    """One error-bar series per (HBM budget, recall rule) that has rows, one hollow marker per budget's best
    eviction, the floor as a line; the legend names each."""
    import pandas as pd

    from analysis.real_model_figures import fidelity_vs_traffic

    def row(policy, budget, rule=None, kl=0.1, h2d=1e6, scorer="h2o"):
        return {"policy": policy, "hbm_budget": budget, "recall_rule": rule, "scorer": scorer, "kl": kl,
                "kl_low": kl * 0.9, "kl_high": kl * 1.1, "h2d_bytes_per_token_ref": h2d}

    rows = pd.DataFrame([row("full-again", 1.0, kl=1e-8, h2d=0), row("evict", 0.3, kl=0.4, h2d=0),
                         row("evict", 0.3, kl=0.3, h2d=0, scorer="tova"),
                         row("hierarchy", 0.3, "quest", 0.1), row("hierarchy", 0.3, "quest", 0.05, 2e6),
                         row("hierarchy", 0.3, "prev-step", 0.12), row("hierarchy", 0.5, "quest-per-head", 0.02),
                         row("hierarchy", 0.5, "oracle", 0.01)])
    figure = fidelity_vs_traffic(rows)
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert len(figure.axes[0].containers) == 4  # quest@30, prev-step@30, qph@50, oracle@50
    assert "HBM 30%, evict tova (best)" in labels and "HBM 30%, prev-step (prefetchable)" in labels
    assert "HBM 50%, oracle (ceiling)" in labels
    assert "full cache decoded again (floor): KL 1e-08, below the axis" in labels  # 1e-8 << 0.01 / 3: named only
