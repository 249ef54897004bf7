"""Drawing only: one function per figure, each taking the DataFrames of `analysis.frames` and returning a Figure.

The numbers are computed (and tested) in `analysis.frames` / `analysis.stats`; these functions only place
them. Percentages are drawn as %, budgets as % of the full KV cache, times in ms or s as the axis says.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import (
    EngFormatter,
    FixedLocator,
    FuncFormatter,
    LogLocator,
    MaxNLocator,
    NullFormatter,
    PercentFormatter,
)

from analysis.frames import FULL_LABEL, method_order
from analysis.style import DOUBLE_COLUMN_IN, GREYS, HATCHES, new_figure, series_style, styled

BUDGET_LABEL = "HBM budget (% of full KV cache)"
MIB = 2**20


def _percent_axis(axis) -> None:
    axis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))


def _budget_ticks(ax, budgets: pd.Series, most: int = 8) -> None:
    """Ticks at the budgets drawn, when there are few: around a single budget matplotlib's automatic ticks
    are a few tenths of a percent apart and all print as the same whole percent."""
    values = np.unique(budgets.dropna().to_numpy(dtype=float))
    if 0 < len(values) <= most:
        ax.set_xticks(values)
        if len(values) == 1:
            ax.set_xlim(values[0] - 0.1, values[0] + 0.1)


def _n_text(n_values: pd.Series) -> str:
    low, high = int(n_values.min()), int(n_values.max())
    return f"n={low}" if low == high else f"n={low}-{high}"


def _profile_styles(profiles) -> dict[str, dict]:
    return {profile: series_style(i) for i, profile in enumerate(sorted(profiles))}


def _method_styles(methods: list[str]) -> dict[str, dict]:
    return {method: series_style(i) for i, method in enumerate(methods)}


def _log_if_wide(axis, values: pd.Series, which: str = "y", ratio: float = 20.0) -> None:
    """Log scale when values span more than `ratio`x (profiles differ by orders of magnitude), plain tick labels."""
    values = values[values > 0]
    if not len(values) or values.max() / values.min() <= ratio:
        return
    (axis.set_yscale if which == "y" else axis.set_xscale)("log")
    ticks = axis.yaxis if which == "y" else axis.xaxis
    decades = np.log10(values.max() / values.min())
    ticks.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
    ticks.set_major_formatter(_plain_number_formatter())
    ticks.set_minor_formatter(NullFormatter())


# Ratios a reader takes in at a glance on a log axis of simulated/measured, by how far the data spread: decades
# (1-2-5) across orders of magnitude, finer steps within one (a 0.8x-1.3x histogram got a single "1x" label from a
# decade locator).
RATIO_SERIES = (
    (30.0, tuple(m * 10.0**e for e in range(-2, 3) for m in (1, 2, 5))),
    (3.0, (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0)),
    (0.0, (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0)),
)


def ratio_ticks(low: float, high: float, most: int = 8) -> list[float]:
    """At least 3 readable ticks in [low, high] on a log axis: the series that fits the spread (decades only when
    even 1-2-5 is too dense), else 4 points spaced evenly in log, rounded to 2 significant digits."""
    series = next(values for spread, values in RATIO_SERIES if high / low >= spread)
    inside = [float(f"{t:.3g}") for t in series if low <= t <= high]
    if len(inside) > most:
        inside = [t for t in inside if np.isclose(np.log10(t), round(np.log10(t)))]
    if len(inside) < 3:
        return sorted({float(f"{t:.2g}") for t in np.geomspace(low, high, 6)[1:-1]} | set(inside))
    return inside


def _plain_number_formatter():
    """1, 20, 500, 2k, 30M: no 2e+10, no 6x10^1."""
    engineering = EngFormatter(sep="")
    return FuncFormatter(lambda value, pos: f"{value:g}" if value < 1e4 else engineering(value, pos))


def _accuracy_limits(ax) -> None:
    """Zoom on the data, but never show accuracies below 0% or above 100%."""
    low, high = ax.get_ylim()
    ax.set_ylim(max(low, -0.02), min(high, 1.02))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{100 * value:.0f}%" if -1e-9 <= value <= 1 + 1e-9 else ""))


def _legend_below(ax, ncols: int = 3, **kwargs) -> None:
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.27), ncols=ncols, **kwargs)  # clear of the x label


# -- 1 -------------------------------------------------------------------------------------------------------


@styled
def importance_long_tail(
    cdf: pd.DataFrame, top_share: pd.DataFrame, heatmap: np.ndarray | None = None, block_size: int = 1,
    top_frac: float = 0.2, heatmap_title: str = "",
) -> Figure:
    """(a) cumulative attention mass vs token rank, per layer and mean; (b) per-block mass over decode steps."""
    has_heatmap = heatmap is not None and heatmap.size > 0
    figure = new_figure(DOUBLE_COLUMN_IN if has_heatmap else (3.5, 2.8))
    axes = figure.subplots(1, 2 if has_heatmap else 1, squeeze=False)[0]
    ax = axes[0]
    for i, (_, layer_curve) in enumerate(cdf.groupby("layer")):
        ax.plot(layer_curve["rank_frac"], layer_curve["cum_share"], color="0.65", linewidth=0.6,
                label="single layer" if i == 0 else None)
    mean_curve = cdf.groupby("rank_frac", as_index=False)["cum_share"].mean()
    ax.plot(mean_curve["rank_frac"], mean_curve["cum_share"], color="black", linewidth=1.8, label="mean over layers")
    ax.plot([0, 1], [0, 1], color="black", linestyle=":", linewidth=0.8, label="uniform attention")
    mean_top = float(top_share["top_share"].mean())
    ax.axvline(top_frac, color="black", linestyle="--", linewidth=0.7)
    ax.plot([top_frac], [mean_top], marker="o", color="black")
    ax.annotate(
        f"top {top_frac:.0%} of tokens hold\n{mean_top:.0%} of the mass\n"
        f"(layers: {top_share['top_share'].min():.0%}-{top_share['top_share'].max():.0%})",
        # Below the diagonal and above the lower-right legend: the one region no curve can enter.
        xy=(top_frac, mean_top), xytext=(top_frac + 0.22, 0.26), fontsize=7, va="bottom",
        arrowprops={"arrowstyle": "->", "linewidth": 0.6},
    )
    ax.set_xlabel("tokens ranked by attention received (% of tokens)")
    ax.set_ylabel("cumulative attention mass (%)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    _percent_axis(ax.xaxis)
    _percent_axis(ax.yaxis)
    ax.legend(loc="lower right")
    ax.set_title("(a) importance long tail")
    if has_heatmap:
        ax = axes[1]
        positive = heatmap[np.isfinite(heatmap) & (heatmap > 0)]
        vmin = max(float(np.percentile(positive, 1)) if positive.size else 1e-4, 1e-6)
        shown = np.where(np.isfinite(heatmap), np.clip(heatmap, vmin, None), np.nan)
        n_steps, n_blocks = heatmap.shape
        image = ax.imshow(
            shown, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis",
            norm=LogNorm(vmin=vmin, vmax=max(float(np.nanmax(shown)), vmin * 10)),
            extent=(0, n_blocks * block_size, 0.5, n_steps + 0.5),
        )
        ax.set_facecolor("white")  # blocks that do not exist yet stay blank
        ax.set_xlabel("KV position (tokens)")
        ax.set_ylabel("decode step")
        colorbar = figure.colorbar(image, ax=ax, pad=0.01)
        colorbar.ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        colorbar.ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        colorbar.ax.yaxis.set_minor_formatter(NullFormatter())
        colorbar.set_label(f"attention mass per {block_size}-token block\n(share of step, mean over layers)")
        ax.grid(False)
        ax.set_title(f"(b) per-block mass over decode{heatmap_title}")
    return figure


# -- 2 -------------------------------------------------------------------------------------------------------


@styled
def capacity_accuracy(accuracy: pd.DataFrame) -> Figure:
    """Accuracy with 95% Wilson CI vs HBM budget, one line per method; full cache as a band."""
    figure = new_figure((4.6, 3.0))
    ax = figure.subplots()
    full = accuracy[accuracy["is_full"]]
    for _, row in full.iterrows():
        ax.axhspan(row["ci_low"], row["ci_high"], color="0.88", zorder=0,
                   label=f"{FULL_LABEL}: 95% CI ({_n_text(full['n_scored'])})")
        ax.axhline(row["accuracy"], color="0.4", linestyle=(0, (1, 1)), linewidth=1.2, zorder=1,
                   label=f"{FULL_LABEL}: accuracy")
        break  # pooled frames have one full-cache row
    partial = accuracy[~accuracy["is_full"]]
    methods = [m for m in method_order(partial)]
    styles = _method_styles(methods)
    x_max = min(1.05, float(partial["hbm_budget"].max()) + 0.1)
    for i, method in enumerate(methods):
        rows = partial[partial["method"] == method].sort_values("hbm_budget")
        # Dodge methods sideways a little so that their error bars do not hide each other.
        x = rows["hbm_budget"] + (i - (len(methods) - 1) / 2) * 0.015 * x_max
        yerr = np.vstack([rows["accuracy"] - rows["ci_low"], rows["ci_high"] - rows["accuracy"]])
        ax.errorbar(x, rows["accuracy"], yerr=yerr, capsize=2, elinewidth=0.7,
                    label=f"{method} ({_n_text(rows['n_scored'])})", **styles[method])
        if "attended_frac" in rows:  # the traffic that bought the accuracy (analysis.report's caption has more)
            for xi, yi, attended in zip(x, rows["accuracy"], rows["attended_frac"]):
                if attended == attended:
                    ax.annotate(f"{attended:.0%}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=6,
                                color=styles[method].get("color", "0.3"))
    ax.set_xlabel(BUDGET_LABEL)
    ax.set_ylabel("accuracy (%), 95% Wilson CI")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(0, x_max)
    _percent_axis(ax.xaxis)
    _percent_axis(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


# -- 3 -------------------------------------------------------------------------------------------------------


@styled
def projected_latency(latency: pd.DataFrame, breakdown: pd.DataFrame, methods: list[str],
                      link_label: str = "host-link stall") -> Figure:
    """ms/token vs HBM budget per profile (one panel per method), and a stacked breakdown at one budget."""
    figure = new_figure((2.6 * (len(methods) + 1) + 1.2, 3.4))
    axes = figure.subplots(1, len(methods) + 1, squeeze=False)[0]
    styles = _profile_styles(latency["profile"].unique())
    full = latency[latency["is_full"]]
    for ax, method in zip(axes, methods):
        rows = pd.concat([latency[latency["method"] == method], full]).sort_values("hbm_budget")
        for profile, group in rows.groupby("profile"):
            ax.plot(group["hbm_budget"], group["ms_per_token"], label=profile, **styles[profile])
        ax.set_title(f"{method}" + (" (100%: full cache)" if not full.empty else ""), fontsize=8)
        ax.set_xlabel(BUDGET_LABEL)
        ax.set_ylabel("projected time per token (ms)")
        _percent_axis(ax.xaxis)
        _budget_ticks(ax, rows["hbm_budget"])
        _log_if_wide(ax, latency["ms_per_token"], ratio=5)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), title="hardware profile",
                  title_fontsize=7)
    ax = axes[-1]
    parts = [("compute_ms", "compute"), ("hbm_ms", "HBM (KV + weights)"), ("overhead_ms", "launch overhead"),
             ("link_stall_ms", link_label)]  # the profiles' own link: PCIe, NVLink-C2C, CXL
    # Shares of the step time, so that a slow profile does not flatten the fast ones; the total is written out.
    totals = breakdown["step_ms"].to_numpy(dtype=float)
    left = np.zeros(len(breakdown))
    positions = np.arange(len(breakdown))
    for (column, label), grey, hatch in zip(parts, GREYS, HATCHES):
        shares = breakdown[column].to_numpy(dtype=float) / totals
        if shares.max(initial=0.0) <= 1e-6:
            continue  # e.g. no link stall under pure eviction: no empty legend entry
        ax.barh(positions, shares, left=left, color=grey, hatch=hatch, edgecolor="black", linewidth=0.5, label=label)
        left += shares
    for position, total in zip(positions, totals):
        ax.text(1.02, position, f"{total:.3g} ms", va="center", fontsize=6, transform=ax.get_yaxis_transform())
    ax.set_yticks(positions, breakdown["profile"])
    ax.invert_yaxis()  # fastest on top
    ax.set_xlim(0, 1)
    _percent_axis(ax.xaxis)
    ax.set_xlabel("share of mean step time (%)")
    if not breakdown.empty:
        ax.set_title(f"breakdown: {breakdown['method'].iloc[0]}\nat {breakdown['hbm_budget'].iloc[0]:.0%} budget "
                     "(right: ms per step)", fontsize=8)
    _legend_below(ax, ncols=2, fontsize=6)
    ax.grid(axis="y", visible=False)
    return figure


# -- 4 -------------------------------------------------------------------------------------------------------


def _scatter_by_profile(ax, frame: pd.DataFrame, x: str, y: str, linewidths: float) -> None:
    """One hollow-marker scatter per hardware profile (greyscale-safe: the marker shape differs)."""
    styles = _profile_styles(frame["profile"].unique())
    for profile, group in frame.groupby("profile"):
        style = styles[profile]
        ax.scatter(group[x], group[y], marker=style["marker"], facecolors="none", edgecolors=style["color"],
                   label=profile, linewidths=linewidths)


@styled
def pareto(points: pd.DataFrame) -> Figure:
    """Accuracy vs projected ms/token (all policies x profiles) and vs HBM bytes per sequence; frontier marked."""
    figure = new_figure(DOUBLE_COLUMN_IN)
    ax_latency, ax_bytes = figure.subplots(1, 2)
    _scatter_by_profile(ax_latency, points, "ms_per_token", "accuracy", linewidths=0.9)
    _frontier_line(ax_latency, points[points["on_frontier_latency"]], "ms_per_token")
    _log_if_wide(ax_latency, points["ms_per_token"], which="x", ratio=10)
    ax_latency.set_xlabel("projected time per token (ms)")
    ax_latency.set_ylabel("accuracy (%)")
    _accuracy_limits(ax_latency)
    _legend_below(ax_latency, title="hardware profile", title_fontsize=7)
    ax_latency.set_title("(a) accuracy vs latency")

    per_run = points.drop_duplicates("run_dir")
    methods = method_order(per_run)
    method_styles = _method_styles(methods)
    for method in methods:
        group = per_run[per_run["method"] == method]
        style = method_styles[method]
        ax_bytes.scatter(group["kv_hbm_bytes_per_seq"] / MIB, group["accuracy"], marker=style["marker"],
                         facecolors="none", edgecolors=style["color"], label=method, linewidths=0.9)
    on_bytes = per_run[per_run["on_frontier_bytes"].astype(bool)].assign(x=lambda f: f["kv_hbm_bytes_per_seq"] / MIB)
    _frontier_line(ax_bytes, on_bytes, "x")
    ax_bytes.set_xlabel("KV bytes in HBM per sequence (MiB)")
    ax_bytes.set_ylabel("accuracy (%)")
    _accuracy_limits(ax_bytes)
    _legend_below(ax_bytes, ncols=2)
    ax_bytes.set_title("(b) accuracy vs HBM footprint")
    return figure


def _frontier_line(ax, frontier: pd.DataFrame, x: str) -> None:
    frontier = frontier.sort_values(x)
    ax.step(frontier[x], frontier["accuracy"], where="post", color="black", linewidth=0.9, zorder=1)
    ax.scatter(frontier[x], frontier["accuracy"], marker=".", color="black", s=14, zorder=3, label="Pareto frontier")


# -- 5 -------------------------------------------------------------------------------------------------------


@styled
def capacity(frame: pd.DataFrame, method: str) -> Figure:
    """Max concurrent sequences and projected aggregate throughput vs HBM budget, per profile, for one method."""
    figure = new_figure(DOUBLE_COLUMN_IN)
    ax_sequences, ax_throughput = figure.subplots(1, 2)
    rows = frame[(frame["method"] == method) | frame["is_full"]].sort_values("hbm_budget")
    styles = _profile_styles(rows["profile"].unique())
    for profile, group in rows.groupby("profile"):
        style = styles[profile]
        ax_sequences.plot(group["hbm_budget"], group["max_concurrency"], label=profile, **style)
        ax_throughput.plot(group["hbm_budget"], group["throughput_tokens_per_s"], label=profile, **style)
    for ax in (ax_sequences, ax_throughput):
        ax.set_xlabel(BUDGET_LABEL)
        _percent_axis(ax.xaxis)
        _budget_ticks(ax, rows["hbm_budget"])
    _log_if_wide(ax_sequences, rows["max_concurrency"], ratio=50)
    _log_if_wide(ax_throughput, rows["throughput_tokens_per_s"], ratio=50)
    ax_sequences.set_ylabel("max concurrent sequences")
    simulated = (rows["throughput_source"] != "bound").any() if "throughput_source" in rows else False
    ax_throughput.set_ylabel("aggregate throughput (tokens/s)")
    ax_sequences.set_title(f"(a) concurrent sequences: {method}", fontsize=8)
    ax_throughput.set_title("(b) throughput at that concurrency" + ("" if simulated else " (upper bound)"), fontsize=8)
    for ax in (ax_sequences, ax_throughput):
        if ax.get_yscale() == "linear":
            ax.yaxis.set_major_formatter(_plain_number_formatter())
    handles, labels = ax_sequences.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), title="hardware profile",
                  title_fontsize=7)
    return figure


# -- 6 -------------------------------------------------------------------------------------------------------


@styled
def sim_vs_measured(frame: pd.DataFrame, errors: dict) -> Figure:
    """Simulated vs measured time per sample with y = x, and the histogram of relative errors."""
    figure = new_figure(DOUBLE_COLUMN_IN)
    ax_scatter, ax_hist = figure.subplots(1, 2)
    _scatter_by_profile(ax_scatter, frame, "measured_s", "simulated_s", linewidths=0.8)
    low = float(min(frame["measured_s"].min(), frame["simulated_s"].min())) * 0.8
    high = float(max(frame["measured_s"].max(), frame["simulated_s"].max())) * 1.25
    ax_scatter.plot([low, high], [low, high], color="black", linestyle="--", linewidth=0.8, label="y = x")
    ax_scatter.set_xscale("log")
    ax_scatter.set_yscale("log")
    ax_scatter.set_xlim(low, high)
    ax_scatter.set_ylim(low, high)
    for axis in (ax_scatter.xaxis, ax_scatter.yaxis):
        axis.set_major_formatter(_plain_number_formatter())
    ax_scatter.set_xlabel("measured time per sample (s)")
    ax_scatter.set_ylabel("simulated time per sample (s)")
    ax_scatter.legend(loc="upper left")
    ax_scatter.set_title("(a) simulated vs measured")
    # Ratios on a log axis: a 2x over- and a 2x under-estimate sit symmetrically around 1.
    ratio = (frame["simulated_s"] / frame["measured_s"]).to_numpy(dtype=float)
    spread = max(ratio.max() / ratio.min(), 1.2)  # bins cover the data only, however far from 1x it lies
    bins = np.geomspace(ratio.min() / spread**0.05, ratio.max() * spread**0.05, min(30, max(6, len(frame) // 3)) + 1)
    ax_hist.hist(ratio, bins=bins, color="0.6", edgecolor="black", linewidth=0.5)
    ax_hist.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_hist.set_xscale("log")
    ax_hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.set_xlim(bins[0], bins[-1])
    ax_hist.xaxis.set_major_locator(FixedLocator(ratio_ticks(bins[0], bins[-1])))
    ax_hist.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    ax_hist.xaxis.set_minor_formatter(NullFormatter())
    ax_hist.set_xlabel("simulated / measured time (log scale; 1x = exact)")
    ax_hist.set_ylabel("samples")
    # The statistics go in the title: a text box inside would hide the tallest bars.
    ax_hist.set_title(f"(b) n = {errors['n']}: median |error| {errors['median_abs_rel_err']:.1%}, "
                      f"p95 {errors['p95_abs_rel_err']:.1%}")
    return figure


# -- 7 -------------------------------------------------------------------------------------------------------


@styled
def mass_lost_vs_accuracy(frame: pd.DataFrame, rho: float) -> Figure:
    """Projected attention mass lost vs measured accuracy (95% CI): how well the proxy predicts."""
    figure = new_figure((4.6, 3.0))
    ax = figure.subplots()
    methods = method_order(frame)
    styles = _method_styles(methods)
    for method in methods:
        rows = frame[frame["method"] == method]
        yerr = np.vstack([rows["accuracy"] - rows["ci_low"], rows["ci_high"] - rows["accuracy"]])
        ax.errorbar(rows["mass_lost"], rows["accuracy"], yerr=yerr, capsize=2, elinewidth=0.7, linestyle="none",
                    marker=styles[method]["marker"], color=styles[method]["color"],
                    label=f"{method} ({_n_text(rows['n_scored'])})")
    ax.set_xlabel("projected attention mass lost per step (%)")
    ax.set_ylabel("measured accuracy (%), 95% CI")
    _accuracy_limits(ax)
    _percent_axis(ax.xaxis)
    rho_text = f"Spearman rho = {rho:.2f}" if np.isfinite(rho) else "Spearman rho undefined\n(< 3 points or no variation)"
    ax.text(0.98, 0.97, f"{rho_text}\n{len(frame)} policies", transform=ax.transAxes, ha="right", va="top", fontsize=7,
            bbox={"facecolor": "white", "edgecolor": "0.7", "linewidth": 0.5})
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return figure


# -- accuracy vs recall traffic (the long workload's Pareto) -----------------------------------------------


@styled
def accuracy_vs_recall(cells: pd.DataFrame) -> Figure:
    """Accuracy (95% Wilson CI) vs recall traffic (recalled tokens per layer-step, % of the context), one curve
    per HBM budget and recall rule (hierarchy, nothing evicted), pure eviction at each budget at zero recall
    (its best scorer, hollow) and the full cache as a band. `cells`: one row per traced cell with columns
    policy, hbm_budget, evict_ratio, recall_rule, scorer, n, accuracy, ci_low, ci_high, recalled_frac,
    h2d_bytes_per_token_ref (the `capacity_accuracy_long.csv` the table command writes)."""
    figure = new_figure((5.2, 3.2))
    ax = figure.subplots()
    full = cells[cells["policy"] == "full"]
    if not full.empty:
        row = full.iloc[0]
        ax.axhspan(row["ci_low"], row["ci_high"], color="0.88", zorder=0, label=f"{FULL_LABEL} (n={int(row['n'])})")
        ax.axhline(row["accuracy"], color="0.4", linestyle=(0, (1, 1)), linewidth=1.0, zorder=1)
    hierarchy = cells[(cells["policy"] == "hierarchy") & (cells["evict_ratio"] == 0)]
    budgets = sorted(hierarchy["hbm_budget"].unique(), reverse=True)
    rules = sorted(hierarchy["recall_rule"].unique())
    for i, budget in enumerate(budgets):
        style = series_style(i)
        for j, rule in enumerate(rules):
            rows = hierarchy[(hierarchy["hbm_budget"] == budget) & (hierarchy["recall_rule"] == rule)]
            if rows.empty:
                continue
            rows = rows.sort_values("recalled_frac")
            yerr = np.vstack([rows["accuracy"] - rows["ci_low"], rows["ci_high"] - rows["accuracy"]])
            ax.errorbar(rows["recalled_frac"], rows["accuracy"], yerr=yerr, capsize=2, elinewidth=0.7,
                        color=style["color"], marker=style["marker"], linestyle="-" if j == 0 else "--",
                        label=f"HBM {budget:.0%}, recall {rule} ({_n_text(rows['n'])})")
        evict = cells[(cells["policy"] == "evict") & (cells["hbm_budget"] == budget)]
        if not evict.empty:
            best = evict.loc[evict["accuracy"].idxmax()]
            ax.errorbar([0.0], [best["accuracy"]], yerr=[[best["accuracy"] - best["ci_low"]],
                                                         [best["ci_high"] - best["accuracy"]]],
                        capsize=2, elinewidth=0.7, color=style["color"], marker=style["marker"],
                        markerfacecolor="white", linestyle="none",
                        label=f"HBM {budget:.0%}, pure eviction ({best['scorer']}, n={int(best['n'])})")
    ax.set_xlabel("recalled tokens per layer-step (% of the context)")
    ax.set_ylabel("accuracy (%), 95% Wilson CI")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(left=-0.01)
    _percent_axis(ax.xaxis)
    _percent_axis(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6)
    return figure


def recall_design_space(cells: pd.DataFrame, buffer_blocks: int, reference: str) -> Figure:
    """Accuracy (95% Wilson CI) vs H2D bytes per generated token at `reference`'s KV size, one panel per HBM
    budget, one curve per recall rule over its recall budgets (the oracle dashed: a ceiling), each rule's points
    repeated hollow at the bytes an LRU buffer of `buffer_blocks` blocks leaves (the same accuracy: the buffer
    changes what is copied, not what is attended), and the full cache as a band. `cells`: the
    `recall_design_space.csv` thoughtkv/recall_design.py writes."""
    budgets = sorted(cells.loc[cells["policy"] == "hierarchy", "hbm_budget"].unique())
    figure = new_figure(DOUBLE_COLUMN_IN)
    axes = figure.subplots(1, len(budgets), sharey=True, squeeze=False)[0]
    full = cells[cells["policy"] == "full"]
    rules = [r for r in ("quest", "quest-per-head", "score", "prev-layer", "prev-layer-per-head", "prev-step",
                         "prev-step-per-head", "oracle") if r in set(cells["recall_rule"].dropna())]
    buffered = f"buffer{buffer_blocks}_h2d_bytes_per_token_ref"
    for ax, budget in zip(axes, budgets, strict=True):
        if not full.empty:
            row = full.iloc[0]
            ax.axhspan(row["ci_low"], row["ci_high"], color="0.88", zorder=0, label=f"{FULL_LABEL} (n={int(row['n'])})")
        for j, rule in enumerate(rules):
            rows = cells[(cells["hbm_budget"] == budget) & (cells["recall_rule"] == rule)].sort_values("recall_budget")
            if rows.empty:
                continue
            style = series_style(j)
            yerr = np.vstack([rows["accuracy"] - rows["ci_low"], rows["ci_high"] - rows["accuracy"]])
            ax.errorbar(rows["buffer0_h2d_bytes_per_token_ref"] / 1e6, rows["accuracy"], yerr=yerr, capsize=2,
                        elinewidth=0.7, color=style["color"], marker=style["marker"],
                        linestyle="--" if rule == "oracle" else "-",
                        label=f"{rule}{' (ceiling)' if rule == 'oracle' else ''} ({_n_text(rows['n'])})")
            if buffered in rows:
                ax.plot(rows[buffered] / 1e6, rows["accuracy"], color=style["color"], marker=style["marker"],
                        markerfacecolor="white", linestyle=":", linewidth=0.8,
                        label=f"{rule}, LRU {buffer_blocks} blocks (+HBM)")
        ax.set_title(f"HBM {budget:.0%}", fontsize=8)
        ax.set_xlim(left=0)
        _percent_axis(ax.yaxis)
    figure.supxlabel(f"H2D MB per generated token at {reference}", fontsize=8)
    axes[0].set_ylabel("accuracy (%), 95% Wilson CI")
    axes[0].set_ylim(-0.02, 1.02)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=6)
    return figure
