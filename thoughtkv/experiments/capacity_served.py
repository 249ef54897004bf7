"""`thoughtkv experiment capacity-served --out docs/`: the committed table of capacity as served (docs/capacity_served.md).

    thoughtkv experiment capacity-served --out docs/ [--runs /work/runs-shared/micro_long] [--work build/capacity_served]

The four micro_long runs of docs/capacity_accuracy_long.md that the table prices (full cache, evict 30% by h2o,
the hierarchy at 30% recalling <= 10% and <= 20% of the context per step; n = 200 each, the same settings:
tracer/micro/table_long.py) are traced into --runs where they are missing or short (a run resumes after its
committed problems), then served on h100-pcie, h200-sxm and gh200-96gb at qwen2-7b's shapes with R1-7B
GSM8K-like request lengths (`thoughtkv capacity`, settings in SETTINGS), each rate a cached sweep cell under
--work: rerunning recomputes nothing that is done. Served twice: with paged admission and recompute preemption
(serve-sim's default, vLLM's rule: the table's rows) and with peak reservation (its column beside, for
comparison). Writes OUT/capacity_served.md, OUT/capacity_served.csv and OUT/figures/capacity_served_frontier.png.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from thoughtkv_base.options import SHARED, add_flags

PROFILES = ("h100-pcie", "h200-sxm", "gh200-96gb")
N_SAMPLES = 200
# The serving settings of the table (one ServingConfig; documented in the table's header).
SETTINGS = dict(duration_s=600.0, max_batch=4096, tbt_slo_s=0.1, ttft_slo_s=10.0, seed=0, lengths="r1-7b/gsm8k")
OPTIONS = dict(overhead_mode="cuda-graphs", transfer="dma-batched")
AS_MODEL = "qwen2-7b"
RATES = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
REFINE = 2
TABLE = "capacity_served"
# How long the regeneration took on this box, from nothing (tracing included); stated in the table's header.
REGENERATION_TEXT = "~1 h on this 2-core box with two workers"


def cells():
    """The four table_long cells the table prices, in its row order."""
    from tracer.micro.table_long import HIERARCHY_SCORER, KEY_BUDGET, Cell

    return [Cell("full"), Cell("evict", KEY_BUDGET, "h2o"),
            Cell("hierarchy", KEY_BUDGET, HIERARCHY_SCORER, 0.0, 0.1),
            Cell("hierarchy", KEY_BUDGET, HIERARCHY_SCORER, 0.0, 0.2)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["out"].use(help="folder for the table", default=Path("docs")),
              SHARED["runs"].use(help="the micro_long runs, one directory per cell, traced where missing",
                                 default=Path("build/micro_long_table"), default_text="build/micro_long_table, "
                                 "capacity-long's"),
              SHARED["work"].use(help="the serving sweep's cached cells and its full report",
                                 default=Path("build/capacity_served")),
              SHARED["batch_size"].use(help="samples decoded per step when tracing", default=16),
              SHARED["workers"].use(help="parallel serving cells"))


def trace_missing(runs: Path, batch_size: int) -> list[Path]:
    """Each cell's run under `runs`, traced (or resumed) unless it already holds N_SAMPLES committed problems."""
    from tracer.micro.table_long import trace_config
    from traces.layout import list_parts

    def committed_samples(run_dir: Path) -> int:  # a samples part is a problem's commit record
        return len(list_parts(run_dir, "samples")) if (run_dir / "run.json").is_file() else 0

    run_dirs = []
    for cell in cells():
        run_dir = runs / cell.name
        if committed_samples(run_dir) < N_SAMPLES:
            from tracer.run import run_trace

            print(f"capacity-served: tracing {run_dir} ({committed_samples(run_dir)} of {N_SAMPLES} done)")
            run_trace(trace_config(cell, runs, N_SAMPLES, full_n_samples=N_SAMPLES, batch_size=batch_size),
                      progress=True)
        run_dirs.append(run_dir)
    return run_dirs


