"""`thoughtkv experiment real-model --out docs/`: the capacity-fidelity table of a real pretrained LM (docs/real_model.md).

    thoughtkv experiment real-model --out docs/ [--runs build/real_model] [--n-samples 100] [--shard I/N] [--batch-size 48]

Model `smollm2-135m` (SmolLM2-135M-Instruct, tracer/packaged.py) on GSM8K. Its accuracy is at the floor, so every
policy is graded by fidelity to the model's own full-cache output (tracer/fidelity.py): the full cache's greedy
chain of each problem is the reference (the `full` cell), and every other cell is a `thoughtkv trace
--fidelity-reference` run of it: teacher-forced KL, top-1 agreement and NLL on the reference chain, free-running
first divergence and answer match, and the NLL gap on GSM8K's human-written solutions, each beside the traffic
that bought it. Cells: HBM 10 / 20 / 30 / 50% x {evict with h2o, tova, snapkv; hierarchy (h2o placement,
nothing evicted) recalling with quest and quest-per-head at <= 5 / 10 / 20% of the context per step; the oracle
recall rule at <= 10% (a ceiling)}, and the full cache decoded again against itself (the measurement's floor).

Every cell is one trace run under --runs, so the table resumes where it stopped; the Markdown and CSV are
rewritten after every cell from the runs that exist. `--shard I/N` traces every N-th cell from the I-th (N
processes side by side; the reference is traced first by whichever gets it, the others wait for it). A cell
another process is tracing is skipped and come back to, so a second process started later without --shard
takes the next free cell.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base import UserError
from thoughtkv_base.markdown import markdown_table
from thoughtkv_base.options import SHARED, TEXT, Flag, add_flags
from tracer.packaged import ASSETS_DIR as PACKAGED_ASSETS_DIR

MODEL = "smollm2-135m"
TASK = "gsm8k"
DEFAULT_DATA_FILE = Path("../shared/data/gsm8k/test.jsonl")
HBM_BUDGETS = (0.1, 0.2, 0.3, 0.5)
RECALL_BUDGETS = (0.05, 0.1, 0.2)
EVICTION_SCORERS = ("h2o", "tova", "snapkv")
RECALL_RULES = ("quest", "quest-per-head")
ORACLE_RECALL = 0.1
HIERARCHY_SCORER = "h2o"
KEY_BUDGET = 0.3
N_SAMPLES = 100  # problems per cell
MAX_NEW_TOKENS = 256  # the reference chains' length limit (the table's; the model's own default may differ)
DTYPE = "float32"
CSV_NAME = "real_model.csv"
DOC_NAME = "real_model.md"
LOCK_POLL_S = 10.0
PARTS = ("table", "profile", "served")
# The subsets of problems each row is summarised over (traces.fidelity.SUBSETS) and their CSV column prefixes.
SUBSET_PREFIX = {"all": "", "non-looping": "nonloop_", "no-verbatim-repeat": "noverb_"}


@dataclass(frozen=True)
class Cell:
    policy: str  # full | full-again | evict | hierarchy
    hbm_budget: float = 1.0
    scorer: str = HIERARCHY_SCORER
    recall_budget: float | None = None
    recall_rule: str = "quest"

    @property
    def name(self) -> str:
        if self.policy in ("full", "full-again"):
            return self.policy
        if self.policy == "evict":
            return f"evict-{self.scorer}-b{round(self.hbm_budget * 100)}"
        return f"hier-{self.recall_rule}-r{round(self.recall_budget * 100)}-b{round(self.hbm_budget * 100)}"

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full cache (the reference)"
        if self.policy == "full-again":
            return "full cache, decoded again (floor)"
        if self.policy == "evict":
            return f"evict {self.scorer}"
        ceiling = " (ceiling)" if self.recall_rule == "oracle" else (
            " (prefetchable)" if self.recall_rule in SPECULATIVE_RULES else "")
        return f"hierarchy {self.recall_rule}{ceiling}, recall ≤ {self.recall_budget:.0%}"


def column(budget: float) -> list[Cell]:
    """Every cell at one HBM budget: eviction by scorer, the hierarchy by rule and recall, the oracle ceiling."""
    return ([Cell("evict", budget, scorer) for scorer in EVICTION_SCORERS]
            + [Cell("hierarchy", budget, HIERARCHY_SCORER, recall, rule)
               for rule in RECALL_RULES for recall in RECALL_BUDGETS]
            + [Cell("hierarchy", budget, HIERARCHY_SCORER, ORACLE_RECALL, "oracle")])


# Recall decided before the layer runs (traces.policy.PREFETCHABLE_RECALL_RULES): the query speculated from the
# previous layer's input (InfiniGen's idea) or the previous step's query, beside quest at the same traffic.
SPECULATIVE_RULES = ("prev-layer", "prev-step")
SPECULATIVE_BUDGETS, SPECULATIVE_RECALLS = (0.3, 0.5), (0.1, 0.2)


def speculative_cells() -> list[Cell]:
    return [Cell("hierarchy", budget, HIERARCHY_SCORER, recall, rule) for rule in SPECULATIVE_RULES
            for budget in SPECULATIVE_BUDGETS for recall in SPECULATIVE_RECALLS]


def cells() -> list[Cell]:
    """The reference first, then the key budget's column, the floor, the other budgets, then the speculative
    (prefetchable) rules."""
    return [Cell("full"), *column(KEY_BUDGET), Cell("full-again"),
            *(cell for budget in HBM_BUDGETS if budget != KEY_BUDGET for cell in column(budget)),
            *speculative_cells()]


# Traced first, so a partial table answers the headline: the key budget's remaining rows, the floor, the
# prefetchable rules there, then eviction's cliff and the hierarchy across budgets; every other cell after.
TRACE_FIRST = ("hier-quest-per-head-r5-b30", "hier-quest-per-head-r20-b30", "hier-oracle-r10-b30", "full-again",
               "hier-prev-step-r10-b30", "hier-prev-layer-r10-b30", "evict-tova-b10", "hier-quest-per-head-r10-b10",
               "evict-tova-b50", "hier-quest-per-head-r10-b50", "evict-tova-b20", "hier-quest-per-head-r10-b20",
               # the served frontier's two hierarchy points, then the oracle ceiling of every column
               "hier-quest-r10-b50", "hier-quest-per-head-r20-b50",
               "hier-oracle-r10-b10", "hier-oracle-r10-b20", "hier-oracle-r10-b50",
               "hier-quest-per-head-r20-b10", "hier-quest-per-head-r20-b20", "hier-quest-r10-b20",
               "evict-h2o-b20", "evict-snapkv-b20", "evict-h2o-b50", "evict-snapkv-b50")


def trace_order() -> list[Cell]:
    """cells() in tracing order: the reference, TRACE_FIRST, then the rest in document order."""
    reference, *others = cells()
    rank = {name: i for i, name in enumerate(TRACE_FIRST)}
    return [reference, *sorted(others, key=lambda c: rank.get(c.name, len(rank)))]


def trace_config(cell: Cell, runs: Path, n_samples: int, data_file: Path, batch_size: int,
                 max_new_tokens: int = MAX_NEW_TOKENS):
    from tracer.run import TraceConfig

    common = dict(model=MODEL, task=TASK, n_samples=n_samples, data_file=str(data_file), out=str(runs / cell.name),
                  max_new_tokens=max_new_tokens, dtype=DTYPE, access=False, seed=0, threads=1)
    if cell.policy == "full":  # the reference: one job per sample, batched as wide
        return TraceConfig(**common, policy="full", batch_size=max(1, batch_size // 3))
    fidelity = dict(fidelity_reference=str(runs / "full"), batch_size=batch_size)
    if cell.policy == "full-again":
        return TraceConfig(**common, **fidelity, policy="full")
    if cell.policy == "evict":
        return TraceConfig(**common, **fidelity, policy="evict", scorer=cell.scorer, hbm_budget=cell.hbm_budget)
    return TraceConfig(**common, **fidelity, policy="hierarchy", scorer=cell.scorer, hbm_budget=cell.hbm_budget,
                       evict_ratio=0.0, recall_budget=cell.recall_budget, recall_rule=cell.recall_rule)


def _trace_when_free(config, progress: bool) -> None:
    """run_trace, waiting while another process (another shard) holds the run's lock."""
    from tracer.run import TraceLockedError, run_trace

    while True:
        try:
            run_trace(config, progress=progress)
            return
        except TraceLockedError:
            time.sleep(LOCK_POLL_S)


