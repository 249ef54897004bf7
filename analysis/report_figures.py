"""The report's figures and tables: each figure builder reads the loaded `Data` and either draws its figure
(returning the Figure and a one-line caption with its headline number) or raises `Skip` saying why the data do
not support it (the report lists those). FIGURES is the list `analysis.report.build_report` walks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis import figures, frames, load, stats, tables
from analysis.captions import (
    coinciding_text,
    config_text,
    link_stall_label,
    overheads_text,
    plural,
    priced_text,
    rows_of,
    trust_text,
    zero_text,
)
from traces import TraceRun
from traces.stats import REFERENCE_ARCHITECTURE, bytes_text

TOP_FRAC = 0.2
NO_SIM = "no simulator results (pass --sim with what `thoughtkv simulate RUN --all-profiles --out DIR` wrote)"


class Skip(Exception):  # noqa: N818 - control flow, not an error: "this figure has no data"
    """Raised by a figure builder when its data are absent; the message says why, for the report."""


@dataclass
class Data:
    """Everything the figure builders read, loaded once."""

    runs: list[TraceRun]
    run_table: pd.DataFrame
    sim: pd.DataFrame
    latency: pd.DataFrame
    budget: float | None  # the budget the breakdown and latency table single out
    measured_profile: str | None
    top_share: pd.DataFrame | None = None  # set by the importance figure, shown again as a table
    priced: str = ""  # what every simulator row priced (priced_text), said once at the top of report.md

    def priced_clause(self, rows: pd.DataFrame, lead: str = ", ") -> str:
        """`lead` + what `rows` priced, for a caption; empty when that is what the report's opening says for all."""
        text = priced_text(rows, self.run_table)
        return "" if text == self.priced else f"{lead}{text}"


# -- figure builders: Data -> (Figure, caption) or Skip ----------------------------------------------------------


def _importance(data: Data) -> tuple[Figure, str]:
    source = load.importance_source(data.runs)
    if source is None:
        raise Skip("no trace runs given")
    tokens = source.tokens()
    if tokens.empty:
        raise Skip(f"{source.path.name} has no committed samples")
    cdf = frames.importance_cdf(tokens)
    top = frames.top_share_by_layer(tokens, TOP_FRAC)
    data.top_share = top
    heatmap, sample_note = None, "no heatmap: the run was recorded with --no-access"
    if source.has_access:
        sample_id = _longest_sample(source)
        heatmap = frames.block_mass_heatmap(source.access(sample_id), sample_id)
        sample_note = f"heatmap: sample {sample_id}"
    figure = figures.importance_long_tail(cdf, top, heatmap, source.block_size, TOP_FRAC,
                                          heatmap_title=f" ({sample_note.removeprefix('heatmap: ')})")
    # Two measures of the same long tail, each named: over the whole decode a token's accumulated mass (what
    # the scorers rank by), and within one decode step the share of that step's attention (what a recall of
    # the top blocks captures; docs/capacity_accuracy.md and the README quote this one, per token).
    step_share = per_step_top_share(source, TOP_FRAC) if source.has_access else None
    step_text = (f"; within one decode step the top {TOP_FRAC:.0%} of the attended "
                 f"{'tokens' if source.block_size == 1 else f'{source.block_size}-token blocks'} hold "
                 f"{step_share:.0%} of that step's attention (mean over steps, layers and samples)"
                 if step_share is not None and np.isfinite(step_share) else "")
    caption = (
        f"Attention is long-tailed: in `{source.path.name}` the top {TOP_FRAC:.0%} of tokens receive "
        f"{top['top_share'].mean():.0%} of the attention mass accumulated over the whole decode (layers "
        f"{top['top_share'].min():.0%}-{top['top_share'].max():.0%}, {plural(tokens['sample_id'].nunique(), 'sample')})"
        f"{step_text}; {sample_note}."
    )
    return figure, caption