def run(args: argparse.Namespace) -> int:
    from analysis.serving import write_serving_section
    from simulator.options import Projection, ServingConfig, SimOptions
    from thoughtkv.capacity import capacity_sweep

    run_dirs = trace_missing(args.runs, args.batch_size)
    config = ServingConfig(**SETTINGS, projection=Projection(AS_MODEL), options=SimOptions(**OPTIONS))
    table, capacity = capacity_sweep(run_dirs, list(PROFILES), config, list(RATES), REFINE, args.work / "sweep",
                                     workers=args.workers)
    peak = dataclasses.replace(config, admission="peak")
    _, peak_capacity = capacity_sweep(run_dirs, list(PROFILES), peak, list(RATES), REFINE, args.work / "sweep",
                                      workers=args.workers)
    capacity = with_peak_column(capacity, peak_capacity)
    write_serving_section(table, capacity, args.work / "report", config.tbt_slo_s, config.ttft_slo_s)
    written = write_table(capacity, table, args.out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def with_peak_column(capacity, peak_capacity):
    """The paged rows with the peak-reservation sweep's max rate (and its bracket) beside them."""
    keep = peak_capacity[["run_dir", "profile", "max_rate_per_s", "first_failing_rate_per_s", "limit"]].rename(
        columns={"max_rate_per_s": "max_rate_peak_per_s", "first_failing_rate_per_s": "first_failing_rate_peak_per_s",
                 "limit": "limit_peak"})
    return capacity.merge(keep, on=["run_dir", "profile"], how="left")


def one_sentence(capacity, slo: str) -> str:
    """What the table means: the full cache's, the best hierarchy's and eviction's max rates per GPU, and why."""
    from analysis.serving import max_rate_text

    def rates(label: str) -> str:
        rows = capacity[capacity["label"] == label]
        return " / ".join(max_rate_text(r) for _, r in rows.iterrows())

    def first(label: str, column: str):
        return capacity.loc[capacity["label"] == label, column].iloc[0]

    profiles = " / ".join(dict.fromkeys(capacity["profile"]))
    hierarchy = max(dict.fromkeys(capacity.loc[capacity["policy"] == "hierarchy", "label"]),
                    key=lambda lbl: first(lbl, "accuracy"), default=None)
    evict = next(iter(capacity.loc[capacity["policy"] == "evict", "label"]), None)
    limits = capacity[capacity["label"] == hierarchy][["profile", "limit"]]
    def peak_rates(label: str) -> str:
        rows = capacity[capacity["label"] == label]
        return " / ".join(max_rate_text({"max_rate_per_s": r["max_rate_peak_per_s"],
                                         "first_failing_rate_per_s": r["first_failing_rate_peak_per_s"]})
                          for _, r in rows.iterrows())

    def limits_of(label: str) -> str:
        rows = capacity[capacity["label"] == label]
        return ", ".join(f"{r['limit']} on {r['profile']}" for _, r in rows.iterrows())

    text = (f"In one sentence: serving R1-7B GSM8K-like requests at qwen2-7b's shapes within {slo} with paged "
            f"admission and recompute preemption, the full cache ({100 * first('full cache', 'accuracy'):.1f}% "
            f"accurate) sustains {rates('full cache')} req/s on {profiles} ({limits_of('full cache')}")
    if "max_rate_peak_per_s" in capacity:
        text += f"; {peak_rates('full cache')} reserving each request's peak KV"
    text += ")"
    if hierarchy is not None:
        text += (f"; the {hierarchy} ({100 * first(hierarchy, 'accuracy'):.1f}%) sustains {rates(hierarchy)} — "
                 + ", ".join(f"{r['limit']} on {r['profile']}" for _, r in limits.iterrows()))
        if "max_rate_peak_per_s" in capacity:
            text += f" ({peak_rates(hierarchy)} with peak reservation)"
    if evict is not None:
        text += f"; {evict} sustains {rates(evict)} but answers {100 * first(evict, 'accuracy'):.1f}%"
    return text + "."


def write_table(capacity, table, out: Path) -> list[Path]:
    """OUT/capacity_served.{md,csv} and OUT/figures/capacity_served_frontier.{png,pdf}."""
    from analysis.serving import (
        admission_text,
        capacity_markdown,
        frontier_figure,
        priced_text,
        slo_text,
        winners_text,
    )
    from analysis.style import save_figure

    out.mkdir(parents=True, exist_ok=True)
    capacity.to_csv(out / f"{TABLE}.csv", index=False)
    figure = save_figure(frontier_figure(capacity), out / "figures", f"{TABLE}_frontier")
    first = capacity.iloc[0]
    slo = slo_text(first["tbt_slo_s"], first["ttft_slo_s"])
    sentence = one_sentence(capacity, slo)
    lines = [
        "# Capacity as served: max arrival rate per policy and GPU (qwen2-7b shapes, R1-7B GSM8K-like requests)",
        "",
        "Regenerate (resumes; traces the four runs where missing, caches every serving cell): "
        "`thoughtkv experiment capacity-served --out docs/` (runs under build/micro_long_table, where `capacity-long` puts "
        f"them; `--runs DIR` reuses runs elsewhere; {REGENERATION_TEXT}). "
        "Each row: one micro_long run of docs/capacity_accuracy_long.md (n = 200 problems, blocks of 4, 4 sink "
        "tokens, a 16-token window, up to 600 new tokens) served by `thoughtkv capacity` — Poisson arrivals, "
        f"continuous batching (at most {int(first['max_batch'])} requests per iteration), {admission_text(table)} "
        "(simulator/admission.py; the peak-reservation column serves the same arrivals admitting each request only "
        f"when its peak KV fits, never preempting), one shared host link ({first['transfer']}), "
        f"{first['duration_s']:g} s of arrivals per "
        f"rate; sustainable = {slo}, nothing rejected; rates bracketed then refined (to ~4%). {priced_text(table)}. "
        "Accuracy: final-answer exact match, 95% Wilson interval; traffic: attended share of the context (trace) "
        "and H2D bytes per generated token as served at the knee (qwen2-7b bf16 KV, 57,344 bytes/token). "
        "Figure: figures/capacity_served_frontier.png.",
        "",
        sentence,
        "",
        capacity_markdown(capacity),
        "",
        "Why, per GPU: " + winners_text(capacity) + ". The limit is read at the first failing rate as the resource "
        "nearest saturation, its share in the table: the host link (its busier direction's bytes / bandwidth / "
        "time), HBM (held at its fullest / capacity), the GPU (its kernels' share of the iterations' time; a wall "
        "within 2 points of it is named first: a loaded GPU computes through nearly every iteration). Paged "
        "admission holds each request's current blocks, not its peak: where HBM binds, it runs more requests "
        "than the peak column (which holds the peak of each) until preemptions' recomputes cost the batch its "
        "TBT; where the link or the GPU binds, admission hardly matters (simulator/README.md, \"Preemption\").",
        "",
    ]
    (out / f"{TABLE}.md").write_text("\n".join(lines))
    return [out / f"{TABLE}.md", out / f"{TABLE}.csv", *figure]
