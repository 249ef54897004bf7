"""build_report: runs + simulator results -> figures (PNG + PDF), tables (Markdown + LaTeX) and report.md.

Each figure is one entry of FIGURES: a function that either draws it (returning the Figure and a one-line
caption with its headline number) or says why the data do not support it (the report lists those).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis import figures, frames, load, stats, tables
from analysis.style import save_figure
from hwprofiles.overhead_modes import MODE_TEXT
from thoughtkv_base import UserError, __version__
from traces import TraceRun
from traces.stats import REFERENCE_ARCHITECTURE, bytes_text

REPORT_NAME = "report.md"
# The files a report wrote, relative to its directory: a rebuild into the same --out removes those it does not
# write again (a figure the new data no longer support must not sit beside a report.md saying "not drawn"), and
# never touches anything else there.
FILES_NAME = "report_files.json"
TOP_FRAC = 0.2
NO_SIM = "no simulator results (pass --sim with what `thoughtkv simulate RUN --all-profiles --out DIR` wrote)"


class ReportOutputError(UserError):
    """An --out that cannot take the report."""


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


@dataclass
class FigureEntry:
    stem: str
    title: str
    caption: str = ""
    paths: list[Path] = field(default_factory=list)
    skipped: str = ""


@dataclass
class TableEntry:
    stem: str
    title: str
    markdown: str
    paths: list[Path] = field(default_factory=list)


@dataclass
class Report:
    out_dir: Path
    path: Path
    figures: list[FigureEntry]
    tables: list[TableEntry]
    run_table: pd.DataFrame
    latency: pd.DataFrame
    ignored: list[Path]


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


def plural(n: int, word: str, words: str | None = None) -> str:
    """`1 point`, `2 points`: counts in captions are often 1 on small inputs."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


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


def shapes_text(model: str, run_table: pd.DataFrame, dtype: str = "bfloat16") -> str:
    """`micro_long (1.45M parameters, 3 layers, float32 KV 2.3 kB/token)`: a model id with the shapes a
    projection prices, from the runs (or traces.architectures for a --as-model target, in `dtype`); the id alone
    when neither knows it."""
    rows = run_table[run_table["model"] == model] if not run_table.empty and "model_n_params" in run_table else None
    if rows is not None and not rows.empty and pd.notna(rows["model_n_params"].iloc[0]):
        row = rows.iloc[0]
        params, layers, dtype, kv = (row["model_n_params"], row["model_n_layers"], row["model_dtype"],
                                     row["model_kv_bytes_per_token"])
    else:
        from traces.architectures import ARCHITECTURES

        arch = ARCHITECTURES.get(model)
        if arch is None:
            return f"`{model}`"
        params, layers, kv = arch.n_params(), arch.n_layers, arch.kv_bytes_per_token(dtype)
    return f"`{model}` ({_count_text(params)} parameters, {int(layers)} layers, {dtype} KV {bytes_text(kv)}/token)"


