"""The capacity–accuracy table of the bundled micro model, through the tracer's own Python API:

    thoughtkv experiment micro-table --out docs/ [--runs build/micro_table] [--n-samples 200] [--cells key|all]

Every cell is a `thoughtkv trace` run (`tracer.run.run_trace`) in its own directory under `--runs`, so an
interrupted table resumes where it stopped; the Markdown is rewritten from whatever runs exist, with n per cell.
Cells: HBM budget (share of each sequence's logical length) × {evict-recency (StreamingLLM: sinks + recent
window), evict-h2o, hierarchy with 0% evicted, hierarchy with 10% evicted}; at 100% every method is the full
cache, so that column is one full-cache run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracer.model_defaults import trace_defaults
from traces.layout import write_atomic

BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.2)
KEY_BUDGET = 0.3
# Settings shared by every cell, shipped with the model (tracer/assets/micro/trace_defaults.json, the one home):
# the micro model's sequences are ~220 tokens, so blocks are small (4, with 4 sinks and a 16-token window); the
# hierarchy recalls 24 blocks of 4 per layer and step (96 tokens: 16 left e=0 at 97.5%, 5/200 lost, at 30% HBM);
# 320 new tokens.
_DEFAULTS = trace_defaults("micro")
BLOCK_SIZE, SINK_TOKENS, WINDOW_TOKENS = (_DEFAULTS[k] for k in ("block_size", "sink_tokens", "window_tokens"))
RECALL_K, MAX_NEW_TOKENS = _DEFAULTS["recall_k"], _DEFAULTS["max_new_tokens"]
FULL_N_SAMPLES = 500  # the full-cache cell doubles as the quality check (>= 95% on 500 held-out problems)


@dataclass(frozen=True)
class Method:
    label: str
    policy: str
    scorer: str
    evict_ratio: float = 0.0
    ddr_dtype: str = "same"  # hierarchy: how DDR stores offloaded blocks (tracer/quant.py)


METHODS = (
    Method("evict-recency", "evict", "recency"),
    Method("evict-h2o", "evict", "h2o"),
    Method("hierarchy e=0", "hierarchy", "h2o", 0.0),
    Method("hierarchy e=0.1", "hierarchy", "h2o", 0.1),
)
# Quantized DDR tier: hierarchy e=0 with int8 / int4 blocks in DDR, at the key budget only.
QUANT_METHODS = (
    Method("hierarchy e=0 int8", "hierarchy", "h2o", 0.0, "int8"),
    Method("hierarchy e=0 int4", "hierarchy", "h2o", 0.0, "int4"),
)


@dataclass(frozen=True)
class Cell:
    method: Method | None  # None: the full cache
    budget: float

    @property
    def name(self) -> str:
        if self.method is None:
            return "full"
        slug = self.method.label.replace(" ", "-").replace("=", "")
        return f"{slug}-b{round(self.budget * 100)}"


def cells(which: str) -> list[Cell]:
    """`key`: full and the four methods at 30%; `all`: the key cells first, then the other budgets."""
    key = [Cell(None, 1.0)] + [Cell(m, KEY_BUDGET) for m in METHODS]
    if which == "key":
        return key
    quant = [Cell(m, KEY_BUDGET) for m in QUANT_METHODS]
    if which == "quant":  # the quantized-DDR rows and the unquantized cell they are compared with
        return [Cell(METHODS[2], KEY_BUDGET), *quant]
    rest = [Cell(m, b) for b in BUDGETS[1:] if b != KEY_BUDGET for m in METHODS]
    return key + rest + quant


def trace_config(cell: Cell, runs: Path, n_samples: int):
    from tracer.run import TraceConfig

    common = dict(model="micro", task="chains", out=str(runs / cell.name), n_samples=n_samples,
                  block_size=BLOCK_SIZE, sink_tokens=SINK_TOKENS, window_tokens=WINDOW_TOKENS,
                  max_new_tokens=MAX_NEW_TOKENS, seed=0)
    if cell.method is None:
        # block_size 1 under the full policy moves nothing; it makes the access table per token.
        return TraceConfig(**{**common, "block_size": 1, "n_samples": max(n_samples, FULL_N_SAMPLES)}, policy="full")
    m = cell.method
    return TraceConfig(**common, policy=m.policy, scorer=m.scorer, hbm_budget=cell.budget,
                       evict_ratio=m.evict_ratio, recall_k=RECALL_K if m.policy == "hierarchy" else 4,
                       ddr_dtype=m.ddr_dtype)


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (Wilson, 1927)."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class CellResult:
    n: int
    correct: int
    mean_generated_tokens: float
    attended_frac: float = math.nan  # traffic (traces.stats.traffic_summary, decode steps): share attended
    h2d_bytes_per_token_ref: float = math.nan  # H2D per generated token priced at qwen2-7b's bf16 KV

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else math.nan

    def describe(self) -> str:
        if self.n == 0:
            return "—"
        from traces.stats import bytes_text

        low, high = wilson_interval(self.correct, self.n)
        text = f"{100 * self.accuracy:.1f} [{100 * low:.0f}–{100 * high:.0f}] (n={self.n})"
        if math.isnan(self.attended_frac):
            return text
        # Issue 14: an accuracy is only meaningful with what it cost on the link.
        return (f"{text}; attends {100 * self.attended_frac:.0f}%, H2D "
                f"{bytes_text(self.h2d_bytes_per_token_ref)}/token at qwen2-7b")


def read_cell(run_dir: Path) -> CellResult:
    from traces.reader import open_run

    if not (run_dir / "run.json").is_file():
        return CellResult(0, 0, math.nan)
    from traces.stats import run_traffic

    trace = open_run(run_dir)
    samples = trace.samples()
    scored = samples[samples["correct"].notna()]
    traffic = run_traffic(trace)
    return CellResult(len(scored), int(scored["correct"].sum()), float(samples["generated_tokens"].mean()),
                      traffic["attended_frac"], traffic["h2d_bytes_per_token_ref"])


def top_share_of_attention(run_dir: Path, fraction: float = 0.2, max_samples: int = 50) -> dict[str, float]:
    """Mean share of one decode step's attention (mean over heads) held by the top `fraction` of the tokens
    attended, per layer and overall, over the first `max_samples` samples of a full-cache run with block size 1."""
    from traces.access_model import top_share
    from traces.reader import open_run

    run = open_run(run_dir)
    shares: dict[int, list[float]] = {}
    for sample_id in run.sample_ids()[:max_samples]:
        access = run.access(sample_id)
        for layer, step, masses in zip(access["layer"], access["step"], access["block_mass"]):
            if step > 0:
                shares.setdefault(int(layer), []).append(float(top_share(np.asarray(masses), fraction)[0]))
    result = {f"layer {layer}": float(np.mean(values)) for layer, values in sorted(shares.items())}
    result["all layers"] = float(np.mean([v for values in shares.values() for v in values]))
    return result


def run_table(
    out_dir: Path, runs: Path, n_samples: int, which: str, progress: bool = True, shard: tuple[int, int] = (0, 1)
) -> Path:
    """Trace the cells (shard (i, n): every n-th cell from the i-th, for n processes side by side)."""
    from tqdm.auto import tqdm

    from tracer.run import run_trace

    runs.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    index, count = shard
    todo = cells(which)[index::count]
    for cell in tqdm(todo, desc="capacity-accuracy cells", unit="cell", disable=not progress):
        run_trace(trace_config(cell, runs, n_samples), progress=progress)
        write_markdown(out_dir / "capacity_accuracy.md", runs)  # after every cell: partial tables are kept
    return out_dir / "capacity_accuracy.md"


def write_markdown(path: Path, runs: Path) -> None:
    full = read_cell(runs / "full")
    header = "| method | " + " | ".join(f"{round(b * 100)}% HBM" for b in BUDGETS) + " |"
    lines = [
        "# Capacity–accuracy table of the bundled micro model (task `chains`, held-out split)",
        "",
        "Regenerate: `thoughtkv experiment micro-table --out docs/ --cells all` (resumes; one `thoughtkv trace` run",
        f"per cell under `{runs}`). Greedy decoding, final-answer exact match; cells are accuracy % with the",
        "95% Wilson interval and the number of problems n, then the cell's traffic (traces.stats, decode steps): the",
        "mean share of the context attended (HBM + recalled) and the H2D bytes per generated token, priced at",
        "qwen2-7b's bf16 KV (57,344 bytes/token). Budget = share of each sequence's current logical",
        f"length allowed in HBM; blocks of {BLOCK_SIZE} tokens, {SINK_TOKENS} sink tokens and a {WINDOW_TOKENS}-token recent window",
        f"always resident; hierarchy recalls the top {RECALL_K} DDR blocks per layer and step (quest bound).",
        f"At 100% every method is the full cache (one run, n = {FULL_N_SAMPLES}: also the model's quality check; the",
        "model, its training and its accuracy status: `tracer/micro/README.md`). Rows `int8`/`int4`: the same hierarchy with the blocks",
        "in DDR stored quantized (per block and KV head scale + zero point, tracer/quant.py); 30% only (`--cells quant`).",
        "",
        header,
        "|---|" + "---|" * len(BUDGETS),
    ]
    lines.append("| full cache | " + full.describe() + " |" + " |" * (len(BUDGETS) - 1))
    for method in (*METHODS, *QUANT_METHODS):  # quantized rows: 30% only (the other cells show —)
        row = [full.describe()]
        for budget in BUDGETS[1:]:
            row.append(read_cell(runs / Cell(method, budget).name).describe())
        lines.append(f"| {method.label} | " + " | ".join(row) + " |")
    lines += effect_lines(full, runs)
    if full.n:
        shares = top_share_of_attention(runs / "full")
        lines += ["", "Share of a decode step's attention (mean over heads) held by the top 20% of attended tokens,",
                  "full cache, first 50 problems: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()) + ".",
                  "", f"Mean generated tokens (full cache): {full.mean_generated_tokens:.0f}."]
    write_atomic(path, lambda temp: temp.write_text("\n".join(lines) + "\n"))  # shards write side by side


def effect_lines(full: CellResult, runs: Path) -> list[str]:
    """The three effects the micro model must show, checked on the 30% column."""
    at = {m.label: read_cell(runs / Cell(m, KEY_BUDGET).name) for m in METHODS}
    if full.n == 0 or any(r.n == 0 for r in at.values()):
        return ["", "Effects at 30% HBM: not all cells have run yet."]
    points = {label: 100 * (r.accuracy - full.accuracy) for label, r in at.items()}
    best_eviction = max(points["evict-recency"], points["evict-h2o"])  # the smaller loss of the two
    e0, e10 = points["hierarchy e=0"], points["hierarchy e=0.1"]

    def verdict(ok: bool) -> str:
        return "yes" if ok else "**no**"

    return [
        "",
        "Effects at 30% HBM (accuracy points relative to the full cache):",
        f"- pure eviction loses ≥ 20 points: recency {points['evict-recency']:+.1f}, H2O {points['evict-h2o']:+.1f}"
        f" — {verdict(best_eviction <= -20)}",
        f"- hierarchy with 0% evicted is within 1 point of full: {e0:+.1f} — {verdict(abs(e0) <= 1)}",
        f"- hierarchy with 10% evicted sits in between: {e10:+.1f} — {verdict(best_eviction <= e10 <= e0)}",
    ]