def per_step_top_share(run: TraceRun, top_frac: float, max_samples: int = 50) -> float:
    """Mean over decode steps (the prefill left out), layers and the first `max_samples` samples of the share
    of one step's attention held by the top `top_frac` of the blocks attended in that step."""
    shares = []
    for sample_id in run.sample_ids()[:max_samples]:
        access = run.access(sample_id)
        for step, mass in zip(access["step"], access["block_mass"]):
            share = stats.top_share(mass, top_frac) if step > 0 else float("nan")
            if np.isfinite(share):
                shares.append(share)
    return float(np.mean(shares)) if shares else float("nan")


def _longest_sample(run: TraceRun) -> str:
    samples = run.samples()
    return str(samples.loc[samples["generated_tokens"].idxmax(), "sample_id"])


def _capacity_accuracy(data: Data) -> tuple[Figure, str]:
    if not data.runs:
        raise Skip("no trace runs given (accuracy comes from the runs' samples)")
    accuracy = frames.accuracy_frame(data.run_table) if not data.run_table.empty else pd.DataFrame()
    if accuracy.empty:
        raise Skip("no run has scored samples (random weights or a task without gold answers)")
    pooled = frames.pooled_accuracy(accuracy)
    if (~pooled["is_full"]).sum() == 0:
        raise Skip("only full-cache runs: no reduced HBM budget to compare")
    full = pooled[pooled["is_full"]]
    full_text = f"full cache {full['accuracy'].iloc[0]:.0%} (n={int(full['n_scored'].iloc[0])})" if not full.empty else "no full-cache run"
    # Never an accuracy without the traffic that bought it: each point is labelled with the share of the context
    # its attention saw (HBM + recalled), and the caption gives the recall traffic at the smallest budget.
    traffic = tables.capacity_accuracy_table(accuracy)[["method", "hbm_budget", *tables.TRAFFIC_WEIGHTS]]
    pooled = pooled.merge(traffic, on=["method", "hbm_budget"], how="left")
    partial = pooled[~pooled["is_full"]]
    smallest = partial[partial["hbm_budget"] == partial["hbm_budget"].min()]
    traffic_text = "; ".join(
        f"{r.method}: attends {r.attended_frac:.0%}, recalls {r.recalled_frac:.0%} of the context per step, H2D "
        f"{bytes_text(r.h2d_bytes_per_token_ref)}/token at {REFERENCE_ARCHITECTURE}"
        for r in smallest.itertuples() if r.attended_frac == r.attended_frac)
    caption = (
        f"Accuracy vs HBM budget per method with 95% Wilson intervals; {full_text} shown as the grey band; "
        f"{plural(len(pooled), 'point')}, n per point in the legend; labels: share of the context attended. "
        f"Traffic at {smallest['hbm_budget'].min():.0%} HBM: {traffic_text or 'not recorded'}."
    )
    return figures.capacity_accuracy(pooled), caption


def _need_latency(data: Data) -> pd.DataFrame:
    if data.sim.empty:
        raise Skip(NO_SIM)
    if data.latency.empty:
        raise Skip("the simulator results hold no replayed (result_kind traced or synthetic) rows")
    return data.latency


def _projected_latency(data: Data) -> tuple[Figure, str]:
    latency = _need_latency(data)
    focus = frames.focus_method(latency)
    methods = [focus] if focus else [frames.FULL_LABEL]
    methods += [m for m in frames.method_order(latency) if m.startswith("pure eviction") and m not in methods][:1]
    breakdown = frames.breakdown_frame(latency, data.budget, focus)
    fastest, slowest = breakdown.iloc[0], breakdown.iloc[-1]
    caption = (
        f"Projected ms/token vs HBM budget on {latency['profile'].nunique()} hardware profiles"
        f"{data.priced_clause(latency)} ({config_text(latency)}); right: where the time goes for "
        f"{breakdown['method'].iloc[0]} at {breakdown['hbm_budget'].iloc[0]:.0%}, from "
        f"{fastest['ms_per_token']:.3g} ms ({fastest['profile']}) to {slowest['ms_per_token']:.3g} ms "
        f"({slowest['profile']}).{coinciding_text(latency)}"
    )
    return figures.projected_latency(latency, breakdown, methods, link_stall_label(breakdown["profile"])), caption


