"""Capacity as served: figures and a report section from a serving rate sweep (`thoughtkv capacity`).

    table = serving_table(results, run_dirs)           # the sweep's summaries + each run's accuracy and traffic
    capacity = capacity_table(table, tbt_slo_s=0.1, ttft_slo_s=10)   # per (run, profile): max sustainable rate
    write_serving_section(table, capacity, "report/")   # figures/serving_*.png, tables, report.md's section

A rate is *sustainable* for a (run, profile) when the p99 of every time between tokens is at most the TBT SLO,
the p99 time to first token at most the TTFT SLO (an overloaded server's queue grows through the arrival
window, so its TTFT grows without bound: this is what tells "keeps up" from "queues forever"), and no request
was rejected. The max sustainable rate is the highest swept rate below which every swept rate is sustainable:
the sweep brackets it (`bracket`), so it is exact to the grid's resolution, stated with it. What limits it
(`limit`) is the resource nearest saturation at the first failing rate (`utilisations`: the link, HBM, the GPU's
busy share, the batch limit), its figures in the table.

Figures (one panel per profile, one series per policy):
- goodput (tokens/s of requests whose mean TBT and TTFT meet the SLOs) vs arrival rate,
- p50 and p99 TBT vs arrival rate, the SLO drawn,
- at the knee (the max sustainable rate): H2D link utilisation, HBM occupancy (held KV + weights) and the GPU's
  busy share,
- the frontier: every policy as a point (max sustainable rate, accuracy with its 95% Wilson interval from the
  trace), labelled with its traffic (attended share of the context, H2D bytes per generated token as served).
Every caption names the model shapes the runs were priced at and the overhead mode with its host term.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.style import DOUBLE_COLUMN_IN, HATCHES, new_figure, save_figure, series_style, styled
from thoughtkv_base.markdown import markdown_table
from traces.stats import bytes_text

SECTION_TITLE = "Capacity as served"
FIGURE_STEMS = ("serving_goodput", "serving_tbt", "serving_knee", "serving_frontier")
DODGE = 0.04  # the frontier draws policies with the same rate this factor apart (x), for legibility
ALONE_CONCURRENCY = 1.5  # at most this many requests running on average: a request's steps are (mostly) alone
# What limits a rate: the resource nearest saturation at the first failing rate, each as a share of what it has.
RESOURCES = {"link bandwidth": "the host link's busier direction (bytes / bandwidth / time)",
             "HBM capacity": "HBM held at its fullest (weights + KV blocks or reservations) / capacity",
             "GPU compute": "the GPU's kernels' share of the iterations' time (the rest waits for copies or the host)",
             "batch limit": "most requests running at once / --max-batch"}


# ---------------------------------------------------------------- numbers --------------------------------------


def run_info(run_dirs) -> pd.DataFrame:
    """One row per trace run: its label, accuracy with 95% Wilson CI and traffic (analysis.load.run_row).

    The label is the report's (`frames.add_method`: a scorer, recall or model named when the runs shown differ in
    it) at the run's budget, 'pure eviction @ 30%' (`frames.with_budget`), so that `plot` and `capacity` name the
    same runs alike. Runs that still share a label (same knobs, e.g. two seeds) keep their own rates here, so
    their directory names are added."""
    from analysis.frames import add_method, with_budget
    from analysis.load import run_row
    from traces import open_run

    info = add_method(pd.DataFrame([run_row(open_run(run_dir)) for run_dir in run_dirs]))
    labels = [with_budget(m, b, f) for m, b, f in zip(info["method"], info["hbm_budget"], info["is_full"])]
    for names in (info["run_label"], info["run_dir"]):  # the directory's name, else its whole path
        shared = {label for label in labels if labels.count(label) > 1}
        labels = [f"{label} ({name})" if label in shared else label for label, name in zip(labels, names)]
    return info.assign(label=labels)


def serving_table(results: pd.DataFrame, run_dirs, profiles=None) -> pd.DataFrame:
    """The sweep's serving summaries joined with their runs' accuracy and traffic (on the resolved run path),
    with the served H2D bytes per generated token and HBM occupancy as shares of capacity; rows ordered by
    `profiles` (their panel order; default: by name), policy and rate."""
    info = run_info(run_dirs)
    keep = ["run_dir", "label", "n_scored", "n_correct", "accuracy", "ci_low", "ci_high", "attended_frac",
            "hbm_frac", "recalled_frac", "scorer", "recall_budget", "evict_ratio"]
    table = results.copy()
    table["run_dir"] = [str(Path(p).resolve()) for p in table["run_dir"]]
    table = table.drop(columns=[c for c in ("scorer", "recall_budget", "evict_ratio") if c in table]).merge(
        info[keep], on="run_dir", how="left")
    table["h2d_bytes_per_token_served"] = table["bytes_h2d"] / table["tokens"].where(table["tokens"] > 0)
    table["hbm_occupancy"] = table["mean_hbm_reserved_bytes"] / table["hbm_capacity_bytes"]
    table["hbm_occupancy_peak"] = table["peak_hbm_reserved_bytes"] / table["hbm_capacity_bytes"]
    order = list(profiles) if profiles is not None else sorted(table["profile"].unique())
    table["_order"] = table["profile"].map({p: i for i, p in enumerate(order)})
    return table.sort_values(["_order", "policy", "hbm_budget", "label", "rate_per_s"]).drop(
        columns="_order").reset_index(drop=True)


def sustainable(table: pd.DataFrame, tbt_slo_s: float, ttft_slo_s: float | None) -> pd.Series:
    """Per row: p99 TBT <= tbt_slo_s over all tokens and over the arrival window's last third (where a growing
    batch shows first), p99 TTFT <= ttft_slo_s (if given) and nothing rejected."""
    late = table["tbt_p99_late_s"].fillna(table["tbt_p99_s"]) if "tbt_p99_late_s" in table else table["tbt_p99_s"]
    ok = (table["tbt_p99_s"] <= tbt_slo_s) & (late <= tbt_slo_s) & (table["n_rejected"] == 0)
    if ttft_slo_s is not None:
        ok &= table["ttft_p99_s"] <= ttft_slo_s
    return ok.fillna(False)


def bracket(rates, ok) -> tuple[float | None, float | None]:
    """(highest sustainable rate below which every swept rate is sustainable, the lowest unsustainable rate):
    (None, r) when even the lowest swept rate fails, (r, None) when none fails."""
    order = np.argsort(np.asarray(rates, dtype=float))
    rates = np.asarray(rates, dtype=float)[order]
    ok = np.asarray(ok, dtype=bool)[order]
    failed = np.flatnonzero(~ok)
    if not len(failed):
        return float(rates[-1]), None
    first = failed[0]
    return (float(rates[first - 1]) if first > 0 else None), float(rates[first])


GROUP = ["run_dir", "profile"]


def capacity_table(table: pd.DataFrame, tbt_slo_s: float, ttft_slo_s: float | None) -> pd.DataFrame:
    """Per (run, profile): the max sustainable rate and the first failing one, the knee's link utilisation, HBM
    occupancy and TBT, what limits the rate there (`limit`), and the run's accuracy, CI and traffic."""
    table = table.assign(sustainable=sustainable(table, tbt_slo_s, ttft_slo_s))
    rows = []
    for (run_dir, profile), group in table.groupby(GROUP, sort=False):
        low, high = bracket(group["rate_per_s"], group["sustainable"])
        knee = group[group["rate_per_s"] == low].iloc[0] if low is not None else group.iloc[0]
        beyond = group[group["rate_per_s"] == high].iloc[0] if high is not None else None
        first = group.iloc[0]
        alone = alone_failure(beyond, tbt_slo_s, ttft_slo_s) if low is None else None
        rows.append({
            "run_dir": run_dir, "profile": profile, "label": first["label"], "policy": first["policy"],
            "hbm_budget": first["hbm_budget"], "max_rate_per_s": low, "first_failing_rate_per_s": high,
            "knee_tbt_p99_s": knee["tbt_p99_s"], "knee_ttft_p99_s": knee["ttft_p99_s"],
            "knee_link_util_h2d": knee["link_util_h2d"], "knee_hbm_occupancy": knee["hbm_occupancy"],
            "knee_hbm_occupancy_peak": knee["hbm_occupancy_peak"], "knee_mean_concurrency": knee["mean_concurrency"],
            "knee_gpu_util": knee.get("gpu_busy_frac", math.nan), "knee_n_preemptions": knee.get("n_preemptions", 0),
            # each resource's share at the first failing rate (at the top swept rate when none failed)
            **{f"fail_{key}": value for key, value in utilisations(beyond if beyond is not None else knee).items()},
            "knee_throughput_tokens_per_s": knee["throughput_tokens_per_s"],
            "limit": f"SLO out of reach: {alone}" if alone else
            limit(beyond if beyond is not None else knee, tbt_slo_s, ttft_slo_s, beyond is None),
            "no_rate_meets_slo": alone is not None,
            "h2d_bytes_per_token_served": knee["h2d_bytes_per_token_served"],
            **{c: first[c] for c in ("n_scored", "n_correct", "accuracy", "ci_low", "ci_high", "attended_frac",
                                     "model", "as_model", "lengths", "overhead_mode", "host_term", "transfer",
                                     "max_batch", "duration_s") if c in first},
            "admission": first.get("admission", "peak"),
            "tbt_slo_s": tbt_slo_s, "ttft_slo_s": ttft_slo_s, "rates_swept": int(group["rate_per_s"].nunique()),
        })
    return pd.DataFrame(rows)


