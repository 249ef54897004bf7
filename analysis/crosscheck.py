"""The cross-check's statistics and figure (torch-free): per-step simulated vs measured times, their relative
errors, the summary table and the scatter plot. `thoughtkv crosscheck` (thoughtkv/crosscheck.py) measures and
simulates; this module only reads the two tables it produces.

Per step: rel_error = |simulated - measured| / measured. Per configuration and overall: the median and the 95th
percentile (numpy's linear interpolation) over all steps, the mean signed error (> 0: the simulator is slow),
and a split of the error into the decoder layers and the rest of the step (LM head and per-step overhead) from
per-layer timings, which names the term the simulator gets wrong.
"""

from __future__ import annotations

from pathlib import Path

from thoughtkv_base import UserError


class CrosscheckError(UserError):
    """Bad crosscheck arguments or state (one line, exit 2)."""




def step_errors(measured, simulated):
    """Join per-step measured and simulated times on (label, sample_id, step) -> with rel/signed errors.

    measured: label, sample_id, step, measured_s (+ any columns); simulated: label, sample_id, step,
    simulated_s (+ any columns, e.g. profile_kind: one row per profile).
    """
    table = simulated.merge(measured, on=["label", "sample_id", "step"], how="inner", validate="many_to_one")
    if len(table) != len(simulated):
        raise CrosscheckError(f"{len(simulated) - len(table)} simulated steps have no measured step")
    table["signed_rel_error"] = (table["simulated_s"] - table["measured_s"]) / table["measured_s"]
    table["rel_error"] = table["signed_rel_error"].abs()
    return table


def error_stats(errors) -> dict:
    """median / p95 of |rel error|, mean signed error, count (errors: a DataFrame with rel_error, signed_rel_error)."""
    import numpy as np

    rel = errors["rel_error"].to_numpy(dtype=float)
    if len(rel) == 0:
        return {"n_steps": 0, "median_rel_error": float("nan"), "p95_rel_error": float("nan"),
                "mean_signed_rel_error": float("nan")}
    return {
        "n_steps": len(rel),
        "median_rel_error": float(np.median(rel)),
        "p95_rel_error": float(np.percentile(rel, 95)),
        "mean_signed_rel_error": float(errors["signed_rel_error"].mean()),
    }


def summarise(table):
    """One row per (profile_kind, label) and one 'ALL' row per profile_kind; decode-only and split columns."""
    import pandas as pd

    rows = []
    for kind, by_kind in table.groupby("profile_kind", sort=False):
        groups = [(label, part) for label, part in by_kind.groupby("label", sort=False)] + [("ALL", by_kind)]
        for label, part in groups:
            decode = part[part["step"] > 0]
            prefill = part[part["step"] == 0]
            row = {"profile_kind": kind, "profile": part["profile"].iloc[0], "label": label,
                   **error_stats(part),
                   **{f"decode_{k}": v for k, v in error_stats(decode).items() if k != "n_steps"},
                   "prefill_mean_rel_error": float(prefill["rel_error"].mean()) if len(prefill) else float("nan"),
                   "measured_ms_median": 1e3 * float(decode["measured_s"].median()),
                   "simulated_ms_median": 1e3 * float(decode["simulated_s"].median())}
            if "layers_s" in part and part["layers_s"].notna().any():
                # Which part of the step is wrong: the decoder layers, or the rest (LM head + step overhead)?
                layers_err = (part["sim_layers_s"] - part["layers_s"]) / part["measured_s"]
                rest_err = (part["sim_rest_s"] - (part["measured_s"] - part["layers_s"])) / part["measured_s"]
                row["layers_signed_rel_error"] = float(layers_err.median())
                row["rest_signed_rel_error"] = float(rest_err.median())
            rows.append(row)
    return pd.DataFrame(rows)


def dominant_term(summary_row: dict) -> str:
    """A sentence naming the part of the step the simulator gets most wrong (from the split columns)."""
    layers, rest = summary_row.get("layers_signed_rel_error"), summary_row.get("rest_signed_rel_error")
    if layers is None or rest is None or layers != layers:
        return "no per-layer timing (CUDA): split unavailable"
    part, value = ("decoder layers (weights, KV attention, per-layer overhead, recall/offload copies)", layers) \
        if abs(layers) >= abs(rest) else ("LM head + per-step overhead", rest)
    return f"{part}: simulator {'over' if value > 0 else 'under'}-estimates by {abs(value):.1%} of the step"


def scatter_figure(table, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    markers = {"calibrated": "o", "datasheet": "x", "datasheet+hf-eager": "^", "datasheet+overheads": "+"}
    for (kind, label), part in table.groupby(["profile_kind", "label"], sort=False):
        ax.scatter(part["measured_s"] * 1e3, part["simulated_s"] * 1e3, s=10, alpha=0.6,
                   marker=markers.get(kind, "."), label=f"{kind}: {label}")
    low = 0.8 * min(table["measured_s"].min(), table["simulated_s"].min()) * 1e3
    high = 1.25 * max(table["measured_s"].max(), table["simulated_s"].max()) * 1e3
    ax.plot([low, high], [low, high], "k-", lw=0.8, label="simulated = measured")
    for factor in (0.9, 1.1):
        ax.plot([low, high], [low * factor, high * factor], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step time (ms)",
           ylabel="simulated step time (ms)", title=title)
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1-2-5 steps on the log axes, not 2x10^1
        axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.text(0.98, 0.02, "dotted: ±10 %", transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
