"""The capacity–accuracy–traffic table on the long workload, through the tracer's Python API:

    thoughtkv experiment capacity-long --out docs/ [--runs build/micro_long_table] [--n-samples 200]
                                      [--cells key|all] [--shard I/N]

Model: the bundled long-workload micro model (`tracer/assets/micro_long`); task `chains_long` (~547 tokens,
look-ups up to ~490 tokens back). Cells: HBM budget 10/20/30/50% × recall budget ≤ 5/10/20% of the context per
layer-step (`recall_budget`, rounded down to whole blocks) × evict 0 / 0.1, plus pure eviction (recency =
StreamingLLM, H2O, TOVA) at each budget and the full cache. Every cell is one `thoughtkv trace` run in its own
directory under `--runs`, so the table resumes where it stopped; the Markdown is rewritten after every cell from
whatever runs exist, each row with its n and its traffic (traces.stats.traffic_summary, decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from thoughtkv_base.markdown import markdown_table
from tracer.model_defaults import trace_defaults

HBM_BUDGETS = (0.5, 0.3, 0.2, 0.1)
RECALL_BUDGETS = (0.05, 0.1, 0.2)  # recalled tokens per layer-step, as a share of the current context
EVICT_RATIOS = (0.0, 0.1)
EVICTION_SCORERS = ("recency", "h2o", "tova")
KEY_BUDGET = 0.3
HIERARCHY_SCORER = "h2o"
ISSUE_N = 200  # problems per cell the issue asks for
FULL_N_SAMPLES = 500  # the full-cache cell doubles as the model's quality check (>= 95% on 500)
MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "micro_long"
# The cache geometry and decode limit come with the model (tracer/assets/micro_long/trace_defaults.json, the one
# home): ~547-token sequences, so blocks of 4 (a 5% recall budget is then ~6 blocks), 4 sinks, a 16-token window,
# and 600 new tokens (the longest chain of thought of the 500 held-out problems is 481 tokens). The table's own
# recall budgets (RECALL_BUDGETS) are its axis, not the model's default.
_DEFAULTS = trace_defaults(str(MODEL_DIR))
BLOCK_SIZE, SINK_TOKENS, WINDOW_TOKENS = (_DEFAULTS[k] for k in ("block_size", "sink_tokens", "window_tokens"))
MAX_NEW_TOKENS = _DEFAULTS["max_new_tokens"]
TASK = "chains_long"


@dataclass(frozen=True)
class Cell:
    policy: str  # full | evict | hierarchy
    hbm_budget: float = 1.0
    scorer: str = "h2o"
    evict_ratio: float = 0.0
    recall_budget: float | None = None
    recall_rule: str = "quest"  # quest (max over KV heads) | quest-per-head (each KV head its own top blocks)

    @property
    def name(self) -> str:
        if self.policy == "full":
            return "full"
        if self.policy == "evict":
            return f"evict-{self.scorer}-b{round(self.hbm_budget * 100)}"
        rule = "" if self.recall_rule == "quest" else "-qph"
        return (f"hier-e{round(self.evict_ratio * 100)}-r{round(self.recall_budget * 100)}"
                f"-b{round(self.hbm_budget * 100)}{rule}")

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full cache"
        if self.policy == "evict":
            return f"evict {self.scorer}"
        rule = "" if self.recall_rule == "quest" else f", {self.recall_rule}"
        return f"hierarchy e={self.evict_ratio:g}, recall ≤ {self.recall_budget:.0%}{rule}"


def column(budget: float) -> list[Cell]:
    """Every non-full cell at one HBM budget: pure eviction first, then the hierarchy by evict and recall."""
    return [Cell("evict", budget, scorer) for scorer in EVICTION_SCORERS] + [
        Cell("hierarchy", budget, HIERARCHY_SCORER, evict, recall)
        for evict in EVICT_RATIOS for recall in RECALL_BUDGETS
    ]


def rule_cells(budget: float = KEY_BUDGET) -> list[Cell]:
    """The more selective recall rule (quest-per-head: each KV head recalls its own top blocks, the union is
    copied) at one budget, nothing evicted, for the accuracy-vs-traffic figure's comparison with `quest`."""
    return [Cell("hierarchy", budget, HIERARCHY_SCORER, 0.0, recall, "quest-per-head") for recall in RECALL_BUDGETS]


def cells(which: str) -> list[Cell]:
    """`key`: full and the 30% column; `all`: those first, the recall-rule comparison, then the other budgets."""
    key = [Cell("full"), *column(KEY_BUDGET)]
    if which == "key":
        return key
    return key + rule_cells() + [cell for budget in HBM_BUDGETS if budget != KEY_BUDGET for cell in column(budget)]