def utilisations(row) -> dict[str, float]:
    """Each resource's share of what it has in a swept row (RESOURCES): link, HBM, GPU and batch."""
    def value(name: str) -> float:
        x = row.get(name, math.nan) if hasattr(row, "get") else row[name]
        return float(x) if x is not None and pd.notna(x) else math.nan

    link = np.nanmax([value("link_util_h2d"), value("link_util_d2h"), 0.0])
    gpu = value("gpu_busy_frac")
    return {"link": float(link), "hbm": value("hbm_occupancy_peak"), "gpu": value("gpu_util") if math.isnan(gpu) else gpu,
            "batch": value("max_concurrency") / value("max_batch") if value("max_batch") > 0 else math.nan}


UTILISATION_NAMES = {"link": "link bandwidth", "hbm": "HBM capacity", "gpu": "GPU compute", "batch": "batch limit"}


WALL_MARGIN = 0.02  # a full HBM, link or batch within this share of the busiest resource is named before the GPU


def limit(row, tbt_slo_s: float, ttft_slo_s: float | None, never_failed: bool) -> str:
    """What stops a rate, read at the first failing rate: the resource nearest saturation (the largest share of
    `utilisations`: the host link, HBM, the GPU's busy share of the iterations, the batch limit), or requests
    rejected outright. A loaded continuous-batching GPU is busy through nearly all of every iteration whatever
    stops the rate, so a wall (HBM, the batch limit, the link) within WALL_MARGIN of it is what is named."""
    if never_failed:
        return "none reached"
    if row["n_rejected"] > 0:
        return "requests larger than HBM"
    shares = {k: v for k, v in utilisations(row).items() if not math.isnan(v)}
    if not shares:
        return "queueing"
    top = max(shares.values())
    for wall in ("hbm", "batch", "link"):
        if wall in shares and shares[wall] >= top - WALL_MARGIN:
            return UTILISATION_NAMES[wall]
    return UTILISATION_NAMES["gpu"]