def _count_text(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


AS_MODEL_LABEL = r"\[as (?P<arch>[^\s\]]+) (?P<dtype>[^\s,\]]+)"  # simulator.project.Projection.label


def priced_text(rows: pd.DataFrame, run_table: pd.DataFrame) -> str:
    """Which model shapes these simulator rows priced, for every projected caption and table: the traced model's
    own (`priced at micro_long (1.45M parameters, ...)'s shapes`), or, under --as-model, the architecture named
    (`projected to qwen2-7b (7.62B parameters, ...) from the micro_long run(s)`)."""
    if rows.empty or "model" not in rows:
        return "model shapes not recorded"
    traced = dict(zip(run_table["run_dir"], run_table["model"])) if {"run_dir", "model"} <= set(run_table) else {}
    labels = rows["run_label"].astype(str) if "run_label" in rows else pd.Series("", index=rows.index)
    as_model = labels.str.extract(AS_MODEL_LABEL)
    parts = []
    projected = rows[as_model["arch"].notna()]
    for (arch, dtype), group in projected.groupby([as_model["arch"], as_model["dtype"]], sort=True):
        sources = sorted({traced[d] for d in group["run_dir"] if d in traced})
        origin = f" from the {', '.join(f'`{s}`' for s in sources)} run(s)" if sources else ""
        parts.append(f"projected to {shapes_text(arch, pd.DataFrame(), dtype)}{origin}")
    for model in sorted(rows.loc[as_model["arch"].isna(), "model"].dropna().unique()):
        parts.append(f"priced at {shapes_text(model, run_table)}'s shapes")
    return "; ".join(parts) or "model shapes not recorded"


def _rows_of(sim: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """The simulator rows behind a derived frame (same runs and profiles), for naming what they priced."""
    return sim[sim["run_dir"].isin(frame["run_dir"]) & sim["profile"].isin(frame["profile"])]


COINCIDE_REL = 0.005  # profiles whose every ms/token agrees within this share draw one line


def coinciding_text(latency: pd.DataFrame) -> str:
    """' The lines of N profiles coincide at X ms/token: ...why.' when several profiles project the same ms/token at
    every (method, budget) (their lines and markers lie on top of each other), else ''. Why: under a host mode the
    step takes the longer of the host and the GPU, and a host-bound step (overheads most of it) costs the same on
    every GPU; otherwise their GPU times agree."""
    if latency.empty or latency["profile"].nunique() < 2:
        return ""
    grid = latency.pivot_table(index="profile", columns=["method", "hbm_budget"], values="ms_per_token")
    groups: list[list[str]] = []
    for profile, row in grid.iterrows():
        for group in groups:
            reference = grid.loc[group[0]]
            if np.allclose(row, reference, rtol=COINCIDE_REL, equal_nan=True):
                group.append(profile)
                break
        else:
            groups.append([profile])
    largest = max(groups, key=len)
    if len(largest) < 2:
        return ""
    rows = latency[latency["profile"].isin(largest)]
    ms = float(rows["ms_per_token"].median())
    overhead_share = float((rows["overhead_ms"] / rows["step_ms"]).median()) if "overhead_ms" in rows else 0.0
    modes = ", ".join(sorted(rows["overhead_mode"].dropna().astype(str).unique())) or "the same overhead mode"
    names = ", ".join(largest) if len(largest) <= 3 else f"{len(largest)} profiles"
    if overhead_share > 0.5:
        why = (f"under {modes} the step is host-bound ({overhead_share:.0%} of it is the host issuing ops at one cost "
               "per op, whatever the GPU), so the GPUs cannot be told apart at these shapes; `--overhead-mode "
               "kernel-only` or `--as-model` separates them")
    else:
        why = "their GPU times agree at these shapes (the same bound: compute, bandwidth or the link)"
    return f" The lines of {names} coincide at {ms:.3g} ms/token (one colour and marker each, drawn on top of each " \
           f"other): {why}."


def summary_lines(data: Data) -> list[str]:
    """The report's opening three lines: what was traced and simulated; the best accuracy below the full cache
    with its traffic; what the simulator projects (or that it was not run)."""
    lines = []
    table = data.run_table
    if table.empty:
        lines.append("**Traced:** no trace run (simulator results only).")
    else:
        models = ", ".join(f"`{m}`" for m in sorted(table["model"].dropna().unique()))
        tasks = ", ".join(sorted(table["task"].dropna().astype(str).unique()))
        n = table["n_samples"]
        samples = f"{int(n.min())}" if n.min() == n.max() else f"{int(n.min())}–{int(n.max())}"
        simulated = f"; simulated on {plural(data.sim['profile'].nunique(), 'hardware profile')}" \
            if not data.sim.empty else ""
        lines.append(f"**Traced:** {plural(len(table), 'run')} of {models} on {tasks}, {samples} samples each"
                     f"{simulated}.")
    accuracy = frames.accuracy_frame(table) if not table.empty else pd.DataFrame()
    if accuracy.empty:
        lines.append("**Accuracy:** no scored sample.")
    else:
        pooled = frames.pooled_accuracy(accuracy)

        def text(row) -> str:
            return (f"{100 * row['accuracy']:.1f}% [{100 * row['ci_low']:.1f}–{100 * row['ci_high']:.1f}] "
                    f"(n={int(row['n_scored'])})")

        full = pooled[pooled["is_full"]]
        parts = [f"full cache {text(full.iloc[0])}"] if not full.empty else []
        others = pooled[~pooled["is_full"]].sort_values(["accuracy", "hbm_budget"], ascending=[False, True])
        if not others.empty:
            best = others.iloc[0]
            runs = accuracy[(accuracy["method"] == best["method"]) & (accuracy["hbm_budget"] == best["hbm_budget"])]
            parts.append(f"best below it {frames.with_budget(best['method'], best['hbm_budget'], False)} "
                         f"{text(best)}, attending {runs['attended_frac'].mean():.0%} of the context, H2D "
                         f"{bytes_text(runs['h2d_bytes_per_token_ref'].mean())}/token at {REFERENCE_ARCHITECTURE}")
        lines.append(f"**Accuracy with its traffic:** {'; '.join(parts)} (Figure 2, the first table).")
    latency = data.latency
    if latency.empty:
        lines.append("**Projected:** not simulated (`thoughtkv simulate RUN --all-profiles`, then pass its results).")
    else:
        focus = frames.focus_method(latency) or frames.FULL_LABEL
        rows = latency[latency["method"] == focus]
        budget = rows["hbm_budget"].min()
        rows = rows[rows["hbm_budget"] == budget].sort_values("ms_per_token")
        fastest, slowest = rows.iloc[0], rows.iloc[-1]
        modes = ", ".join(sorted(latency["overhead_mode"].dropna().astype(str).unique()))
        lines.append(f"**Projected** ({modes}; Figure 3): {frames.with_budget(focus, budget, bool(fastest['is_full']))} "
                     f"{fastest['ms_per_token']:.3g} ms/token on {fastest['profile']} to "
                     f"{slowest['ms_per_token']:.3g} ms/token on {slowest['profile']}.")
    return lines


def _zero_text(points: pd.DataFrame) -> str:
    """Figure 4 leaves 0%-accuracy points off the frontier (frames.pareto_frame); the caption says how many."""
    zero = int((points["accuracy"] == 0).sum())
    return (f"; {plural(zero, 'point')} at 0% accuracy left off the frontier (a policy that answers nothing buys no "
            "trade-off, however fast)" if zero else "")


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
        f"{data.priced_clause(latency)} ({_config_text(latency)}); right: where the time goes for "
        f"{breakdown['method'].iloc[0]} at {breakdown['hbm_budget'].iloc[0]:.0%}, from "
        f"{fastest['ms_per_token']:.3g} ms ({fastest['profile']}) to {slowest['ms_per_token']:.3g} ms "
        f"({slowest['profile']}).{coinciding_text(latency)}"
    )
    return figures.projected_latency(latency, breakdown, methods, link_stall_label(breakdown["profile"])), caption


LINK_NAMES = {"pcie3": "PCIe", "pcie4": "PCIe", "pcie5": "PCIe", "pcie6": "PCIe", "nvlink-c2c": "NVLink-C2C",
              "cxl": "CXL", "host": "host-memory"}


def link_stall_label(profiles) -> str:
    """Name the stall after the link the profiles have (a GH200's is NVLink-C2C, not PCIe); mixed: all of them."""
    from hwprofiles import load_profile

    names = set()
    for name in set(profiles):
        try:
            names.add(LINK_NAMES.get(load_profile(name).link.kind, "host"))
        except UserError:  # a results file may name a profile not installed here
            names.add("host")
    return f"{names.pop()} link stall" if len(names) == 1 else f"host-link stall ({' / '.join(sorted(names))})"


def _config_text(latency: pd.DataFrame) -> str:
    row = latency.iloc[0]
    return (f"overlap={row['overlap']}, async offload={row['async_offload']}, batch={row['batch']}; "
            f"{overheads_text(latency)}")


OVERHEAD_MODE_TEXT = MODE_TEXT  # hwprofiles/overhead_modes.py: the one description of each mode


def overheads_text(latency: pd.DataFrame) -> str:
    """Which framework-overhead mode each profile's projection charged (hwprofiles/overhead_modes.py)."""
    if "overhead_mode" not in latency or latency["overhead_mode"].isna().all():
        return "framework overheads: not recorded (results from before overhead modes)"
    by_mode = latency.drop_duplicates("profile").groupby("overhead_mode")["profile"].apply(sorted)
    parts = [f"{OVERHEAD_MODE_TEXT.get(mode, mode)} for {plural(len(names), 'profile')}"
             + (f" ({', '.join(names)})" if len(names) <= 2 else "") for mode, names in by_mode.items()]
    return "framework overheads: " + "; ".join(parts)


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
        f"frontier points: {names}){_zero_text(points)}; {overheads_text(latency)}.{coinciding_text(latency)}"
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
        f"{data.priced_clause(_rows_of(data.sim, frame))}; {_trust_text(frame)}."
    )
    return figures.sim_vs_measured(frame, errors), caption