def trace_config(cell: Cell, runs: Path, n_samples: int, model: str = str(MODEL_DIR),
                 full_n_samples: int = FULL_N_SAMPLES, batch_size: int = 1):
    from tracer.run import TraceConfig

    common = dict(model=model, task=TASK, out=str(runs / cell.name), n_samples=n_samples, block_size=BLOCK_SIZE,
                  sink_tokens=SINK_TOKENS, window_tokens=WINDOW_TOKENS, max_new_tokens=MAX_NEW_TOKENS, seed=0,
                  access=False, batch_size=batch_size)  # batched = sequential, per sample (tests/test_batched*)  # the table needs the steps table only; access rows would double the run's size
    if cell.policy == "full":
        return TraceConfig(**{**common, "n_samples": max(n_samples, full_n_samples)}, policy="full")
    if cell.policy == "evict":
        return TraceConfig(**common, policy="evict", scorer=cell.scorer, hbm_budget=cell.hbm_budget)
    return TraceConfig(**common, policy="hierarchy", scorer=cell.scorer, hbm_budget=cell.hbm_budget,
                       evict_ratio=cell.evict_ratio, recall_budget=cell.recall_budget, recall_rule=cell.recall_rule)


def run_table(out_dir: Path, runs: Path, n_samples: int, which: str, progress: bool = True,
              shard: tuple[int, int] = (0, 1), model: str = str(MODEL_DIR),
              full_n_samples: int = FULL_N_SAMPLES, batch_size: int = 1) -> Path:
    """Trace the cells (shard (i, n): every n-th cell from the i-th, for n processes side by side)."""
    from tqdm.auto import tqdm

    from tracer.run import run_trace

    runs.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    index, count = shard
    target = out_dir / "capacity_accuracy_long.md"
    for cell in tqdm(cells(which)[index::count], desc="capacity-accuracy cells", unit="cell", disable=not progress):
        run_trace(trace_config(cell, runs, n_samples, model, full_n_samples, batch_size), progress=progress)
        write_markdown(target, runs)  # after every cell: a partial table is kept, each row with its n
    return target


def cell_result(cell: Cell, runs: Path) -> tuple[int, int, dict] | None:
    """(n scored, n correct, traffic) of a cell's run; None when it has not run."""
    from traces.reader import open_run
    from traces.stats import run_traffic

    run_dir = runs / cell.name
    if not (run_dir / "run.json").is_file():
        return None
    trace = open_run(run_dir)
    scored = trace.samples()["correct"].dropna()
    if scored.empty:
        return None
    return len(scored), int(scored.sum()), run_traffic(trace)


def _accuracy_text(n: int, correct: int) -> str:
    from traces.stats import wilson_interval

    low, high = wilson_interval(correct, n)
    return f"{100 * correct / n:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def cell_row(cell: Cell, runs: Path) -> list[str] | None:
    """One table row (None when the cell has not run): accuracy [CI] n, then its traffic."""
    from traces.stats import bytes_text

    result = cell_result(cell, runs)
    if result is None:
        return None
    n, correct, t = result
    return [
        "100%" if cell.policy == "full" else f"{cell.hbm_budget:.0%}", cell.label,
        _accuracy_text(n, correct), str(n),
        f"{100 * t['hbm_frac']:.1f}%", f"{100 * t['attended_frac']:.1f}%",
        f"{t['recalled_tokens_per_layer_step']:.1f} ({100 * t['recalled_frac']:.1f}%)",
        bytes_text(t["h2d_bytes_per_token"]), bytes_text(t["d2h_bytes_per_token"]),
        bytes_text(t["h2d_bytes_per_token_ref"]), bytes_text(t["d2h_bytes_per_token_ref"]),
    ]


def headline(runs: Path, budget: float = KEY_BUDGET, recall: float = 0.1) -> str:
    """The table's answer in one sentence, from the runs: at `budget` HBM, the hierarchy (evict 0) recalling at
    most `recall` of the context per step vs the best pure eviction, each with its n and traffic."""
    from traces.stats import bytes_text

    hierarchy = cell_result(Cell("hierarchy", budget, HIERARCHY_SCORER, 0.0, recall), runs)
    evictions = {s: cell_result(Cell("evict", budget, s), runs) for s in EVICTION_SCORERS}
    evictions = {s: r for s, r in evictions.items() if r is not None}
    if hierarchy is None or not evictions:
        return f"In one sentence: not yet — the {budget:.0%} hierarchy (recall ≤ {recall:.0%}) or eviction cells have not run."
    best = max(evictions, key=lambda s: evictions[s][1] / evictions[s][0])
    n, correct, t = hierarchy
    en, ecorrect, _ = evictions[best]
    return (
        f"In one sentence: at {budget:.0%} HBM, recalling ≤ {recall:.0%} of the context per step (nothing evicted) "
        f"keeps {_accuracy_text(n, correct)}% (n={n}) vs {_accuracy_text(en, ecorrect)}% (n={en}) for the best pure "
        f"eviction ({best}), attending {100 * t['attended_frac']:.1f}% of the context and moving "
        f"{bytes_text(t['h2d_bytes_per_token_ref'])} H2D per generated token at qwen2-7b's KV size."
    )