def _trace_cells(configs: list, progress: bool, after_each) -> None:
    """Trace each config in order; one whose run another process holds is deferred behind the rest and retried
    (so two processes over the same cells share them without sharding), waiting only when nothing else is left."""
    from tracer.run import TraceLockedError, run_trace

    pending = list(configs)
    while pending:
        config = pending.pop(0)
        try:
            run_trace(config, progress=progress)
        except TraceLockedError:
            pending.append(config)
            if len(pending) == 1:
                time.sleep(LOCK_POLL_S)
            continue
        after_each()


def run_table(out: Path, runs: Path, n_samples: int, data_file: Path, batch_size: int,
              shard: tuple[int, int] = (0, 1), progress: bool = True, parts: tuple[str, ...] = PARTS,
              max_new_tokens: int = MAX_NEW_TOKENS) -> Path:
    """The reference cell, then (shard 0) the attention profile, then this shard's cells."""
    runs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    reference, *others = trace_order()
    if "table" in parts:
        _trace_when_free(trace_config(reference, runs, n_samples, data_file, batch_size, max_new_tokens), progress)
    index, count = shard
    if "profile" in parts and index == 0:
        from thoughtkv.experiments import real_model_profile

        profiles = {model: real_model_profile.profile_model(runs, model, n_samples, data_file, max(1, batch_size // 3),
                                                            progress)
                    for model in real_model_profile.MODELS}
        real_model_profile.write(out, profiles)
        write(out, runs)
    if "table" not in parts:
        if "served" in parts and index == 0:
            _serve(out, runs)
        return out / DOC_NAME
    # after every cell: a partial table, each row with its n
    _trace_cells([trace_config(cell, runs, n_samples, data_file, batch_size, max_new_tokens)
                  for cell in others[index::count]], progress, lambda: write(out, runs))
    if "served" in parts and index == 0:
        _serve(out, runs)
    write(out, runs)
    return out / DOC_NAME


SERVED_CELLS = (Cell("full"), Cell("evict", 0.3, "tova"), Cell("evict", 0.3, "h2o"),
                Cell("hierarchy", 0.3, HIERARCHY_SCORER, 0.1, "quest"),
                Cell("hierarchy", 0.3, HIERARCHY_SCORER, 0.2, "quest-per-head"),
                Cell("hierarchy", 0.5, HIERARCHY_SCORER, 0.1, "quest"),
                Cell("hierarchy", 0.5, HIERARCHY_SCORER, 0.2, "quest-per-head"))


def _serve(out: Path, runs: Path) -> None:
    """The served frontier of SERVED_CELLS (thoughtkv/real_model_served.py), then the document again."""
    from thoughtkv.experiments import real_model_served

    real_model_served.serve(out, runs, SERVED_CELLS, {row["cell"]: row for row in result_rows(runs)})
    write(out, runs)


# --------------------------------------------------------------------------------------------- results


def cell_result(cell: Cell, runs: Path) -> dict | None:
    """A cell's fidelity summaries (all samples, non-looping) and traffic; None when it has not run."""
    from traces import open_run
    from traces.fidelity import has_fidelity, summary
    from traces.stats import run_traffic

    run_dir = runs / cell.name
    if not (run_dir / "run.json").is_file():
        return None
    trace = open_run(run_dir)
    samples = trace.samples()
    if samples.empty:
        return None
    result = {"cell": cell, "n": len(samples), "traffic": run_traffic(trace), "samples": samples}
    if has_fidelity(samples):
        for subset in SUBSET_PREFIX:
            result[subset] = summary(samples, subset)
    return result


def result_rows(runs: Path) -> list[dict]:
    """One record per cell that has run (the CSV): settings, n, fidelity with intervals, traffic."""
    rows = []
    for cell in cells():
        result = cell_result(cell, runs)
        if result is None or "all" not in result:
            continue
        t = result["traffic"]
        row = {"cell": cell.name, "policy": cell.policy, "hbm_budget": cell.hbm_budget, "scorer": cell.scorer,
               "recall_budget": cell.recall_budget, "recall_rule": cell.recall_rule if cell.policy == "hierarchy" else None}
        for subset, prefix in SUBSET_PREFIX.items():
            s = result[subset]
            row[f"{prefix}n"] = s["n"]
            for key in ("kl", "top1", "nll_gap", "human_nll_gap", "human_kl", "human_top1"):
                row[f"{prefix}{key}"], row[f"{prefix}{key}_low"], row[f"{prefix}{key}_high"] = s[key]
            k, n, low, high = s["answer_match"]
            row.update({f"{prefix}answer_match_k": k, f"{prefix}answer_match_n": n,
                        f"{prefix}answer_match": k / n if n else math.nan, f"{prefix}answer_match_low": low,
                        f"{prefix}answer_match_high": high,
                        f"{prefix}median_first_divergence": s["median_first_divergence"],
                        f"{prefix}diverged_share": s["diverged_share"]})
        row["looping_chains"] = result["all"]["n_looping"]
        row["verbatim_repeat_chains"] = result["all"]["n_verbatim_repeat"]
        row.update({k: t[k] for k in ("hbm_frac", "attended_frac", "recalled_frac", "recalled_tokens_per_layer_step",
                                      "h2d_bytes_per_token", "d2h_bytes_per_token", "h2d_bytes_per_token_ref",
                                      "d2h_bytes_per_token_ref")})
        rows.append(row)
    return rows


def _pct(mean, low, high) -> str:
    return "—" if math.isnan(mean) else f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def _num(mean, low, high) -> str:
    return "—" if math.isnan(mean) else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def _traffic_cells(row: dict) -> list[str]:
    from traces.stats import bytes_text

    return [f"{100 * row['attended_frac']:.1f}%", f"{100 * row['recalled_frac']:.1f}%",
            bytes_text(row["h2d_bytes_per_token"]), bytes_text(row["h2d_bytes_per_token_ref"])]


def _budget(row: dict) -> str:
    return "100%" if row["policy"].startswith("full") else f"{row['hbm_budget']:.0%}"


CHAIN_HEADER = ("HBM", "method", "n", "KL nats/token [95% CI]", "top-1 agreement % [95% CI]",
                "answer match % [95% CI] (k/n)", "median first divergence (diverged %)", "attended %",
                "recalled %", "H2D/token (own)", "H2D/token @qwen2-7b")
HUMAN_HEADER = ("HBM", "method", "n", "NLL gap nats/token [95% CI]", "KL nats/token [95% CI]",
                "top-1 agreement with the full cache % [95% CI]", "attended %", "recalled %", "H2D/token (own)",
                "H2D/token @qwen2-7b")


def chain_table(rows: list[dict], prefix: str = "") -> list[str]:
    table = []
    for row in rows:
        k, n = row[f"{prefix}answer_match_k"], row[f"{prefix}answer_match_n"]
        match = (_pct(row[f"{prefix}answer_match"], row[f"{prefix}answer_match_low"], row[f"{prefix}answer_match_high"])
                 + f" ({k}/{n})")
        median = row[f"{prefix}median_first_divergence"]
        divergence = "never" if math.isnan(median) else f"{median:.0f} ({100 * row[f'{prefix}diverged_share']:.0f}%)"
        table.append([_budget(row), _label(row), str(row[f"{prefix}n"]),
                      _num(*(row[f"{prefix}kl{s}"] for s in ("", "_low", "_high"))),
                      _pct(*(row[f"{prefix}top1{s}"] for s in ("", "_low", "_high"))), match, divergence,
                      *_traffic_cells(row)])
    return markdown_table(CHAIN_HEADER, table)


def human_table(rows: list[dict]) -> list[str]:
    return markdown_table(HUMAN_HEADER, ([
        _budget(row), _label(row), str(row["n"]), _num(*(row[f"human_nll_gap{s}"] for s in ("", "_low", "_high"))),
        _num(*(row[f"human_kl{s}"] for s in ("", "_low", "_high"))),
        _pct(*(row[f"human_top1{s}"] for s in ("", "_low", "_high"))), *_traffic_cells(row)] for row in rows))


def _label(row: dict) -> str:
    return next(c.label for c in cells() if c.name == row["cell"])


def headline(rows: list[dict]) -> str:
    """At which HBM budget and traffic the hierarchy keeps the real LM's output, and whether eviction's cliff
    appears: read off the rows (the best hierarchy row per budget by KL against the best eviction row)."""
    from traces.stats import bytes_text

    def best(policy, budget):
        candidates = [r for r in rows if r["policy"] == policy and r["hbm_budget"] == budget
                      and r.get("recall_rule") != "oracle"]
        return min(candidates, key=lambda r: r["kl"]) if candidates else None

    parts = []
    for budget in sorted({r["hbm_budget"] for r in rows if r["policy"] in ("evict", "hierarchy")}):
        hierarchy, evict = best("hierarchy", budget), best("evict", budget)
        if hierarchy is None or evict is None:
            continue
        parts.append(
            f"at {budget:.0%} HBM the best hierarchy ({_label(hierarchy)}) has KL {hierarchy['kl']:.3f} and top-1 "
            f"{100 * hierarchy['top1']:.1f}% for {bytes_text(hierarchy['h2d_bytes_per_token_ref'])}/token H2D at "
            f"qwen2-7b ({100 * hierarchy['attended_frac']:.0f}% attended), the best eviction ({_label(evict)}) KL "
            f"{evict['kl']:.3f}, top-1 {100 * evict['top1']:.1f}%")
    if not parts:
        return "In one sentence: not yet — no budget has both its hierarchy and eviction cells."
    return "In one sentence: " + "; ".join(parts) + "."


FIGURE_STEM = "real_model_fidelity"
FIGURE_CAPTION = ("teacher-forced KL(full ‖ policy) per token (log scale, 95% bootstrap CI, n per cell in the "
                  "table) against H2D bytes per generated token priced at qwen2-7b, one series per HBM budget and "
                  "recall rule (the oracle a ceiling, prev-layer / prev-step prefetchable); hollow: the best "
                  "eviction at that budget (no traffic); dotted: the full cache decoded again (the floor).")


def write(out: Path, runs: Path) -> None:
    from traces.layout import write_atomic, write_csv_atomic

    rows = result_rows(runs)
    write_csv_atomic(out / CSV_NAME, rows)
    if rows:
        import pandas as pd

        from analysis.real_model_figures import fidelity_vs_traffic
        from analysis.style import save_figure

        save_figure(fidelity_vs_traffic(pd.DataFrame(rows)), out / "figures", FIGURE_STEM)
    reference = cell_result(Cell("full"), runs)
    limit = MAX_NEW_TOKENS
    if reference is not None:
        from traces import open_run

        limit = (open_run(runs / "full").manifest.get("tracer") or {}).get("max_new_tokens", MAX_NEW_TOKENS)
    missing = [c.name for c in cells()[1:] if not any(r["cell"] == c.name for r in rows)]
    lines = [
        "# A real pretrained LM: capacity against fidelity to the full cache (SmolLM2-135M-Instruct, GSM8K)",
        "",
        f"Regenerate (resumes; one `thoughtkv trace` run per cell under `{runs}`): `thoughtkv experiment real-model --out docs/`",
        "(two processes side by side: `--shard 0/2` and `--shard 1/2`). Model: `smollm2-135m` (tracer/packaged.py),",
        f"{DTYPE} on this CPU, greedy, GSM8K test problems in file order with the chat template and DeepSeek's",
        f"reasoning instruction, up to {limit} new tokens. Its GSM8K accuracy is at the floor, so each policy",
        "is graded by **fidelity to the model's own full-cache output** (tracer/fidelity.py): teacher-forced on the",
        "full cache's greedy chain, KL(full ‖ policy) of the next-token distribution (nats, mean over decode",
        "steps), the share of steps whose top-1 token is the chain's, and the NLL gap; free-running, the median",
        "step at which the greedy chain first leaves the reference (and the share that do) and whether the",
        "extracted final answer is the full cache's string (over the problems where the full cache has one);",
        "teacher-forced on GSM8K's human-written solutions (calculator annotations removed), the NLL gap to the full",
        "cache. Intervals: 95% percentile bootstrap over problems (2,000 resamples) for means, Wilson for answer",
        "match. Traffic (free-running decode steps): attended and recalled shares of the context per layer-step,",
        "H2D bytes per generated token for the model's own KV (fp32, 30 layers x 3 KV heads x 64) and for the same",
        "access pattern priced at qwen2-7b's bf16 KV (57,344 bytes/token). Hierarchy: h2o placement, nothing",
        "evicted, DDR blocks recalled per layer and step up to the recall budget (quest: Quest's key bound, max",
        "over heads; quest-per-head: each KV head its own picks, the union copied; oracle: the true attention",
        "mass, a ceiling that costs a full attention). Geometry: the model's trace defaults",
        "(tracer/assets/smollm2-135m/trace_defaults.json).",
        "",
        headline(rows),
        "",
    ]
    if reference is not None and rows:
        lines += [f"Reference chains: {reference['n']} problems; of the {rows[0]['n']} graded in a cell, "
                  f"{rows[0]['looping_chains']} repeat an 8-gram (the loop flag: it also catches fluent chains that "
                  "reuse a phrase such as \"the total cost of the donuts is\") and "
                  f"{rows[0]['verbatim_repeat_chains']} repeat a whole 32-token span (a sentence repeated verbatim: "
                  "a degenerate loop). The second and third tables leave those out.", ""]
    if rows:
        lines += [f"![KL against H2D traffic per token](figures/{FIGURE_STEM}.png)", "",
                  f"figures/{FIGURE_STEM}.png: {FIGURE_CAPTION}", ""]
    lines += ["## Teacher-forced on the full cache's chains (all problems)", "", *chain_table(rows), "",
              "## The same, chains that repeat no 8-gram", "", *chain_table(rows, "nonloop_"), "",
              "## The same, chains that repeat no 32-token span", "", *chain_table(rows, "noverb_"), "",
              "## Teacher-forced on GSM8K's human-written solutions", "", *human_table(rows), ""]
    lines.append(f"Cells not run yet: {len(missing)} of {len(cells()) - 1} ({', '.join(missing)})." if missing
                 else "All cells have run.")
    for extra in ("real_model_profile.md", "real_model_served.md"):  # written by their own steps
        part = out / extra
        if part.is_file():
            lines += ["", part.read_text(encoding="utf-8").rstrip()]
    write_atomic(out / DOC_NAME, lambda temp: temp.write_text("\n".join(lines) + "\n", encoding="utf-8"))


# ------------------------------------------------------------------------------------------------- CLI


OWN = (
    Flag("--part", "table: the fidelity cells; profile: the attention profile; served: the served frontier of the "
         "cells that have run", TEXT, choices=(*PARTS, "all"), default="all"),
    Flag("--table-only", "rewrite the document from the runs there are", None, action="store_true", default=False),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["out"].use(help="folder for real_model.md and its CSV", default=Path("docs")),
              SHARED["runs"].use(default=Path("build/real_model")),
              SHARED["data_file"].use(help="the GSM8K test JSONL", default=DEFAULT_DATA_FILE),
              SHARED["n_samples"].use(help="problems per cell", default=N_SAMPLES),
              SHARED["batch_size"].use(help="jobs decoded per step (three per problem: free-running and two "
                                            "teacher-forced)", default=48),
              SHARED["max_new_tokens"].use(help="the reference chains' decode limit", default=MAX_NEW_TOKENS),
              "shard", *OWN)


def run(args: argparse.Namespace) -> int:
    if not args.table_only and not args.data_file.is_file():
        raise UserError(f"--data-file {args.data_file}: no such file; pass the GSM8K test JSONL")
    shard = args.shard
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        write(args.out, args.runs)
    else:
        run_table(args.out, args.runs, args.n_samples, args.data_file, args.batch_size, shard,
                  parts=PARTS if args.part == "all" else (args.part,), max_new_tokens=args.max_new_tokens)
    print(f"wrote {args.out / DOC_NAME}")
    return 0


# ------------------------------------------------------------------------------------------------- demo

# The first GSM8K test problems ship with thoughtkv (MIT, tracer/assets/smollm2-135m/gsm8k_LICENSE) so that the
# demo and the tests need no data set.
SHIPPED_PROBLEMS = PACKAGED_ASSETS_DIR / MODEL / "gsm8k_test_head.jsonl"  # the model's shipped assets (tracer/assets)
DEMO_CELLS = (Cell("evict", KEY_BUDGET, "h2o"), Cell("hierarchy", KEY_BUDGET, HIERARCHY_SCORER, 0.1, "quest"))


def demo_section(runs: Path, report: Path, n_samples: int, max_new_tokens: int, progress: bool = True) -> str:
    """The demo's real-model section: a few shipped GSM8K problems, the full cache's chains as the reference,
    eviction and the hierarchy at one budget graded by fidelity, each with its traffic; appended to report.md
    and returned as text."""
    from traces.stats import bytes_text

    for cell in (Cell("full"), *DEMO_CELLS):
        config = trace_config(cell, runs, n_samples, SHIPPED_PROBLEMS, 3 * n_samples, max_new_tokens)
        _trace_when_free(config, progress)
    lines = [f"## A real pretrained LM: {MODEL} on {n_samples} GSM8K problems, fidelity to its full cache", "",
             f"SmolLM2-135M-Instruct (tracer/packaged.py) at HBM {KEY_BUDGET:.0%}, up to {max_new_tokens} new tokens; "
             "graded against the full cache's own chains (teacher-forced KL and top-1 agreement, free-running answer "
             f"match), with the traffic that bought it. The full table (n = {N_SAMPLES} per cell): docs/real_model.md.",
             ""]
    table = []
    for cell in DEMO_CELLS:
        result = cell_result(cell, runs)
        s, t = result["all"], result["traffic"]
        k, n, _, _ = s["answer_match"]
        table.append([cell.label, s["n"], _num(*s["kl"]), f"{100 * s['top1'][0]:.1f}", f"{k}/{n}",
                      f"{100 * t['attended_frac']:.1f}", bytes_text(t["h2d_bytes_per_token_ref"])])
    lines += markdown_table(("method", "n", "KL nats/token [95% CI]", "top-1 agreement %", "answer match",
                             "attended %", "H2D/token @qwen2-7b"), table)
    text = "\n".join(lines) + "\n"
    with open(report / "report.md", "a", encoding="utf-8") as handle:
        handle.write("\n" + text)
    return text