def utilisation_text(row) -> str:
    """'link 62% · HBM 48% · GPU 97%': the shares at the first failing rate the limit was read from."""
    parts = [f"{label} {100 * row[f'fail_{key}']:.0f}%" for key, label in (("link", "link"), ("hbm", "HBM"),
                                                                          ("gpu", "GPU"))
             if f"fail_{key}" in row and pd.notna(row[f"fail_{key}"])]
    return " · ".join(parts) or "-"


def alone_failure(row, tbt_slo_s: float, ttft_slo_s: float | None) -> str | None:
    """Why no rate can meet the SLO, read at a failing rate where requests rarely overlapped (mean concurrency
    <= ALONE_CONCURRENCY): a step's time only grows with the batch, so when even the median token (or first
    token) there misses the SLO, no lower rate can meet a p99 bound: 'one request alone takes ~9.1 ms between
    tokens'. None when requests overlapped more, none arrived, or the median met the SLO."""
    if row["n_requests"] < 1 or row["mean_concurrency"] > ALONE_CONCURRENCY:
        return None
    at = f"p50 at {row['rate_per_s']:g} req/s, mean concurrency {row['mean_concurrency']:.2g}"
    if row["n_rejected"] >= row["n_requests"]:
        return "one request alone does not fit in HBM"
    if row["tbt_p50_s"] > tbt_slo_s:
        return f"one request alone takes ~{_duration(row['tbt_p50_s'])} between tokens ({at})"
    if ttft_slo_s is not None and row["ttft_p50_s"] > ttft_slo_s:
        return f"one request alone takes ~{_duration(row['ttft_p50_s'])} to its first token ({at})"
    return None