def _pareto(data: Data) -> tuple[Figure, str]:
    latency = _need_latency(data)
    points = frames.pareto_frame(latency)
    if points.empty:
        raise Skip("no simulated run has a measured accuracy (need scored trace runs among RUN_DIRs)")
    frontier = points[points["on_frontier_latency"]].sort_values("ms_per_token")
    names = ", ".join(f"{frames.with_budget(r.method, r.hbm_budget, r.is_full)} on {r.profile}"
                      for r in frontier.head(3).itertuples())
    caption = (
        f"Accuracy vs projected latency ({plural(len(points), 'policy x profile point')}) and vs KV bytes in HBM per "
        f"sequence{data.priced_clause(latency)}; the black step line is the Pareto frontier (fastest "
        f"frontier points: {names}){zero_text(points)}; {overheads_text(latency)}.{coinciding_text(latency)}"
    )
    return figures.pareto(points), caption


def _capacity(data: Data) -> tuple[Figure, str]:
    latency = _need_latency(data)
    capacity = frames.capacity_frame(latency, data.sim)
    method = frames.focus_method(latency) or frames.FULL_LABEL
    rows = capacity[capacity["method"] == method]
    full = capacity[capacity["is_full"]]
    gain = ""
    if not full.empty and not rows.empty:
        smallest = rows[rows["hbm_budget"] == rows["hbm_budget"].min()]
        ratio = smallest["max_concurrency"].median() / max(full["max_concurrency"].median(), 1)
        gain = f"; at {smallest['hbm_budget'].iloc[0]:.0%} budget {ratio:.1f}x the full cache's concurrency (median over profiles)"
    simulated = (capacity["throughput_source"] != "bound").sum()
    source = (f"throughput simulated with batched replays for {simulated} of {plural(len(capacity), 'point')}, elsewhere "
              "bounded by max sequences x single-sequence tokens/s" if simulated else
              "throughput is the bound max sequences x single-sequence tokens/s (no batched replays simulated)")
    caption = (f"Max concurrent sequences (HBM and DDR limits) vs HBM budget for {method}, per profile{gain}"
               f"{data.priced_clause(latency)}; {source}; {overheads_text(latency)}. A bound, not a served "
               f"capacity: requests as served (arrivals, queueing, one shared link, an SLO) are in the section "
               f"\"Capacity as served\" (`thoughtkv capacity`).")
    return figures.capacity(capacity, method), caption


def sim_measured_pairs(data: Data) -> pd.DataFrame:
    """Per sample of every timed run: simulated (on its measuring machine's profile) and measured seconds."""
    if data.sim.empty:
        raise Skip(NO_SIM)
    measured = pd.concat([load.measured_seconds(run) for run in data.runs] or [pd.DataFrame()], ignore_index=True)
    if measured.empty:
        raise Skip("no trace run carries measured timings (measured_step_us); collect with timing on")
    devices = data.run_table.set_index("run_dir")["device"].to_dict()
    pairs = []
    for run_dir, group in measured.groupby("run_dir"):
        simulated_profiles = sorted(data.sim.loc[data.sim["run_dir"] == run_dir, "profile"].unique())
        chosen = ([data.measured_profile] if data.measured_profile else
                  load.measuring_profiles(simulated_profiles, devices.get(run_dir)))
        pairs += [group.assign(profile=p) for p in chosen if p in simulated_profiles]
    if not pairs and data.measured_profile:
        simulated = ", ".join(sorted(data.sim["profile"].unique()))
        raise Skip(f"--measured-profile {data.measured_profile} is not among the simulated profiles ({simulated}); "
                   "simulate the timed runs on it")
    if not pairs:
        raise Skip("timed runs were not simulated on a measured profile (`thoughtkv calibrate`, then simulate on it)")
    frame = frames.sim_vs_measured_frame(data.sim, pd.concat(pairs, ignore_index=True))
    if frame.empty:
        raise Skip("no sample of a timed run appears in the simulator results of its measured profile")
    return frame


