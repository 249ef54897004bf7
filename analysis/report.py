"""build_report: runs + simulator results -> figures (PNG + PDF), tables (Markdown + LaTeX) and report.md.

The figures and tables are `analysis.report_figures` (one builder per figure, FIGURES), their caption text
`analysis.captions`; this module loads the inputs once, writes what the builders return, renders report.md
with its opening summary, and keeps the files it owns in --out. The builders' and captions' public names are
importable from here too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from analysis import frames, load, tables
from analysis.captions import (  # noqa: F401  (re-exported: analysis.report is their public home too)
    AS_MODEL_LABEL,
    COINCIDE_REL,
    LINK_NAMES,
    OVERHEAD_MODE_TEXT,
    coinciding_text,
    host_warnings,
    link_stall_label,
    overheads_text,
    plural,
    priced_text,
    shapes_text,
)
from analysis.captions import zero_text as _zero_text  # noqa: F401
from analysis.report_figures import (  # noqa: F401  (re-exported likewise)
    FIGURES,
    NO_SIM,
    TOP_FRAC,
    Data,
    FigureBuilder,
    Skip,
    per_step_top_share,
    report_tables,
    sim_measured_pairs,
)
from analysis.style import save_figure
from thoughtkv_base import UserError, __version__
from traces.stats import REFERENCE_ARCHITECTURE, bytes_text

REPORT_NAME = "report.md"
# The files a report wrote, relative to its directory: a rebuild into the same --out removes those it does not
# write again (a figure the new data no longer support must not sit beside a report.md saying "not drawn"), and
# never touches anything else there.
FILES_NAME = "report_files.json"


class ReportOutputError(UserError):
    """An --out that cannot take the report."""


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


def check_out_dir(out_dir: Path) -> None:
    """--out must be a new or empty directory, or one holding an earlier report (whose files we replace)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportOutputError(f"--out {out_dir}: exists and is not a directory; choose a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / REPORT_NAME).is_file():
        raise ReportOutputError(
            f"--out {out_dir}: a non-empty directory without {REPORT_NAME}; choose a new or empty directory"
        )


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
    for stem, title, shown in report_tables(data):
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