def _duration(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def rate_text(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def max_rate_text(row) -> str:
    """'12.3' or '< 0.5' (the lowest swept rate failed) or '≥ 80' (no swept rate failed)."""
    if row["max_rate_per_s"] is None or pd.isna(row["max_rate_per_s"]):
        return f"< {rate_text(row['first_failing_rate_per_s'])}"
    if row["first_failing_rate_per_s"] is None or pd.isna(row["first_failing_rate_per_s"]):
        return f"≥ {rate_text(row['max_rate_per_s'])}"
    return rate_text(row["max_rate_per_s"])


def priced_text(table: pd.DataFrame) -> str:
    """'projected to qwen2-7b (bfloat16), R1-7B GSM8K-like lengths (r1-7b/gsm8k); overheads cuda-graphs (host term
    cited)': what every caption must say about what was priced."""
    first = table.iloc[0]
    model = f"projected to {first['as_model']}" if isinstance(first.get("as_model"), str) else \
        f"the traced model's shapes ({first['model']})"
    lengths = f", request lengths {first['lengths']} (simulator/lengths.py)" if isinstance(first.get("lengths"), str) \
        else ", traced request lengths"
    modes = sorted({f"{m} (host term {t})" for m, t in zip(table["overhead_mode"], table["host_term"])})
    return f"{model}{lengths}; overheads {', '.join(modes)}"


def winners_text(capacity: pd.DataFrame) -> str:
    """Per profile: the policy with the highest max rate among those whose accuracy interval overlaps the best
    accuracy's, what limits each policy there, and which resource decides (HBM capacity vs link bandwidth)."""
    parts = []
    for profile, group in capacity.groupby("profile", sort=False):
        best = group["accuracy"].max()
        best_low = group.loc[group["accuracy"] == best, "ci_low"].max()
        keeping = group[group["ci_high"] >= best_low]  # accuracy indistinguishable from the best at these n
        rates = keeping["max_rate_per_s"].fillna(0.0)
        winner = keeping.loc[rates.idxmax()] if len(keeping) else group.iloc[0]
        limits = "; ".join(f"{r['label']} {max_rate_text(r)}/s ({r['limit']})" for _, r in group.iterrows())
        parts.append(f"on {profile}, {winner['label']} serves the most requests at the best accuracy "
                     f"({max_rate_text(winner)} req/s; {limits})")
    return "; ".join(parts)


# ---------------------------------------------------------------- figures --------------------------------------


def _panels(table: pd.DataFrame, height_scale: float = 1.0, sharex: bool = False):
    profiles = list(dict.fromkeys(table["profile"]))
    figure = new_figure((DOUBLE_COLUMN_IN[0], DOUBLE_COLUMN_IN[1] * height_scale))
    axes = figure.subplots(1, len(profiles), squeeze=False, sharey=True, sharex=sharex)[0]
    return figure, dict(zip(profiles, axes))


def _plain(minor: bool = False):
    """Log-axis tick labels as plain numbers (2, 5, 20), minor ones only at 2 and 5 x 10^k."""
    from matplotlib.ticker import FuncFormatter

    def text(value, _position):
        if value <= 0 or (minor and round(value / 10 ** math.floor(math.log10(value)), 6) not in (2, 5)):
            return ""
        return f"{value:g}"

    return FuncFormatter(text)


def _labels(table: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(table.sort_values(["policy", "hbm_budget"])["label"]))


def _legend(figure, axes) -> None:
    handles, labels = next(iter(axes.values())).get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4))


