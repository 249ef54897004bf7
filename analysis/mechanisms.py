"""The transfer-mechanism figure: ms/token and concurrent sequences for one model's shapes at two contexts,
per transfer mechanism x hardware profile, projected from a traced run (simulator/project.py).

    from analysis.mechanisms import mechanism_table, mechanism_figure
    table = mechanism_table("runs/micro-h30", profiles=("h100-pcie", "gh200-96gb"))   # numbers (tested)
    mechanism_figure(table)                                                              # a Figure; or
    write_mechanism_figure("runs/micro-h30", "report/")   # -> report/mechanisms.{png,pdf} + mechanisms.csv

`context` is the final length of the run's mean sample after projection (context_scale = context / that
length; the projection keeps every step's tier shares, simulator/README.md). "Concurrent sequences" is how
many such sequences fit in HBM beside the weights at the policy's footprint (`max_concurrency_policy`: resident
+ staged blocks at the decode peak; zero-copy and cpu-attention stage nothing); `max_concurrency_full`, the full
cache's, is drawn as a line.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.style import DOUBLE_COLUMN_IN, HATCHES, new_figure, save_figure, series_style, styled

PROFILES = ("h100-pcie", "h100-sxm", "gh200-96gb")
CONTEXTS = (8192, 32768)


def mechanism_table(run_dir: str | Path, profiles=PROFILES, contexts=CONTEXTS, as_model: str = "qwen2-7b",
                    transfers: tuple[str, ...] | None = None, dtype: str = "bfloat16",
                    recalls: str = "share", overhead_mode: str | None = None) -> pd.DataFrame:
    """One row per (context, profile, transfer): the run projected to `as_model` at that context (`recalls`:
    project.Projection's, share or count), charging `overhead_mode` (None: the profiles' own, kernel-only for
    datasheet ones; the row says which)."""
    from simulator import simulate_run
    from simulator.mechanisms import MECHANISMS
    from simulator.options import Projection, SimOptions
    from traces.reader import open_run

    run = open_run(run_dir)
    samples = run.samples()
    final_length = float((samples["prompt_tokens"] + samples["generated_tokens"]).mean())
    rows = []
    for context in contexts:
        projection = Projection(as_model, dtype, context_scale=context / final_length, recalls=recalls)
        for profile in profiles:
            for transfer in transfers or tuple(MECHANISMS):
                options = SimOptions(transfer=transfer, overhead_mode=overhead_mode)
                s = simulate_run(run, profile, options, projection=projection).summary
                rows.append({"context": context, "profile": profile, "transfer": transfer, "model": as_model,
                             "ms_per_token": s["ms_per_token"], "link_stall_frac": s["link_stall_frac"],
                             "max_concurrency_policy": s["max_concurrency_policy"],
                             "max_concurrency_full": s["max_concurrency_full"], "hbm_budget": s["hbm_budget"],
                             "policy": s["policy"], "run_label": s["run_label"],
                             "overhead_mode": s.get("overhead_mode", overhead_mode or "kernel-only")})
    return pd.DataFrame(rows)


@styled
def mechanism_figure(table: pd.DataFrame) -> Figure:
    """Top: ms/token; bottom: concurrent sequences; one column per context, grouped bars per profile."""
    contexts = sorted(table["context"].unique())
    profiles = list(dict.fromkeys(table["profile"]))
    transfers = list(dict.fromkeys(table["transfer"]))
    figure = new_figure((DOUBLE_COLUMN_IN[0], 2 * DOUBLE_COLUMN_IN[1]))
    axes = figure.subplots(2, len(contexts), squeeze=False)
    width = 0.8 / len(transfers)
    for column, context in enumerate(contexts):
        part = table[table["context"] == context]
        for row, (metric, label) in enumerate((("ms_per_token", "ms / token"),
                                               ("max_concurrency_policy", "sequences in HBM"))):
            ax = axes[row][column]
            for k, transfer in enumerate(transfers):
                values = part[part["transfer"] == transfer].set_index("profile").reindex(profiles)[metric]
                style = series_style(k)
                ax.bar([p + (k - (len(transfers) - 1) / 2) * width for p in range(len(profiles))], values, width,
                       label=transfer, color=style["color"], hatch=HATCHES[k % len(HATCHES)], edgecolor="0.2",
                       linewidth=0.4)
            if metric == "max_concurrency_policy":
                full = part.groupby("profile")["max_concurrency_full"].first().reindex(profiles)
                ax.scatter(range(len(profiles)), full, marker="_", s=300, color="black", zorder=3,
                           label="full cache")
            ax.set_xticks(range(len(profiles)), profiles)
            ax.set_ylabel(label)
            model = part["model"].iloc[0]
            ax.set_title(f"{model} shapes, {context // 1024}k context, HBM {100 * part['hbm_budget'].iloc[0]:.0f}%")
    handles, labels = axes[1][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    return figure


def write_mechanism_figure(run_dir: str | Path, out_dir: str | Path, **table_args) -> list[Path]:
    """mechanism_table + mechanism_figure into out_dir: mechanisms.csv and the figure files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = mechanism_table(run_dir, **table_args)
    table.to_csv(out / "mechanisms.csv", index=False)
    return [out / "mechanisms.csv", *save_figure(mechanism_figure(table), out, "mechanisms")]