def _sim_vs_measured(data: Data) -> tuple[Figure, str]:
    frame = sim_measured_pairs(data)
    errors = stats.error_stats(frame["simulated_s"], frame["measured_s"])
    caption = (
        f"Simulated vs measured decode time per sample on the measured profile(s) {', '.join(sorted(frame['profile'].unique()))}: "
        f"median |error| {errors['median_abs_rel_err']:.1%}, p95 {errors['p95_abs_rel_err']:.1%} (n={errors['n']})"
        f"{data.priced_clause(rows_of(data.sim, frame))}; {trust_text(frame)}."
    )
    return figures.sim_vs_measured(frame, errors), caption


def _mass_lost(data: Data) -> tuple[Figure, str]:
    if data.sim.empty:
        raise Skip(NO_SIM)
    frame = frames.mass_lost_frame(data.sim, data.run_table) if not data.run_table.empty else pd.DataFrame()
    if frame.empty:
        raise Skip("no what-if (result_kind=projected) result matches a traced run with measured accuracy")
    rho = stats.spearman(frame["mass_lost"], frame["accuracy"])
    rho_text = (f"Spearman rho = {rho:.2f}" if np.isfinite(rho)
                else "no rank correlation (fewer than 3 points, or accuracy or mass lost does not vary)")
    caption = (
        f"Projected attention mass lost (evicted + not recalled, from what-if replays of the runs"
        f"{data.priced_clause(data.sim[data.sim['result_kind'] == 'projected'])}) vs the measured accuracy "
        f"of the same policy, {plural(len(frame), 'policy', 'policies')}: {rho_text}."
    )
    return figures.mass_lost_vs_accuracy(frame, rho), caption


FigureBuilder = Callable[[Data], tuple[Figure, str]]
FIGURES: list[tuple[str, str, FigureBuilder]] = [
    ("fig1_importance", "Importance long tail", _importance),
    ("fig2_capacity_accuracy", "Capacity vs accuracy", _capacity_accuracy),
    ("fig3_latency", "Projected latency", _projected_latency),
    ("fig4_pareto", "Pareto: accuracy vs latency and HBM bytes", _pareto),
    ("fig5_capacity", "Capacity and throughput: an upper bound (no queueing, no shared link)", _capacity),
    ("fig6_sim_vs_measured", "Simulated vs measured", _sim_vs_measured),
    ("fig7_mass_lost", "Attention mass lost vs accuracy", _mass_lost),
]


# -- tables -----------------------------------------------------------------------------------------------------


def report_tables(data: Data) -> list[tuple[str, str, pd.DataFrame]]:
    """(stem, title, display frame) for every table the data support."""
    out = []
    if not data.run_table.empty:
        accuracy = frames.accuracy_frame(data.run_table)
        if not accuracy.empty:
            out.append(("table_capacity_accuracy", "Capacity vs accuracy (95% Wilson CI)",
                        tables.display_capacity_accuracy(tables.capacity_accuracy_table(accuracy))))
            out.append(("table_long_generations", "Long generations: samples stopped by the token limit, "
                        "accuracy over all and over finished samples (95% Wilson CI)",
                        tables.display_completion(data.run_table)))
    if not data.latency.empty:
        budget = data.budget if data.budget is not None else _default_budget(data.latency)
        out.append(("table_latency", f"Projected ms/token per profile (budget nearest {budget:.0%})"
                    f"{data.priced_clause(data.latency)}",
                    tables.display_latency(tables.latency_table(data.latency, budget))))
    if data.top_share is not None and not data.top_share.empty:
        out.append(("table_importance", f"Share of attention mass held by the top {TOP_FRAC:.0%} of tokens, per layer",
                    tables.display_top_share(data.top_share, TOP_FRAC)))
    try:
        pairs = sim_measured_pairs(data)
    except Skip:
        pass
    else:
        out.append(("table_sim_vs_measured", "Simulated vs measured time per sample: relative error"
                    f"{data.priced_clause(rows_of(data.sim, pairs))}",
                    tables.display_sim_vs_measured(tables.sim_vs_measured_table(pairs))))
    return out


def _default_budget(latency: pd.DataFrame) -> float:
    partial = latency.loc[~latency["is_full"], "hbm_budget"]
    return float(partial.min()) if not partial.empty else 1.0