@styled
def goodput_figure(table: pd.DataFrame) -> Figure:
    figure, axes = _panels(table)
    for k, label in enumerate(_labels(table)):
        for profile, ax in axes.items():
            rows = table[(table["label"] == label) & (table["profile"] == profile)].sort_values("rate_per_s")
            ax.plot(rows["rate_per_s"], rows["goodput_tokens_per_s"], label=label, **series_style(k))
    for profile, ax in axes.items():
        _rate_axis(ax, profile)
    next(iter(axes.values())).set_ylabel("goodput (tokens/s within SLO)")
    _legend(figure, axes)
    return figure


def _rate_axis(ax, profile: str) -> None:
    """A panel's x axis: arrival rate on a log scale with plain tick labels, titled by its profile."""
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_plain())
    ax.xaxis.set_minor_formatter(_plain(minor=True))
    ax.set_title(_wrapped(profile))
    ax.set_xlabel("arrival rate (requests/s)")


@styled
def tbt_figure(table: pd.DataFrame, tbt_slo_s: float) -> Figure:
    figure, axes = _panels(table)
    for k, label in enumerate(_labels(table)):
        style = series_style(k)
        for profile, ax in axes.items():
            rows = table[(table["label"] == label) & (table["profile"] == profile)].sort_values("rate_per_s")
            ax.plot(rows["rate_per_s"], 1e3 * rows["tbt_p99_s"], label=label, **style)
            ax.plot(rows["rate_per_s"], 1e3 * rows["tbt_p50_s"], color=style["color"], marker=style["marker"],
                    linestyle=":", linewidth=0.8, markersize=2.5, alpha=0.8)
    for profile, ax in axes.items():
        ax.axhline(1e3 * tbt_slo_s, color="0.4", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_plain())
        _rate_axis(ax, profile)
    next(iter(axes.values())).set_ylabel("TBT p99 (solid), p50 (dotted), ms")
    _legend(figure, axes)
    return figure


@styled
def knee_figure(capacity: pd.DataFrame) -> Figure:
    """At each (policy, profile)'s max sustainable rate: H2D link utilisation, HBM occupancy, the GPU's busy share."""
    profiles = list(dict.fromkeys(capacity["profile"]))
    labels = _labels(capacity)
    figure = new_figure(DOUBLE_COLUMN_IN)
    panels = [("knee_link_util_h2d", "H2D link utilisation at the knee"),
              ("knee_hbm_occupancy_peak", "HBM held at the knee: peak (bar), mean (–)")]
    if "knee_gpu_util" in capacity and capacity["knee_gpu_util"].notna().any():
        panels.append(("knee_gpu_util", "GPU busy share of the iterations at the knee"))
    axes = figure.subplots(1, len(panels))
    width = 0.8 / max(len(labels), 1)
    for ax, (column, title) in zip(axes, panels):
        for k, label in enumerate(labels):
            rows = capacity[capacity["label"] == label].set_index("profile").reindex(profiles)
            x = np.arange(len(profiles)) + (k - (len(labels) - 1) / 2) * width
            ax.bar(x, rows[column].fillna(0.0), width, label=label, color=series_style(k)["color"],
                   hatch=HATCHES[k % len(HATCHES)], edgecolor="0.2", linewidth=0.4)
            if column == "knee_hbm_occupancy_peak":
                ax.scatter(x, rows["knee_hbm_occupancy"], marker="_", s=60, color="black", zorder=3)
        ax.set_xticks(range(len(profiles)), [_wrapped(p, 18) for p in profiles])
        ax.set_ylim(0, 1.05)
        ax.yaxis.set_major_formatter(_percent())
        ax.set_title(title, fontsize=8)
    handles, names = axes[0].get_legend_handles_labels()
    figure.legend(handles, names, loc="outside lower center", ncols=min(len(names), 4))
    return figure


