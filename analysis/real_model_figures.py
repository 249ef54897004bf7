"""The real-model figures (docs/real_model.md): the attention profile of a model's own full-cache decode, and
fidelity to the full cache against the traffic that bought it.

Inputs are the tables `thoughtkv experiment real-model` writes: the profile's per-(sample, layer) rows
(tracer.attention_profile.profile_samples) per model, and `real_model.csv` (one row per cell).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.figures import _percent_axis
from analysis.style import new_figure, series_style, styled


def profile_by_layer(profile: pd.DataFrame) -> pd.DataFrame:
    """Per layer, the mean over samples of every metric (and n, the samples)."""
    means = profile.groupby("layer").mean(numeric_only=True)
    means["n"] = profile.groupby("layer")["sample_id"].nunique()
    return means


@styled
def attention_profile(profiles: dict[str, pd.DataFrame], scorers: tuple[str, ...], budgets: tuple[float, ...]) -> Figure:
    """Three panels, one style per model: (a) the attention mass on the top 1 / 10% of positions and on the sink,
    per layer (depth as a share of the model's layers, so models of different depth line up); (b) the
    mass by distance back (last 16 / 64 / 256 tokens), mean over layers; (c) each scorer's captured mass at
    budgets 10-50% of the context (mean over layers and steps), the oracle (this step's own top positions) as the
    ceiling."""
    figure = new_figure((7.2, 3.6))
    ax_top, ax_recent, ax_captured = figure.subplots(1, 3)
    for i, (model, frame) in enumerate(profiles.items()):
        by_layer = profile_by_layer(frame)
        depth = (by_layer.index + 0.5) / len(by_layer)
        n = int(by_layer["n"].min())
        style = series_style(i)
        for key, linestyle in (("top1", ":"), ("top10", "-")):
            ax_top.plot(depth, by_layer[key], color=style["color"], marker=style["marker"], markersize=2.5,
                        linestyle=linestyle, label=f"{model}: top {key[3:]}%" + (f" (n={n})" if key == "top1" else ""))
        ax_top.plot(depth, by_layer["sink"], color=style["color"], linestyle="none", marker="x", markersize=3,
                    label=f"{model}: first 4 tokens")
        recent = [by_layer[f"recent{t}"].mean() for t in (16, 64, 256)]
        ax_recent.bar(np.arange(3) + 0.4 * i - 0.2, recent, width=0.38, color=style["color"], alpha=0.8,
                      label=f"{model} (mean distance {by_layer['mean_distance'].mean():.0f} tokens)")
        for k, scorer in enumerate((*scorers, "oracle")):
            values = [frame[f"captured_{scorer}_{round(b * 100)}"].mean() for b in budgets]
            scorer_style = series_style(k)
            ax_captured.plot(budgets, values, color=scorer_style["color"], marker=scorer_style["marker"],
                             linestyle="-" if i == 0 else ":", label=f"{scorer}" if i == 0 else None)
    ax_top.set_xlabel("layer depth (share of the model's layers)")
    ax_top.set_ylabel("attention mass (mean over steps)")
    ax_top.set_title("(a) mass on the top positions", loc="left")
    _percent_axis(ax_top.yaxis)
    ax_top.set_ylim(0, 1.02)
    ax_top.legend(fontsize=5, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax_recent.set_xticks(range(3), ["last 16", "last 64", "last 256"])
    ax_recent.set_ylabel("attention mass")
    ax_recent.set_title("(b) how far back it sits", loc="left")
    _percent_axis(ax_recent.yaxis)
    ax_recent.set_ylim(0, 1.02)
    ax_recent.legend(fontsize=5, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax_captured.set_xlabel("positions kept (% of the context)")
    ax_captured.set_ylabel("this step's mass on them")
    models = " vs ".join(f"{m} ({'solid' if i == 0 else 'dotted'})" for i, m in enumerate(profiles))
    ax_captured.set_title("(c) mass each scorer keeps", loc="left")
    _percent_axis(ax_captured.xaxis)
    _percent_axis(ax_captured.yaxis)
    ax_captured.set_ylim(0, 1.02)
    ax_captured.legend(fontsize=5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, title=models,
                       title_fontsize=5)
    return figure


@styled
def fidelity_vs_traffic(cells: pd.DataFrame) -> Figure:
    """KL(full || policy) per token (log, 95% bootstrap CI) against H2D bytes per token priced at qwen2-7b, one
    series per (HBM budget, method family); eviction at zero traffic (hollow). `cells`: real_model.csv."""
    figure = new_figure((5.6, 3.2))
    ax = figure.subplots()
    budgets = sorted(cells.loc[cells["policy"] != "full-again", "hbm_budget"].unique())
    floor = cells[cells["policy"] == "full-again"]
    graded = cells.loc[~cells["policy"].isin(["full", "full-again"]), "kl"]
    bottom = float(graded.min()) / 3 if not graded.empty else 1e-3
    if not floor.empty:  # drawn where it lies on the axis; a floor far below the policies is only named
        floor_kl = max(float(floor["kl"].iloc[0]), 1e-12)
        label = f"full cache decoded again (floor): KL {floor_kl:.1g}"
        if floor_kl >= bottom:
            ax.axhline(floor_kl, color="0.5", linestyle=":", linewidth=0.8, label=label)
        else:
            ax.plot([], [], color="0.5", linestyle=":", linewidth=0.8, label=label + ", below the axis")
    for i, budget in enumerate(b for b in budgets if b < 1):
        style = series_style(i)
        rows = cells[cells["hbm_budget"] == budget]
        for j, rule in enumerate(("quest", "quest-per-head", "oracle", "prev-layer", "prev-step")):
            group = rows[(rows["policy"] == "hierarchy") & (rows["recall_rule"] == rule)].sort_values("h2d_bytes_per_token_ref")
            if group.empty:
                continue
            yerr = np.vstack([group["kl"] - group["kl_low"], group["kl_high"] - group["kl"]])
            ax.errorbar(group["h2d_bytes_per_token_ref"], group["kl"], yerr=yerr, color=style["color"],
                        marker=style["marker"], linestyle=["-", "--", "none", ":", "-."][j], capsize=1.5, elinewidth=0.6,
                        alpha=1.0 if j < 3 else 0.6,
                        label=f"HBM {budget:.0%}, {rule}" + {"oracle": " (ceiling)", "prev-layer": " (prefetchable)",
                                                              "prev-step": " (prefetchable)"}.get(rule, ""))
        evict = rows[rows["policy"] == "evict"]
        if not evict.empty:
            best = evict.loc[evict["kl"].idxmin()]
            ax.plot([best["h2d_bytes_per_token_ref"] + 1.0], [best["kl"]], color=style["color"], marker=style["marker"],
                    markerfacecolor="white", linestyle="none", label=f"HBM {budget:.0%}, evict {best['scorer']} (best)")
    ax.set_xscale("symlog", linthresh=1e5)
    ax.set_yscale("log")
    ax.set_ylim(bottom=bottom)
    ax.set_xlabel("H2D bytes per generated token, priced at qwen2-7b (eviction: 0)")
    ax.set_ylabel("KL(full ‖ policy), nats per token")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=5.5)
    return figure


@styled
def served_frontier(capacity: pd.DataFrame) -> Figure:
    """Per profile: every served run at (max sustainable rate, top-1 agreement with the full cache [95% CI]),
    labelled with its attended share and H2D bytes per token as served. `capacity`: thoughtkv capacity's table
    with the fidelity columns of real_model.csv joined (top1, top1_low, top1_high, method)."""
    from analysis.serving import _plain
    from traces.stats import bytes_text

    profiles = list(dict.fromkeys(capacity["profile"]))
    figure = new_figure((3.4 * len(profiles), 3.0))
    axes = figure.subplots(1, len(profiles), sharey=True, squeeze=False)[0]
    methods = list(dict.fromkeys(capacity["method"]))
    for ax, profile in zip(axes, profiles):
        rows = capacity[capacity["profile"] == profile]
        for _, row in rows.iterrows():
            style = series_style(methods.index(row["method"]))
            rate = row["max_rate_per_s"] if row["max_rate_per_s"] == row["max_rate_per_s"] else 0.0
            top1 = 100 * row["top1"]
            ax.errorbar([rate], [top1], yerr=[[top1 - 100 * row["top1_low"]], [100 * row["top1_high"] - top1]],
                        color=style["color"], marker=style["marker"], linestyle="none", capsize=2, elinewidth=0.7,
                        label=row["method"])
            k = methods.index(row["method"])  # labels of points that coincide are stacked, not overprinted
            ax.annotate(f"{100 * row['attended_frac']:.0f}% att., {bytes_text(row['h2d_bytes_per_token_served'])}",
                        (rate, top1), textcoords="offset points", xytext=(6, 6 - 8 * (k % 4)), fontsize=5,
                        color=style["color"])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_plain())
        low, high = ax.get_xlim()  # a span under 4x shows at most one 2-or-5 tick: label every minor one there
        ax.xaxis.set_minor_formatter(_plain(minor=high / low >= 4))
        ax.set_title(profile, loc="left")
        ax.set_xlabel("max sustainable rate (req/s)")
    axes[0].set_ylabel("top-1 agreement with the full cache (%)")
    handles, labels = axes[0].get_legend_handles_labels()  # one legend for both panels, below them
    figure.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=5)
    return figure