def _trust_text(frame: pd.DataFrame) -> str:
    """Which host each side came from, and how many samples were traced under contention (kept, flagged)."""
    same = frame["same_host"] if "same_host" in frame else pd.Series(dtype=object)
    if same.eq(True).all() and len(same):
        host = "profile calibrated on the host that traced the runs"
    elif same.eq(False).any():
        host = "WARNING: the profile was calibrated on another host than the traces (compare like with like)"
    else:
        host = "hosts not recorded on one side"
    contended = int(frame["contended"].eq(True).sum()) if "contended" in frame else 0
    return f"{host}; {plural(contended, 'sample')} traced under CPU contention (kept, flagged in the table)"


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


def _tables(data: Data) -> list[tuple[str, str, pd.DataFrame]]:
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
                    f"{data.priced_clause(_rows_of(data.sim, pairs))}",
                    tables.display_sim_vs_measured(tables.sim_vs_measured_table(pairs))))
    return out


def _default_budget(latency: pd.DataFrame) -> float:
    partial = latency.loc[~latency["is_full"], "hbm_budget"]
    return float(partial.min()) if not partial.empty else 1.0


# -- the whole report ---------------------------------------------------------------------------------------------


def check_out_dir(out_dir: Path) -> None:
    """--out must be a new or empty directory, or one holding an earlier report (whose files we replace)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportOutputError(f"--out {out_dir}: exists and is not a directory; choose a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / REPORT_NAME).is_file():
        raise ReportOutputError(
            f"--out {out_dir}: a non-empty directory without {REPORT_NAME}; choose a new or empty directory"
        )


def host_warnings(sim: pd.DataFrame) -> list[str]:
    """One line per measured profile that the results applied to runs traced on another host."""
    if sim.empty or "same_host" not in sim:
        return []
    other = sim[sim["same_host"].eq(False)]
    return [f"warning: measured profile {profile} was calibrated on another host than {plural(group['run_dir'].nunique(), 'run')} "
            "it was applied to; calibrate where you trace (`thoughtkv calibrate`) to compare like with like"
            for profile, group in other.groupby("profile")]


def build_report(
    run_paths: list[str | Path],
    sim_paths: list[str | Path] = (),
    out_dir: str | Path = "report",
    *,
    budget: float | None = None,
    measured_profile: str | None = None,
    log: Callable[[str], None] = lambda _message: None,
) -> Report:
    """Write every figure and table the inputs support, and report.md listing them (and the skipped ones)."""
    out_dir = Path(out_dir)
    inputs = load.classify_paths(list(run_paths), list(sim_paths))
    if not inputs.runs and not inputs.sim_files:
        raise load.AnalysisInputError("no trace run or results file among the paths given; pass RUN_DIRs (with run.json)")
    check_out_dir(out_dir)
    run_table = load.run_table(inputs.runs)
    sim = load.align_run_dirs(load.load_sim_results(inputs.sim_files), [load.run_key(r) for r in inputs.runs])
    latency = frames.latency_frame(sim, run_table if not run_table.empty else None) if not sim.empty else pd.DataFrame()
    data = Data(inputs.runs, run_table, sim, latency, budget, measured_profile,
                priced=priced_text(sim, run_table) if not sim.empty else "")
    for line in host_warnings(sim):
        print(line, file=sys.stderr)  # printed even with --quiet: a comparison across machines is worth a line

    figure_dir, table_dir = out_dir / "figures", out_dir / "tables"
    entries = []
    for stem, title, builder in FIGURES:
        entry = FigureEntry(stem, title)
        try:
            figure, entry.caption = builder(data)
        except Skip as reason:
            entry.skipped = str(reason)
            log(f"skipped {stem}: {reason}")
        else:
            entry.paths = save_figure(figure, figure_dir, stem)
            log(f"wrote {entry.paths[0]}")
        entries.append(entry)

    table_entries = []
    for stem, title, shown in _tables(data):
        table_dir.mkdir(parents=True, exist_ok=True)
        markdown = tables.to_markdown(shown)
        paths = [table_dir / f"{stem}.md", table_dir / f"{stem}.tex"]
        paths[0].write_text(markdown)
        paths[1].write_text(tables.to_latex(shown, caption=title, label=f"tab:{stem.removeprefix('table_')}"))
        table_entries.append(TableEntry(stem, title, markdown, paths))
        log(f"wrote {paths[0]}")

    report_path = out_dir / REPORT_NAME
    out_dir.mkdir(parents=True, exist_ok=True)  # even when nothing could be drawn: the report says why
    report_path.write_text(render_markdown(out_dir, entries, table_entries, inputs, run_table, sim, summary_lines(data)))
    log(f"wrote {report_path}")
    written = [report_path, *(p for e in entries for p in e.paths), *(p for e in table_entries for p in e.paths)]
    for stale in replace_owned_files(out_dir, written):
        log(f"removed {stale} (not redrawn from these inputs)")
    return Report(out_dir, report_path, entries, table_entries, run_table, latency, inputs.ignored)


def owned_files(out_dir: Path) -> list[str]:
    """The files the last report into `out_dir` wrote (relative paths), from its FILES_NAME; [] when none."""
    import json

    try:
        listed = json.loads((out_dir / FILES_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [p for p in listed if isinstance(p, str)] if isinstance(listed, list) else []


def replace_owned_files(out_dir: Path, written: list[Path]) -> list[Path]:
    """Remove the files an earlier report here wrote that this one did not (only those: listed, regular files,
    inside `out_dir`), then record what this one wrote; returns what was removed."""
    import json

    root = out_dir.resolve()
    keep = {p.resolve().relative_to(root).as_posix() for p in written}
    removed = []
    for name in owned_files(out_dir):
        path = (root / name).resolve()
        if name in keep or not path.is_relative_to(root) or path == root or not path.is_file() or path.is_symlink():
            continue
        path.unlink()
        removed.append(path)
    (out_dir / FILES_NAME).write_text(json.dumps(sorted(keep), indent=1) + "\n", encoding="utf-8")
    return removed


def add_owned_files(out_dir: Path, paths: list[Path]) -> None:
    """Record files written into a report directory after build_report (the demo's mechanisms figure), so that
    the next report there removes them when it does not write them again."""
    import json

    root = out_dir.resolve()
    names = set(owned_files(out_dir)) | {p.resolve().relative_to(root).as_posix() for p in paths}
    (out_dir / FILES_NAME).write_text(json.dumps(sorted(names), indent=1) + "\n", encoding="utf-8")


def render_markdown(out_dir: Path, entries: list[FigureEntry], table_entries: list[TableEntry], inputs: load.Inputs,
                    run_table: pd.DataFrame, sim: pd.DataFrame, summary: list[str] = ()) -> str:
    lines = [
        "# thoughtkv report",
        "",
        *(f"- {line}" for line in summary),
        "",
        f"Generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} by thoughtkv {__version__} from "
        f"{len(inputs.runs)} trace run(s) and {len(inputs.sim_files)} simulator results file(s)"
        + (f" ({len(sim)} rows, {sim['profile'].nunique()} profiles)." if not sim.empty else "."),
        "",
    ]
    if not run_table.empty:
        lines += ["Runs: " + ", ".join(f"`{label}`" for label in run_table["run_label"]) + ".", ""]
        models = ", ".join(shapes_text(m, run_table) for m in sorted(run_table["model"].dropna().unique()))
        lines += [f"Traced model: {models}. Every projected number below is for the model shapes its caption names; "
                  "a small model's ms/token and concurrent sequences are not a 7B's (`thoughtkv simulate --as-model` "
                  "prices the same access pattern at another architecture's shapes).", ""]
    if not sim.empty:
        lines += [f"Simulator results: {priced_text(sim, run_table)} (every projected figure and table below, "
                  "unless its caption names other shapes).", ""]
    for number, entry in enumerate(entries, start=1):
        lines.append(f"## Figure {number}. {entry.title}")
        lines.append("")
        if entry.skipped:
            lines += [f"*Not drawn: {entry.skipped}.*", ""]
            continue
        png, pdf = (p.relative_to(out_dir).as_posix() for p in entry.paths)
        lines += [f"![{entry.title}]({png})", "", f"{entry.caption} ([PDF]({pdf}))", ""]
    if table_entries:
        lines += ["## Tables", ""]
        for entry in table_entries:
            md, tex = (p.relative_to(out_dir).as_posix() for p in entry.paths)
            lines += [f"### {entry.title}", "", entry.markdown, f"LaTeX (booktabs): [{tex}]({tex})", ""]
    if inputs.ignored:
        lines += ["Ignored (not a run or results file): " + ", ".join(f"`{p}`" for p in inputs.ignored), ""]
    return "\n".join(lines)


def best_per_profile(latency: pd.DataFrame, max_accuracy_drop: float = 0.05) -> pd.DataFrame:
    """Per profile, the fastest policy whose accuracy is within `max_accuracy_drop` of the best accuracy.

    The terminal summary of `thoughtkv demo`: ties in accuracy at these n are noise, so "best" means fastest
    among the near-best, not the single highest point estimate.
    """
    if latency.empty or "accuracy" not in latency or latency["accuracy"].isna().all():
        return pd.DataFrame()
    rows = []
    for profile, group in latency.dropna(subset=["accuracy"]).groupby("profile"):
        eligible = group[group["accuracy"] >= group["accuracy"].max() - max_accuracy_drop - 1e-9]
        best = eligible.sort_values(["ms_per_token", "accuracy"], ascending=[True, False]).iloc[0]
        # Other policies whose 95% CI overlaps the choice's: at this n the samples cannot tell their accuracies
        # apart (the 5-point rule compares point estimates), and the summary says so instead of naming a winner.
        others = group[(group["method"] != best["method"]) | (group["hbm_budget"] != best["hbm_budget"])]
        overlapping = others[(others["ci_high"] >= best["ci_low"]) & (others["ci_low"] <= best["ci_high"])]
        unseparated = [frames.with_budget(r.method, r.hbm_budget, r.method == frames.FULL_LABEL)
                       for r in overlapping.sort_values("ms_per_token").itertuples()]
        rows.append({"profile": profile, "method": best["method"], "hbm_budget": best["hbm_budget"],
                     "accuracy": best["accuracy"], "ci_low": best["ci_low"], "ci_high": best["ci_high"],
                     "ms_per_token": best["ms_per_token"], "n": best["n_scored"], "not_separated_from": unseparated,
                     **{c: best[c] for c in ("overhead_mode", "model", *frames.TRAFFIC_COLUMNS) if c in best}})
    return pd.DataFrame(rows).sort_values("ms_per_token").reset_index(drop=True)