def _wrapped(name: str, width: int = 32) -> str:
    """A profile name on lines of at most `width` characters (a file's name, 'h100-pcie (file hw2/...)', is long)."""
    import textwrap

    return "\n".join(textwrap.wrap(name, width)) or name


def _percent():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=0)


LABEL_COLUMN_X = 0.74  # the frontier's traffic labels start here (axes fraction); every point lies left of it
LABEL_GAP = 11.0  # accuracy points between two labels' anchors (two lines of 5 pt text)


@styled
def frontier_figure(capacity: pd.DataFrame) -> Figure:
    """Per profile: every policy at (max sustainable rate, accuracy [95% CI]), labelled with its traffic.

    The labels stand in a column right of every point (x limits chosen so that the points end before
    LABEL_COLUMN_X), at their points' accuracies spread LABEL_GAP apart, each joined to its point by a thin
    line: no label lies on an error bar however the rates and intervals fall."""
    figure, axes = _panels(capacity, height_scale=1.25, sharex=True)
    labels = _labels(capacity)
    plotted = set()  # the rates drawn, for the shared x range
    notes: dict[str, list[tuple[float, float, str, str]]] = {p: [] for p in axes}  # (accuracy, rate, text, colour)
    for k, label in enumerate(labels):
        style = series_style(k)
        dodge = 1.0 + DODGE * (k - (len(labels) - 1) / 2)  # policies at one rate stay apart
        for profile, ax in axes.items():
            row = capacity[(capacity["label"] == label) & (capacity["profile"] == profile)]
            if row.empty:
                continue
            row = row.iloc[0]
            rate = row["max_rate_per_s"] if row["max_rate_per_s"] is not None and pd.notna(row["max_rate_per_s"]) \
                else 0.5 * row["first_failing_rate_per_s"]  # below the lowest swept rate: drawn at half of it
            plotted.add(float(rate))
            rate *= dodge
            accuracy = 100 * row["accuracy"]
            ax.errorbar([rate], [accuracy], yerr=[[accuracy - 100 * row["ci_low"]], [100 * row["ci_high"] - accuracy]],
                        color=style["color"], marker=style["marker"], linestyle="none", capsize=2, label=label,
                        markerfacecolor="none" if row["first_failing_rate_per_s"] is None or
                        pd.isna(row["first_failing_rate_per_s"]) else style["color"])
            notes[profile].append((accuracy, rate, f"{max_rate_text(row)}/s, att {row['attended_frac']:.0%}\n"
                                   f"H2D {bytes_text(row['h2d_bytes_per_token_served'] or 0)}/tok", style["color"]))
    low, high = min(plotted) / 1.6, max(plotted) * (1 + DODGE * len(labels)) * 1.15
    x_max = low * (high / low) ** (1 / (LABEL_COLUMN_X - 0.04))  # the points end left of the label column
    for profile, ax in axes.items():
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_plain())
        ax.xaxis.set_minor_formatter(_plain(minor=True))
        ax.set_xlim(low, x_max)
        ax.set_ylim(-16, 112)
        column_x = low * (x_max / low) ** (LABEL_COLUMN_X - 0.02)
        ax.axvspan(column_x, x_max, color="0.96", zorder=0, linewidth=0)  # the labels' column
        ax.set_title(_wrapped(profile))
        ax.set_xlabel("max sustainable rate (requests/s)")
        for (accuracy, rate, text, color), y in zip(sorted(notes[profile]), _spread([a for a, *_ in
                                                                                     sorted(notes[profile])])):
            ax.annotate(text, (rate, accuracy), xytext=(LABEL_COLUMN_X, y), textcoords=("axes fraction", "data"),
                        fontsize=5.0, color=color, va="center", ha="left",
                        arrowprops=dict(arrowstyle="-", color=color, linewidth=0.4, alpha=0.5, shrinkA=0, shrinkB=2))
    next(iter(axes.values())).set_ylabel("accuracy (%), 95% CI")
    _legend(figure, axes)
    return figure