HEADER = ("HBM budget", "method", "accuracy % [95% CI]", "n", "HBM % (attention)", "attended %",
          "recalled tokens/layer-step (% of context)", "H2D/token", "D2H/token", "H2D/token @qwen2-7b",
          "D2H/token @qwen2-7b")


CSV_NAME = "capacity_accuracy_long.csv"


def result_rows(runs: Path) -> list[dict]:
    """One record per cell that has run: its settings, n, accuracy with Wilson CI and traffic (the CSV the
    accuracy-vs-traffic figure is drawn from: analysis.figures.accuracy_vs_recall)."""
    from traces.stats import wilson_interval

    rows = []
    for cell in cells("all"):
        result = cell_result(cell, runs)
        if result is None:
            continue
        n, correct, traffic = result
        low, high = wilson_interval(correct, n)
        rows.append({"cell": cell.name, "policy": cell.policy, "hbm_budget": cell.hbm_budget, "scorer": cell.scorer,
                     "evict_ratio": cell.evict_ratio, "recall_budget": cell.recall_budget,
                     "recall_rule": cell.recall_rule if cell.policy == "hierarchy" else None,
                     "n": n, "correct": correct, "accuracy": correct / n, "ci_low": low, "ci_high": high,
                     **{k: traffic[k] for k in ("hbm_frac", "attended_frac", "recalled_frac",
                                                "recalled_tokens_per_layer_step", "h2d_bytes_per_token",
                                                "d2h_bytes_per_token", "h2d_bytes_per_token_ref",
                                                "d2h_bytes_per_token_ref")}})
    return rows


def write_csv(path: Path, runs: Path) -> None:
    from traces.layout import write_csv_atomic

    write_csv_atomic(path, result_rows(runs))  # shards write side by side


def write_markdown(path: Path, runs: Path) -> None:
    rows = [row for cell in cells("all") if (row := cell_row(cell, runs)) is not None]
    missing = len(cells("all")) - len(rows)
    lines = [
        "# Capacity, accuracy and traffic on the long workload (`chains_long`, bundled `micro_long` model)",
        "",
        "Regenerate this table, its CSV and `figures/accuracy_vs_recall_long.png` (accuracy vs recall traffic):",
        "`thoughtkv experiment capacity-long --out docs/ --batch-size 16` (resumes; two processes side by side with `--shard 0/2`",
        f"and `--shard 1/2`: 40 min on this 2-core box; one `thoughtkv trace` run per cell under `{runs}`).",
        "Greedy decoding, final-answer exact match, 95% Wilson",
        "interval, n per row",
        "(rows with different n are not equally precise). HBM budget = share of each sequence's current logical",
        f"length kept in HBM; blocks of {BLOCK_SIZE} tokens, {SINK_TOKENS} sink tokens and a {WINDOW_TOKENS}-token",
        f"recent window always resident; hierarchy placement by {HIERARCHY_SCORER}, recalling per layer and decode",
        "step the top DDR blocks (quest bound: max over KV heads; `quest-per-head` rows: each KV head its own top",
        "blocks) up to the recall budget (a share of the current context, rounded down to whole blocks; under",
        "`quest-per-head` the budget is each KV head's, so the union copied can exceed it: read the traffic columns).",
        "Traffic (traces.stats.traffic_summary, decode steps only): `HBM %` and `attended %`",
        "are mean shares of the context resident / attended (resident + recalled) per layer-step; bytes are per",
        "generated token over all layers, for the micro model (fp32 KV, 3 layers x 3 KV heads x 32) and for the",
        "same access pattern priced at qwen2-7b's bf16 KV (57,344 bytes/token).",
        "",
        headline(runs),
        "",
        *markdown_table(HEADER, (row for row in rows)),
        "",
        f"Cells not run yet: {missing} of {len(cells('all'))}." if missing else "All cells have run.",
        f"Rows with n < {ISSUE_N} are short of the issue's n = {ISSUE_N} per cell: rerun the command with "
        f"`--n-samples {ISSUE_N}` to extend them (each run resumes after its committed problems).",
    ]
    from traces.layout import write_atomic

    write_atomic(path, lambda temp: temp.write_text("\n".join(lines) + "\n"))  # shards write side by side
    write_csv(path.with_name(CSV_NAME), runs)
