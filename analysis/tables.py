"""The report's tables: numeric DataFrames (tested) and their Markdown and LaTeX (booktabs) renderings.

Each `*_table` function returns numbers; `display_*` turns them into the strings a reader sees, and
`to_markdown` / `to_latex` write any display frame.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import stats
from analysis.frames import focus_method, method_order, pooled_accuracy, with_budget
from traces.stats import REFERENCE_ARCHITECTURE, bytes_text

# Traffic columns of a run row (`analysis.load.run_row`, from traces.stats.traffic_summary) and the weight that
# pools them over runs of one method and budget: fractions per decode layer-step, bytes per decode step, so a
# pooled value is what traffic_summary would give on the runs' steps tables put together.
TRAFFIC_WEIGHTS = {
    "attended_frac": "decode_layer_steps",
    "recalled_tokens_per_layer_step": "decode_layer_steps",
    "recalled_frac": "decode_layer_steps",
    "h2d_bytes_per_token": "decode_steps",
    "d2h_bytes_per_token": "decode_steps",
    "h2d_bytes_per_token_ref": "decode_steps",
    "d2h_bytes_per_token_ref": "decode_steps",
}

# -- numbers -----------------------------------------------------------------------------------------------


def _pooled_traffic(accuracy: pd.DataFrame) -> pd.DataFrame:
    """(method, hbm_budget) -> each traffic column, weighted as TRAFFIC_WEIGHTS says; NaN where runs lack it."""
    keys = accuracy[["method", "hbm_budget"]].drop_duplicates()
    for column, weight in TRAFFIC_WEIGHTS.items():
        if column not in accuracy or weight not in accuracy:
            keys[column] = np.nan
            continue
        w = accuracy[weight].astype("float64")
        part = accuracy.assign(_xw=accuracy[column].astype("float64") * w, _w=w.where(accuracy[column].notna(), 0.0))
        grouped = part.groupby(["method", "hbm_budget"], as_index=False)[["_xw", "_w"]].sum()
        grouped[column] = grouped["_xw"] / grouped["_w"].where(grouped["_w"] > 0)
        keys = keys.merge(grouped[["method", "hbm_budget", column]], on=["method", "hbm_budget"], how="left")
    return keys


CAPACITY_COLUMNS = ["method", "hbm_budget", "evicted_frac", "accuracy", "ci_low", "ci_high", "n", *TRAFFIC_WEIGHTS]


def capacity_accuracy_table(accuracy: pd.DataFrame) -> pd.DataFrame:
    """The seed's shape: method, HBM budget, evicted share, accuracy with 95% Wilson CI, n — and what each
    method moved to get there: attended share of the context, recalled tokens per layer-step,
    H2D / D2H bytes per generated token for the run's model and priced at `REFERENCE_ARCHITECTURE`.

    `accuracy` is `frames.accuracy_frame(runs)`. Runs of the same method and budget are pooled; the evicted
    share is the n-weighted mean of the runs' measured share of KV entries evicted by the end of decoding; the
    traffic columns are pooled per decode (layer-)step (TRAFFIC_WEIGHTS), NaN for runs that lack them.
    """
    if accuracy.empty:
        return pd.DataFrame(columns=CAPACITY_COLUMNS)
    pooled = pooled_accuracy(accuracy)
    weighted = accuracy.assign(_w=accuracy["evicted_frac"] * accuracy["n_scored"])
    evicted = weighted.groupby(["method", "hbm_budget"], as_index=False)[["_w", "n_scored"]].sum()
    evicted["evicted_frac"] = evicted["_w"] / evicted["n_scored"]
    table = pooled.merge(evicted[["method", "hbm_budget", "evicted_frac"]], on=["method", "hbm_budget"])
    table = table.merge(_pooled_traffic(accuracy), on=["method", "hbm_budget"], how="left")
    order = {m: i for i, m in enumerate(method_order(table))}
    table = table.assign(_order=table["method"].map(order)).sort_values(["_order", "hbm_budget"], ascending=[True, False])
    table = table.rename(columns={"n_scored": "n"})
    return table[CAPACITY_COLUMNS].reset_index(drop=True)


def display_completion(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run (long generations): the share of samples stopped by the token limit, and accuracy
    over all scored samples and over the finished ones (EOS), each as `p% [low–high] (k/n)`, 95% Wilson CI.
    `runs` is `analysis.load.run_table` (columns from traces.stats.completion_summary)."""
    def cell(k, n) -> str:
        if not n:
            return "–"
        low, high = stats.wilson_interval(int(k), int(n))
        return f"{k / n:.0%} [{low:.0%}–{high:.0%}] ({int(k)}/{int(n)})"

    return pd.DataFrame({
        "run": runs["run_label"],
        "stopped by token limit": [cell(k, n) for k, n in zip(runs["n_token_limit"], runs["n_samples"])],
        "accuracy, all": [cell(k, n) for k, n in zip(runs["n_correct"], runs["n_scored"])],
        "accuracy, finished": [cell(k, n) for k, n in zip(runs["n_finished_correct"], runs["n_finished_scored"])],
    })