def _spread(values: list[float], low: float = -12.0, high: float = 108.0, gap: float = LABEL_GAP) -> list[float]:
    """Sorted `values` moved apart to at least `gap` each, within [low, high] where they fit (label anchors)."""
    out = [max(low, v) for v in values]
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    overflow = out[-1] - high if out else 0.0
    if overflow > 0:  # shift down, then keep the gaps from the top
        out[-1] = high
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1] - gap)
    return out


# ---------------------------------------------------------------- the report section ---------------------------


def capacity_markdown(capacity: pd.DataFrame) -> str:
    """The per (policy, profile) table of the section."""
    peak = "max_rate_peak_per_s" in capacity
    header = ["profile", "policy", "max rate (req/s)", *(["peak reservation (req/s)"] if peak else []),
              "limit beyond it", "link / HBM / GPU at first failing rate", "accuracy % [95% CI]", "n", "attended %",
              "H2D/token (served)", "link util. at knee", "HBM occupancy at knee", "TBT p99 at knee (ms)"]
    rows = []
    for _, r in capacity.iterrows():
        peak_cell = [max_rate_text({"max_rate_per_s": r["max_rate_peak_per_s"],
                                    "first_failing_rate_per_s": r["first_failing_rate_peak_per_s"]})] if peak else []
        rows.append([
            r["profile"], r["label"], max_rate_text(r), *peak_cell, r["limit"], utilisation_text(r),
            f"{100 * r['accuracy']:.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]", str(int(r["n_scored"])),
            f"{100 * r['attended_frac']:.1f}", bytes_text(r["h2d_bytes_per_token_served"] or 0),
            f"{100 * r['knee_link_util_h2d']:.0f}%", f"{100 * r['knee_hbm_occupancy']:.0f}%",
            f"{1e3 * r['knee_tbt_p99_s']:.1f}"])
    return "\n".join(markdown_table(header, rows))


def admission_text(table: pd.DataFrame) -> str:
    """How the rows admitted requests (simulator/admission.py), for the section's first line."""
    first = table.iloc[0]
    if first.get("admission", "peak") == "peak":
        return "HBM admission by each request's peak KV (never preempted)"
    return (f"paged HBM admission (KV blocks as each request grows; the last admitted preempted by "
            f"{first.get('preempt', 'recompute')} when they run out), chunked prefill under "
            f"{int(first['max_batched_tokens']) if pd.notna(first.get('max_batched_tokens')) else 'vLLM default'} "
            "tokens per iteration")


def slo_text(tbt_slo_s: float, ttft_slo_s: float | None) -> str:
    ttft = f" and p99 TTFT ≤ {ttft_slo_s:g} s" if ttft_slo_s is not None else ""
    return f"p99 TBT ≤ {1e3 * tbt_slo_s:g} ms{ttft}"