def latency_table(latency: pd.DataFrame, hbm_budget: float, stall_method: str | None = None) -> pd.DataFrame:
    """Projected ms/token per hardware profile: full cache, then each method at (its budget nearest) `hbm_budget`.

    Also the link-stall share of `stall_method` (default: the focus method), which says why offload costs time.
    """
    if latency.empty:
        return pd.DataFrame()
    stall_method = stall_method or focus_method(latency)
    columns, stall_column = {}, None
    for method in method_order(latency):
        rows = latency[latency["method"] == method]
        nearest = rows["hbm_budget"].iloc[(rows["hbm_budget"] - hbm_budget).abs().argmin()]
        rows = rows[np.isclose(rows["hbm_budget"], nearest)]
        name = with_budget(method, nearest, bool(rows["is_full"].all()))
        columns[f"{name} (ms/token)"] = rows.groupby("profile")["ms_per_token"].mean()
        if method == stall_method:
            stall_column = f"link stall share, {name}"
            stall = rows.groupby("profile")["link_stall_frac"].mean()
    table = pd.DataFrame(columns)
    if stall_column is not None:
        table[stall_column] = stall
    table = table.sort_values(table.columns[0]).rename_axis("profile").reset_index()
    return table


def sim_vs_measured_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per profile and overall: n, median and p95 of |relative error|, mean signed error."""
    if frame.empty:
        return pd.DataFrame(columns=["profile", "n", "median_abs_rel_err", "p95_abs_rel_err", "mean_rel_err"])
    def row(name, group) -> dict:
        flags = {}
        if "contended" in group:  # kept, flagged: how many of these pairs were traced while the CPUs were busy
            flags["contended_samples"] = int(group["contended"].eq(True).sum())
        if "same_host" in group:
            flags["same_host"] = bool(group["same_host"].eq(True).all())
        return {"profile": name, **stats.error_stats(group["simulated_s"], group["measured_s"]), **flags}

    rows = [row(p, g) for p, g in frame.groupby("profile")]
    if len(rows) > 1:
        rows.append(row("all", frame))
    return pd.DataFrame(rows)


# -- display strings ----------------------------------------------------------------------------------------


def _percent(value: float, digits: int = 1) -> str:
    return "-" if pd.isna(value) else f"{100 * value:.{digits}f}%"


def _bytes(value: float) -> str:
    return "-" if pd.isna(value) else bytes_text(value)


def display_capacity_accuracy(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "method": table["method"],
        "HBM budget": [_percent(v, 0) for v in table["hbm_budget"]],
        "evicted %": [_percent(v) for v in table["evicted_frac"]],
        "accuracy [95% CI]": [
            f"{100 * a:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
            for a, lo, hi in zip(table["accuracy"], table["ci_low"], table["ci_high"])
        ],
        "n": table["n"].astype(int),
        "attended %": [_percent(v) for v in table.get("attended_frac", pd.Series(np.nan, index=table.index))],
        "recalled tokens/layer-step": [
            "-" if pd.isna(v) else f"{v:.1f}"
            for v in table.get("recalled_tokens_per_layer_step", pd.Series(np.nan, index=table.index))
        ],
        "recalled % of context": [_percent(v) for v in table.get("recalled_frac", pd.Series(np.nan, index=table.index))],
        "H2D/token": [_bytes(v) for v in table.get("h2d_bytes_per_token", pd.Series(np.nan, index=table.index))],
        "D2H/token": [_bytes(v) for v in table.get("d2h_bytes_per_token", pd.Series(np.nan, index=table.index))],
        f"H2D/token @{REFERENCE_ARCHITECTURE}": [
            _bytes(v) for v in table.get("h2d_bytes_per_token_ref", pd.Series(np.nan, index=table.index))
        ],
        f"D2H/token @{REFERENCE_ARCHITECTURE}": [
            _bytes(v) for v in table.get("d2h_bytes_per_token_ref", pd.Series(np.nan, index=table.index))
        ],
    })


def display_latency(table: pd.DataFrame) -> pd.DataFrame:
    shown = table.copy()
    for column in shown.columns[1:]:
        if column.startswith("link stall share"):
            shown[column] = [_percent(v) for v in shown[column]]
        else:
            shown[column] = [("-" if pd.isna(v) else f"{v:.3g}") for v in shown[column]]
    return shown


def display_sim_vs_measured(table: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "profile": table["profile"],
        "n": table["n"].astype(int),
        "median |error|": [_percent(v) for v in table["median_abs_rel_err"]],
        "p95 |error|": [_percent(v) for v in table["p95_abs_rel_err"]],
        "mean error (bias)": [_percent(v) for v in table["mean_rel_err"]],
    })


def display_top_share(top_share: pd.DataFrame, top_frac: float) -> pd.DataFrame:
    shown = pd.DataFrame({
        "layer": top_share["layer"].astype(str),
        f"top {top_frac:.0%} share (mean)": [_percent(v) for v in top_share["top_share"]],
        "min over samples": [_percent(v) for v in top_share["top_share_min"]],
        "max over samples": [_percent(v) for v in top_share["top_share_max"]],
    })
    mean_row = {"layer": "mean", shown.columns[1]: _percent(float(np.mean(top_share["top_share"]))),
                "min over samples": "", "max over samples": ""}
    return pd.concat([shown, pd.DataFrame([mean_row])], ignore_index=True)


# -- renderings ---------------------------------------------------------------------------------------------


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub pipe table (pandas' own needs the optional `tabulate`); value columns right-aligned."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|")

    header = [cell(c) for c in frame.columns]
    rows = [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    align = [":---"] + ["---:"] * (len(header) - 1)  # first column names the row, the rest are numbers
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_latex(frame: pd.DataFrame, caption: str = "", label: str = "") -> str:
    """A booktabs table (\\toprule/\\midrule/\\bottomrule), special characters escaped."""
    styler = frame.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    kwargs = {"hrules": True, "column_format": "l" + "r" * (len(frame.columns) - 1)}
    if caption:
        kwargs.update(caption=caption, position="t", position_float="centering")
    if label:
        kwargs["label"] = label
    return styler.to_latex(**kwargs)