def captions(table: pd.DataFrame, capacity: pd.DataFrame, tbt_slo_s: float, ttft_slo_s: float | None) -> dict:
    """Each serving figure's caption. What was priced (model shapes, lengths, overheads: `priced_text`) is said once,
    in the section's opening paragraph, not in every caption."""
    slo = slo_text(tbt_slo_s, ttft_slo_s)
    return {
        "serving_goodput": f"Goodput (tokens/s of requests whose mean TBT ≤ {1e3 * tbt_slo_s:g} ms"
                           f"{'' if ttft_slo_s is None else f' and TTFT ≤ {ttft_slo_s:g} s'}) vs Poisson arrival rate, "
                           f"per policy and profile.",
        "serving_tbt": "Time between tokens vs arrival rate: p99 (solid) and p50 (dotted), the SLO dashed; TBT "
                       "grows with the batch (every running request's KV read per iteration) and with the link's "
                       "queue (recalls).",
        "serving_knee": f"At each policy's max sustainable rate ({slo}): H2D link utilisation, HBM occupancy "
                        f"(weights + held KV, share of capacity: peak and mean) and the GPU's busy share (its kernels' "
                        f"share of the iterations' time). The limit in the table is the resource nearest saturation at the first "
                        f"failing rate.",
        "serving_frontier": f"The serving frontier: per profile, every policy at (max arrival rate with {slo}, "
                            f"accuracy with its 95% Wilson interval from the traces), labelled with its traffic "
                            f"(attended share of the context; H2D bytes per generated token as served) in the "
                            f"shaded column, each label joined to its point; hollow: no swept rate failed; policies "
                            f"at one rate are dodged apart by a few percent. Which policy wins where and why: "
                            f"{winners_text(capacity)}.",
    }


def write_serving_section(table: pd.DataFrame, capacity: pd.DataFrame, report_dir: str | Path, tbt_slo_s: float,
                          ttft_slo_s: float | None, append_to: str | Path | None = None) -> list[Path]:
    """Figures (report_dir/figures/serving_*.{png,pdf}), the tables (report_dir/tables/serving.csv,
    capacity_served.csv) and the section's Markdown: appended to `append_to` (a report.md) or written to
    report_dir/serving.md. Returns the files written."""
    report_dir = Path(report_dir)
    figures_dir, tables_dir = report_dir / "figures", report_dir / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(tables_dir / "serving.csv", index=False)
    capacity.to_csv(tables_dir / "capacity_served.csv", index=False)
    written = [tables_dir / "serving.csv", tables_dir / "capacity_served.csv"]
    drawn = {"serving_goodput": goodput_figure(table), "serving_tbt": tbt_figure(table, tbt_slo_s),
             "serving_knee": knee_figure(capacity), "serving_frontier": frontier_figure(capacity)}
    text = captions(table, capacity, tbt_slo_s, ttft_slo_s)
    titles = {"serving_frontier": "The serving frontier: accuracy vs max sustainable arrival rate",
              "serving_goodput": "Goodput vs arrival rate", "serving_tbt": "Time between tokens vs arrival rate",
              "serving_knee": "Link and HBM at the knee"}
    lines = [f"## {SECTION_TITLE}", "",
             f"Continuous batching with {admission_text(table)} and one shared host link "
             f"(`thoughtkv capacity`, simulator/serving.py); {table['duration_s'].iloc[0]:g} s of Poisson arrivals per "
             f"rate (a window of few request lifetimes overstates the knee: simulator/README.md, \"Finite windows\"); "
             f"sustainable = {slo_text(tbt_slo_s, ttft_slo_s)}, nothing rejected. Priced: {priced_text(table)} (every "
             f"figure of this section).", ""]
    for stem in ("serving_frontier", "serving_goodput", "serving_tbt", "serving_knee"):
        paths = save_figure(drawn[stem], figures_dir, stem)
        written += paths
        png, pdf = (p.relative_to(report_dir).as_posix() for p in paths)
        lines += [f"### {titles[stem]}", "", f"![{titles[stem]}]({png})", "", f"{text[stem]} ([PDF]({pdf}))", ""]
    lines += ["### Max sustainable rate per policy and profile", "", capacity_markdown(capacity), "",
              "Numbers: tables/capacity_served.csv (per policy and profile), tables/serving.csv (every swept rate).",
              ""]
    markdown = "\n".join(lines)
    if append_to is not None:
        with open(append_to, "a", encoding="utf-8") as handle:
            handle.write("\n" + markdown)
        written.append(Path(append_to))
    else:
        (report_dir / "serving.md").write_text(markdown)
        written.append(report_dir / "serving.md")
    return written
