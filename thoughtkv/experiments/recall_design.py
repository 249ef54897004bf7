"""`thoughtkv experiment recall-design --out docs/`: the recall design space on the long workload, two tables and one figure.

    thoughtkv experiment recall-design --out docs/ [--runs build/recall_design] [--work build/recall_design_cells]
                            [--n-samples 200] [--figure-only] [--agreement] [--served-point]

Which blocks a hierarchy recalls, against the ceiling, with reuse, with speculation and with prefetch. Cells
(`cells()`): HBM 30% and 50% x recall budget <= 5/10/20% of the context per layer-step x recall rule quest,
quest-per-head, score (the scorer's scores from earlier steps), prev-layer and prev-step (quest's bound under a
query speculated from the previous layer's input or the previous step) and their per-head forms, and oracle (true
attention mass under the current query: a ceiling), nothing evicted, plus the full cache; bundled `micro_long`
model on `chains_long`, the settings of `tracer.micro.table_long` (capacity-long's). Every cell is one `thoughtkv
trace` run under --runs: a run already there with the cell's policy, task and model shapes and at least
--n-samples committed problems is adopted as it is (e.g. capacity-long's, copied or traced elsewhere), otherwise
it is traced or resumed. Per cell, computed once and cached under --work (keyed by the run's committed samples):

- accuracy [95% Wilson CI], attended and recalled shares of the context (traces.stats.traffic_summary);
- H2D bytes per generated token at qwen2-7b's KV size with no recall buffer and with LRU buffers of
  `BUFFER_SIZES` blocks per layer and sequence (simulator.recall_buffer: replayed from the recorded recalled ids,
  which a buffer does not change), each with the HBM it adds (mean share of the context over decode layer-steps);
- projected ms/token (qwen2-7b's shapes, `OPTIONS`) on `PROFILES` (`latency`): at batch 1 without and with a
  buffer of `LATENCY_BUFFER` blocks, and with it at the batch the served frontier runs (`served_batches`, from
  OUT/capacity_served.csv), each without and, for a rule known before the layer runs
  (traces.policy.recall_is_prefetchable), with layer prefetch.

`--agreement` measures why a speculated query misses (recall_design_agreement.py), `--served-point` serves the best
prefetchable rule with `thoughtkv capacity` (recall_design_served.py). Writes OUT/recall_design_space.md,
OUT/recall_design_space.csv and OUT/figures/recall_design_space.png|pdf.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from thoughtkv.experiments.recall_design_settings import (
    AGREEMENT_N,
    LATENCY_BUFFER,
    SERVED_RECALL,
    best_row,
    served_rows,
    served_run_name,
)
from thoughtkv_base import UserError
from thoughtkv_base.markdown import markdown_table
from thoughtkv_base.options import SHARED, Flag, add_flags

HBM_BUDGETS = (0.3, 0.5)
RECALL_BUDGETS = (0.05, 0.1, 0.2)
RULES = ("quest", "quest-per-head", "score", "prev-layer", "prev-layer-per-head", "prev-step", "prev-step-per-head",
         "oracle")
RULE_LABELS = {"quest": "quest", "quest-per-head": "quest-per-head", "score": "score (prefetchable)",
               "prev-layer": "prev-layer (prefetchable)", "prev-layer-per-head": "prev-layer-per-head (prefetchable)",
               "prev-step": "prev-step (prefetchable)", "prev-step-per-head": "prev-step-per-head (prefetchable)",
               "oracle": "oracle (ceiling)"}
SHORT_NAMES = {"quest-per-head": "qph", "prev-layer": "pl", "prev-layer-per-head": "plph", "prev-step": "ps",
               "prev-step-per-head": "psph"}  # (run directory names)
BUFFER_SIZES = (16, 32)
PROFILES = ("h100-pcie", "gh200-96gb")
AS_MODEL = "qwen2-7b"
OPTIONS = dict(overhead_mode="cuda-graphs", transfer="dma-batched")  # capacity-served's (docs/capacity_served.md)
N_SAMPLES = 200
TABLE = "recall_design_space"
CACHE_VERSION = 3  # bump when what a cell's cached result holds changes
# The served frontier's batch: the mean concurrency at the knee of this row of docs/capacity_served.csv, per profile
# (a lockstep `--batch` of that many sequences prices a step at the load the frontier runs).


SERVED_TABLE = "capacity_served.csv"


@dataclass(frozen=True)
class Cell:
    policy: str  # full | hierarchy
    hbm_budget: float = 1.0
    recall_budget: float | None = None
    recall_rule: str = "quest"

    @property
    def name(self) -> str:
        if self.policy == "full":
            return "full"
        short = SHORT_NAMES.get(self.recall_rule, self.recall_rule)
        return f"{short}-b{round(self.hbm_budget * 100)}-r{round(self.recall_budget * 100)}"

    def table_long_cell(self):
        from tracer.micro.table_long import HIERARCHY_SCORER
        from tracer.micro.table_long import Cell as LongCell

        if self.policy == "full":
            return LongCell("full")
        return LongCell("hierarchy", self.hbm_budget, HIERARCHY_SCORER, 0.0, self.recall_budget, self.recall_rule)


def cells() -> list[Cell]:
    """The full cache, then per HBM budget and recall budget every rule, in the table's order."""
    return [Cell("full")] + [Cell("hierarchy", budget, recall, rule) for budget in HBM_BUDGETS
                             for recall in RECALL_BUDGETS for rule in RULES]


OWN = (
    Flag("--served-point", "also serve the best prefetchable rule (and quest) with `thoughtkv capacity` (tens of "
         "minutes; cached under --work)", None, action="store_true", default=False),
    Flag("--agreement", f"also measure the speculated queries' per-layer agreement ({AGREEMENT_N} problems)", None,
         action="store_true", default=False),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SHARED["out"].use(help="folder for the table, CSV and figures/", default=Path("docs")),
              SHARED["runs"].use(help="one trace run per cell, adopted or resumed", default=Path("build/recall_design")),
              SHARED["work"].use(default=Path("build/recall_design_cells")),
              SHARED["n_samples"].use(help="problems per cell", default=N_SAMPLES),
              SHARED["batch_size"].use(help="samples decoded per step when tracing (the same results)", default=16),
              SHARED["threads"].use(help="torch threads when tracing", default_text="the tracer's"),
              "figure_only", *OWN, SHARED["workers"].use(help="parallel serving cells (--served-point)"))


# -- runs -------------------------------------------------------------------------------------------------------
def _committed(run_dir: Path) -> int:
    from traces.layout import list_parts

    return len(list_parts(run_dir, "samples")) if (run_dir / "run.json").is_file() else 0


def adoptable(config, run_dir: Path, n_samples: int) -> bool:
    """Whether the run in `run_dir` is this cell's, done: the same policy (run.json as the spec writes it), task
    and model shapes (every model field but its id, a path that differs between checkouts), with at least
    `n_samples` committed problems."""
    from traces.manifest import load_manifest

    if _committed(run_dir) < n_samples:
        return False
    manifest = load_manifest(run_dir)
    model = {k: v for k, v in manifest["model"].items() if k != "id"}
    from tracer.micro.table_long import MODEL_DIR

    config_json = json.loads((MODEL_DIR / "config.json").read_text())
    return (json.loads(json.dumps(manifest["policy"])) == json.loads(json.dumps(config.spec.to_manifest()))
            and manifest["task"]["name"] == config.task and model.get("n_layers") == config_json["num_hidden_layers"]
            and model.get("hidden_size") == config_json["hidden_size"])


def trace_cells(runs: Path, n_samples: int, batch_size: int, threads: int | None, log=print) -> None:
    """Trace (or resume) every cell whose run is missing or short; adopt the others as they are."""
    import dataclasses

    from tracer.micro.table_long import trace_config
    from tracer.run import run_trace

    runs.mkdir(parents=True, exist_ok=True)
    for cell in cells():
        config = trace_config(cell.table_long_cell(), runs, n_samples, full_n_samples=n_samples,
                              batch_size=batch_size)
        config = dataclasses.replace(config, out=str(runs / cell.name), threads=threads)
        if adoptable(config, runs / cell.name, n_samples):
            continue
        log(f"recall-design: tracing {cell.name} ({n_samples} problems)")
        run_trace(config, progress=False)


# -- per cell ---------------------------------------------------------------------------------------------------
def served_batches(out: Path) -> dict[str, int]:
    """Per profile, the batch the served frontier runs: the knee's mean concurrency of capacity-served's hierarchy
    row at 30% HBM and recall ≤ `SERVED_RECALL` in OUT/capacity_served.csv (`thoughtkv experiment capacity-served`),
    rounded."""
    path = out / SERVED_TABLE
    if not path.is_file():
        raise UserError(f"{path}: not found; the latencies at the served batch read it (run `thoughtkv experiment "
                        f"capacity-served --out {out}` first, or give --out the folder that holds it)")
    rows = served_rows(path, SERVED_RECALL)
    missing = [p for p in PROFILES if p not in rows or not rows[p].get("knee_mean_concurrency")]
    if missing:
        raise UserError(f"{path}: no {served_run_name(SERVED_RECALL)} row with a knee_mean_concurrency for "
                        f"{', '.join(missing)}; regenerate it with `thoughtkv experiment capacity-served`")
    return {p: max(1, round(float(rows[p]["knee_mean_concurrency"]))) for p in PROFILES}


def cell_key(run_dir: Path, batches: dict[str, int]) -> str:
    """The cell's cache key: its committed sample parts (names and sizes), what is computed from them and the
    cache version."""
    from traces.layout import list_parts

    parts = sorted((p.name, p.stat().st_size) for p in list_parts(run_dir, "samples").values())
    steps = sorted((p.name, p.stat().st_size) for p in list_parts(run_dir, "steps").values())
    text = json.dumps([CACHE_VERSION, parts, steps, BUFFER_SIZES, LATENCY_BUFFER, PROFILES, AS_MODEL, OPTIONS,
                       sorted(batches.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def buffer_traffic(trace, steps) -> dict:
    """Per buffer size: H2D bytes per generated token (the run's own KV and at qwen2-7b's) and the HBM the buffer
    adds (mean share of the context over decode layer-steps), replayed from the recorded recalled ids."""
    import numpy as np

    from simulator.recall_buffer import replay_buffer
    from traces.stats import reference_kv_bytes_per_token

    model = trace.manifest["model"]
    block = int(trace.manifest["policy"]["block_size"])
    token_bytes = int(model["kv_bytes_per_token"]) // int(model["n_layers"])
    recalled_total = int(steps["recalled_tokens"].sum()) // block
    block_bytes = int(steps["bytes_h2d"].sum()) // recalled_total if recalled_total else block * token_bytes
    scale = reference_kv_bytes_per_token() / int(model["kv_bytes_per_token"])
    out = {}
    for capacity in (0, *BUFFER_SIZES):
        h2d = extra = rows = 0.0
        steps_decoded = 0
        for _, sample in steps.groupby("sample_id"):
            played = replay_buffer(sample, capacity, block_bytes, block * token_bytes)
            frame = sample.sort_values(["step", "layer"])
            logical = frame.pivot(index="step", columns="layer", values="logical_len").to_numpy(dtype=float)
            h2d += float(played.bytes_h2d[1:].sum())
            added = (played.recall_hbm_bytes - played.recalled_blocks * block * token_bytes) / token_bytes
            extra += float((added[1:] / logical[1:]).sum())
            rows += logical[1:].size
            steps_decoded += logical.shape[0] - 1
        out[str(capacity)] = {"h2d_bytes_per_token": h2d / max(steps_decoded, 1),
                              "h2d_bytes_per_token_ref": h2d * scale / max(steps_decoded, 1),
                              "hbm_added_frac": extra / rows if rows else float(np.nan)}
    return out


def latency_key(profile: str, batch: str, buffer: int, overlap: str) -> str:
    """`batch`: "1" or "served"; `buffer`: the recall buffer's blocks (0: none)."""
    return f"{profile}/B{batch}/buffer{buffer}/{overlap}"


def latency(run_dir: Path, rule: str | None, batches: dict[str, int]) -> dict:
    """Projected ms/token (mean over samples, qwen2-7b's shapes, `OPTIONS`) per profile: at batch 1 with no buffer
    and with a buffer of `LATENCY_BUFFER` blocks, and at the served batch (a lockstep batch of `batches[profile]`)
    with the buffer; each without and (a prefetchable rule) with layer prefetch (`latency_key`: None where refused)."""
    from simulator.options import Projection, SimOptions
    from simulator.simulate import simulate_run
    from traces.policy import recall_is_prefetchable

    out = {}
    for profile in PROFILES:
        for batch, buffer in (("1", 0), ("1", LATENCY_BUFFER), ("served", LATENCY_BUFFER)):
            for overlap in ("none", "layer-prefetch"):
                key = latency_key(profile, batch, buffer, overlap)
                if overlap == "layer-prefetch" and (rule is None or not recall_is_prefetchable(rule)):
                    out[key] = None
                    continue
                options = SimOptions(overlap=overlap, batch=1 if batch == "1" else batches[profile],
                                     recall_buffer_blocks=buffer if rule is not None else None, **OPTIONS)
                result = simulate_run(run_dir, profile, options, projection=Projection(as_model=AS_MODEL))
                out[key] = float(result.samples["ms_per_token"].mean())
    return out


def cell_result(cell: Cell, runs: Path, work: Path, batches: dict[str, int]) -> dict | None:
    """A cell's results (cached under `work` by `cell_key`); None when its run has no committed problem."""
    from traces.reader import open_run
    from traces.stats import TRAFFIC_COLUMNS, traffic_summary, wilson_interval

    run_dir = runs / cell.name
    if _committed(run_dir) == 0:
        return None
    key = cell_key(run_dir, batches)
    cached = work / f"{cell.name}.json"
    if cached.is_file():
        stored = json.loads(cached.read_text())
        if stored.get("key") == key:
            return stored["result"]
    trace = open_run(run_dir)
    scored = trace.samples()["correct"].dropna()
    n, correct = len(scored), int(scored.sum())
    low, high = wilson_interval(correct, n)
    columns = sorted({*TRAFFIC_COLUMNS, "layer", "recalled_block_ids"})
    steps = trace.steps(columns=columns)
    traffic = traffic_summary(steps, int(trace.manifest["model"]["kv_bytes_per_token"]))
    result = {"cell": cell.name, "policy": cell.policy, "hbm_budget": cell.hbm_budget,
              "recall_budget": cell.recall_budget, "recall_rule": cell.recall_rule if cell.policy != "full" else None,
              "n": n, "correct": correct, "accuracy": correct / n if n else float("nan"), "ci_low": low,
              "ci_high": high, "attended_frac": traffic["attended_frac"], "recalled_frac": traffic["recalled_frac"],
              "hbm_frac": traffic["hbm_frac"], "buffers": buffer_traffic(trace, steps),
              "served_batch": batches,
              "ms_per_token": latency(run_dir, cell.recall_rule if cell.policy != "full" else None, batches)}
    work.mkdir(parents=True, exist_ok=True)
    from traces.layout import write_atomic

    write_atomic(cached, lambda temp: temp.write_text(json.dumps({"key": key, "result": result}, indent=1)))
    return result


def flat_rows(results: list[dict]) -> list[dict]:
    """One CSV record per cell: the nested buffer and latency results as columns."""
    rows = []
    for r in results:
        row = {k: v for k, v in r.items() if k not in ("buffers", "ms_per_token", "served_batch")}
        for profile, batch in r["served_batch"].items():
            row[f"served_batch_{profile.replace('-', '_')}"] = batch
        for capacity, values in r["buffers"].items():
            for name, value in values.items():
                row[f"buffer{capacity}_{name}"] = value
        for key, value in r["ms_per_token"].items():
            row[f"ms_per_token_{key.replace('/', '_').replace('-', '_')}"] = value
        rows.append(row)
    return rows


# -- table --------------------------------------------------------------------------------------------------------
def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _accuracy(r: dict) -> str:
    return f"{100 * r['accuracy']:.1f} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]"


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


TRAFFIC_HEADER = ("HBM", "recall ≤", "rule", "accuracy % [95% CI]", "n", "attended %", "recalled %",
                  f"H2D/token @{AS_MODEL}, no buffer", *(f"LRU {n} blocks (+HBM)" for n in BUFFER_SIZES))


def latency_header(batches: dict[str, int]) -> tuple[str, ...]:
    return ("HBM", "recall ≤", "rule", *(f"{p} {what}: none / prefetch" for p in PROFILES for what in (
        "B=1", f"B=1 LRU {LATENCY_BUFFER}", f"B={batches[p]} LRU {LATENCY_BUFFER}")))


def _where(r: dict) -> list[str]:
    label = "full cache" if r["policy"] == "full" else RULE_LABELS[r["recall_rule"]]
    return ["100%" if r["policy"] == "full" else f"{r['hbm_budget']:.0%}",
            "—" if r["recall_budget"] is None else f"{r['recall_budget']:.0%}", label]


def traffic_row(r: dict) -> list[str]:
    from traces.stats import bytes_text

    buffers = r["buffers"]
    return [*_where(r), _accuracy(r), str(r["n"]), _pct(r["attended_frac"]), _pct(r["recalled_frac"]),
            bytes_text(buffers["0"]["h2d_bytes_per_token_ref"]),
            *(f"{bytes_text(buffers[str(n)]['h2d_bytes_per_token_ref'])} (+{_pct(buffers[str(n)]['hbm_added_frac'])})"
              for n in BUFFER_SIZES)]


def latency_row(r: dict) -> list[str]:
    ms = r["ms_per_token"]
    return [*_where(r), *(f"{_ms(ms[latency_key(p, b, n, 'none')])} / {_ms(ms[latency_key(p, b, n, 'layer-prefetch')])}"
                          for p in PROFILES for b, n in (("1", 0), ("1", LATENCY_BUFFER), ("served", LATENCY_BUFFER)))]


def headline(results: list[dict], budget: float = 0.3) -> str:
    """The table's answer, at HBM `budget` and equal traffic (the same recall budget: the same blocks per step per
    head): the best prefetchable rule's accuracy against quest-per-head's and the oracle's, and its projected
    ms/token at batch 1 with the buffer (`LATENCY_BUFFER`) and layer prefetch on h100-pcie against quest's (which
    cannot prefetch) with the same buffer; then whether the goal is reached (within 10 points of quest-per-head,
    faster per token) and by how much it is missed."""
    from traces.policy import recall_is_prefetchable

    at = {(r["recall_rule"], r["recall_budget"]): r for r in results
          if r["policy"] == "hierarchy" and r["hbm_budget"] == budget}
    prefetched = [r for (rule, _), r in at.items() if recall_is_prefetchable(rule)]
    if not prefetched:
        return "In one sentence: not yet — no prefetchable rule's cell has run."
    best = best_row(prefetched)
    recall = best["recall_budget"]
    per_head, oracle, quest = (at.get((rule, recall)) for rule in ("quest-per-head", "oracle", "quest"))
    if per_head is None or oracle is None or quest is None:
        return f"In one sentence: not yet — the quest, quest-per-head or oracle cell at recall ≤ {recall:.0%} has not run."

    def ms(r: dict, overlap: str, batch: str = "1") -> float | None:
        return r["ms_per_token"][latency_key("h100-pcie", batch, LATENCY_BUFFER, overlap)]

    fast, quest_ms, per_head_ms = ms(best, "layer-prefetch"), ms(quest, "none"), ms(per_head, "none")
    text = (f"In one sentence: at {budget:.0%} HBM and equal traffic (recall ≤ {recall:.0%} of the context per "
            f"layer-step), the best prefetchable rule, {best['recall_rule']}, keeps {_accuracy(best)}% (n = "
            f"{best['n']}) against quest-per-head's {_accuracy(per_head)}% and the oracle's {_accuracy(oracle)}%, and "
            f"with an LRU of {LATENCY_BUFFER} blocks and layer prefetch it projects {fast:.2f} ms/token on h100-pcie "
            f"(batch 1, {AS_MODEL}) against quest's {quest_ms:.2f} with the same buffer (quest-per-head's "
            f"{per_head_ms:.2f})")
    served = best.get("served_batch", {}).get("h100-pcie")
    if served is not None and ms(best, "layer-prefetch", "served") is not None:
        text += (f", and at the served frontier's batch of {served} {ms(best, 'layer-prefetch', 'served'):.2f} "
                 f"against quest's {ms(quest, 'none', 'served'):.2f} (quest-per-head's "
                 f"{ms(per_head, 'none', 'served'):.2f})")
    text += "."
    # Judged where quest-per-head keeps the most at this HBM (its operating point): at a recall budget where it
    # keeps almost nothing, being within 10 points of it says nothing.
    per_head_rows = [r for (rule, _), r in at.items() if rule == "quest-per-head"]
    target = max(per_head_rows, key=lambda r: r["accuracy"])
    candidates = [r for r in prefetched if r["recall_budget"] == target["recall_budget"]]
    if not candidates:
        return text + (f" Goal: not judged yet — no prefetchable rule at quest-per-head's best recall budget "
                       f"(≤ {target['recall_budget']:.0%}) has run.")
    closest = max(candidates, key=lambda r: r["accuracy"])
    gap = target["accuracy"] - closest["accuracy"]
    reached = gap <= 0.10 and ms(closest, "layer-prefetch") < ms(target, "none")
    text += (f" Goal (a prefetchable rule within 10 points of quest-per-head at equal traffic, faster per token; "
             f"judged at quest-per-head's best recall budget, ≤ {target['recall_budget']:.0%}): "
             f"{'reached' if reached else 'not reached'} — the closest, {closest['recall_rule']} at recall ≤ "
             f"{closest['recall_budget']:.0%}, is {100 * abs(gap):.1f} points "
             f"{'below' if gap >= 0 else 'above'} quest-per-head"
             + ("." if reached else f", {100 * max(gap - 0.10, 0):.1f} points short of the goal."))
    return text


REAL_MODEL_RULES = ("quest", "quest-per-head", "prev-layer", "prev-step", "oracle")


def real_model_lines(real_model_csv: Path) -> list[str]:
    """The same rules on the real LM (smollm2-135m), graded by fidelity to its full cache: the rows of
    docs/real_model.csv (`thoughtkv experiment real-model`) at 30% HBM, recall ≤ 10%, when it has them."""
    import csv

    if not real_model_csv.is_file():
        return []
    rows = [r for r in csv.DictReader(real_model_csv.open()) if r["policy"] == "hierarchy"
            and float(r["hbm_budget"]) == 0.3 and r["recall_budget"] and float(r["recall_budget"]) == 0.1
            and r["recall_rule"] in REAL_MODEL_RULES]
    if not rows:
        return []
    from traces.policy import recall_is_prefetchable
    from traces.stats import bytes_text

    rows.sort(key=lambda r: REAL_MODEL_RULES.index(r["recall_rule"]))
    lines = ["On the real LM (smollm2-135m, n per row, 256 new tokens; docs/real_model.md), graded by fidelity to "
             "its own full cache since its accuracy is at the floor, at 30% HBM and recall ≤ 10%: teacher-forced "
             "KL(full ‖ policy) per token and top-1 agreement, 95% bootstrap CIs.", "",
             ]
    table = []
    for r in rows:
        f = {k: float(r[k]) for k in ("kl", "kl_low", "kl_high", "top1", "top1_low", "top1_high", "attended_frac",
                                      "recalled_frac", "h2d_bytes_per_token_ref")}
        prefetch = " (prefetchable)" if recall_is_prefetchable(r["recall_rule"]) else ""
        table.append([f"{r['recall_rule']}{prefetch}", r["n"], f"{f['kl']:.3f} [{f['kl_low']:.3f}, {f['kl_high']:.3f}]",
                      f"{100 * f['top1']:.1f} [{100 * f['top1_low']:.1f}, {100 * f['top1_high']:.1f}]",
                      f"{100 * f['attended_frac']:.1f}", f"{100 * f['recalled_frac']:.1f}",
                      bytes_text(f["h2d_bytes_per_token_ref"])])
    header = ("rule", "n", "KL nats/token [95% CI]", "top-1 % [95% CI]", "attended %", "recalled %",
              "H2D/token @qwen2-7b")
    return [*lines, *markdown_table(header, table), ""]


def write_table(out: Path, runs: Path, work: Path, log=print) -> list[dict]:
    from thoughtkv.experiments import recall_design_agreement, recall_design_served
    from tracer.micro.table_long import BLOCK_SIZE, SINK_TOKENS, WINDOW_TOKENS
    from traces.layout import write_atomic, write_csv_atomic

    batches = served_batches(out)
    results = []
    for cell in cells():
        result = cell_result(cell, runs, work, batches)
        if result is not None:
            results.append(result)
    missing = [c.name for c in cells() if c.name not in {r["cell"] for r in results}]
    short = [r["cell"] for r in results if r["n"] < N_SAMPLES]
    agreement_file = work / "speculation_agreement.json"
    agreement = json.loads(agreement_file.read_text()) if agreement_file.is_file() else None
    served = json.loads(served_file.read_text()) if (served_file := work / "served_point.json").is_file() else None
    batch_text = ", ".join(f"{batches[p]} on {p}" for p in PROFILES)
    lines = [
        "# The recall design space: ceiling, reuse, speculation and prefetch (`chains_long`, bundled `micro_long` "
        "model)",
        "",
        "Regenerate: `thoughtkv experiment recall-design --out docs/ [--runs DIR] [--work DIR]` (resumable: one `thoughtkv "
        "trace` run per cell under --runs, default `build/recall_design`, a run already there with the cell's "
        "settings and enough problems adopted as it is; each cell's results cached under --work; ~2-4 min of one "
        "core per traced cell at `--batch-size 16`, ~1-2 min per cell for its replays and projections; "
        "`--served-point` adds the served frontier point, `--agreement` the per-layer agreement). Greedy "
        "decoding, final-answer exact match, 95% Wilson interval, n per row. Hierarchy, nothing evicted, placement "
        f"by h2o; blocks of {BLOCK_SIZE} tokens, {SINK_TOKENS} sink tokens and a {WINDOW_TOKENS}-token window "
        "always resident; HBM = share of each sequence's logical length kept resident; `recall ≤` = the recall "
        "budget per layer and decode step, a share of the current context rounded down to whole blocks (the "
        "per-head rules: each KV head's budget, the union copied; read `recalled %`).",
        "",
        "Rules: **quest** (Tang et al., 2024: the key-bound of each block under the current query, max over heads); "
        "**quest-per-head** (each KV head its own top blocks); **score** (the top DDR blocks by h2o's scores of "
        "earlier steps); **prev-layer** (quest's bound under layer i's query made from the hidden state entering "
        "layer i-1 with layer i's input norm, q_proj and RoPE at the current position, as InfiniGen (Lee et al., "
        "OSDI '24) speculates; layer 0, which has no layer before it, takes its previous step's query); "
        "**prev-step** (quest's bound under the layer's query of the previous decode step); the `-per-head` forms "
        "pick per KV head as quest-per-head does; **oracle** (the DDR blocks with the largest true attention mass "
        "under the current query, from an exact softmax over every resident and DDR key: a *ceiling* that costs a "
        "full attention per layer, not a rule a system could run). *prefetchable*: decided before the layer runs "
        "(nothing of its current query is read: tests/test_recall_design.py perturbs it), so its copy can overlap "
        "the previous layer's (or, at layer 0, the previous step's LM head's) compute.",
        "",
        f"Traffic (decode steps only): `attended %` and `recalled %` are mean shares of the context per layer-step; "
        f"H2D bytes per generated token over all layers, for this access pattern priced at {AS_MODEL}'s bf16 KV "
        "(57,344 bytes/token). `LRU N blocks`: the same recalls with a per-(sequence, layer) LRU buffer of N recalled "
        "blocks kept in HBM (a block still held costs no copy), replayed from the recorded recalled ids "
        "(simulator/recall_buffer.py; attention reads the same blocks, so accuracy is the row's); `+HBM` is what "
        "the buffer adds to HBM beyond the step's own recall (the blocks it holds, at most N, growing page by page), "
        "as a mean share of the context: on this workload's short contexts (~100-550 tokens) N blocks of "
        f"{BLOCK_SIZE} tokens are a large share, so read the bytes saved against the HBM spent.",
        "",
        headline(results),
        "",
        *markdown_table(TRAFFIC_HEADER, (traffic_row(r) for r in results)),
        "",
        "Reading the score rows: score ranks the DDR blocks by h2o's accumulated attention, which a DDR block gains "
        "only while it is recalled and attended, so it recalls the same blocks step after step (an LRU of 16 blocks "
        "serves almost every recall) and cannot follow a look-up that moves. Being known before the layer runs is "
        "what prefetch needs, not what accuracy needs; the speculative rules follow the look-up only as far as the "
        "query they are made under does (the agreement below).",
        "",
        f"Projected ms/token (mean over the samples) at {AS_MODEL}'s shapes (`thoughtkv simulate --as-model "
        f"{AS_MODEL} --overhead-mode cuda-graphs --transfer dma-batched`): at batch 1, with no buffer and with "
        f"`--recall-buffer-blocks {LATENCY_BUFFER}` (hits cost no copy; the buffer's HBM is counted), and at the "
        f"batch the served frontier runs (`--batch`: the knee's mean concurrency of docs/capacity_served.md's "
        f"hierarchy 30% HBM, recall ≤ {SERVED_RECALL:.0%} row, {batch_text}) with the buffer; each without / with `--overlap layer-prefetch` (`—` "
        "where the rule needs the layer's own query: prefetch is refused).",
        "",
        *markdown_table(latency_header(batches), (latency_row(r) for r in results)),
        "",
        *recall_design_served.served_point_lines(served, out / SERVED_TABLE),
        *([""] if served else []),
        *recall_design_agreement.agreement_lines(agreement),
        *([""] if agreement else []),
        *real_model_lines(out / "real_model.csv"),
        f"Cells not run yet: {', '.join(missing)}." if missing else "All cells have run.",
    ]
    if short:
        lines.append(f"Rows with n < {N_SAMPLES}: {', '.join(short)} (rerun with `--n-samples {N_SAMPLES}` to extend).")
    write_atomic(out / f"{TABLE}.md", lambda temp: temp.write_text("\n".join(lines) + "\n"))
    write_csv_atomic(out / f"{TABLE}.csv", flat_rows(results))
    return results


def draw(out: Path) -> Path:
    import pandas as pd

    from analysis.figures import recall_design_space
    from analysis.style import save_figure

    frame = pd.read_csv(out / f"{TABLE}.csv")
    if frame.empty or not (frame["policy"] == "hierarchy").any():
        raise UserError(f"{out / TABLE}.csv: no hierarchy cell has run yet; run `thoughtkv experiment recall-design` first")
    return save_figure(recall_design_space(frame, BUFFER_SIZES[0], AS_MODEL), out / "figures", TABLE)[0]


def run(args: argparse.Namespace) -> int:
    import sys

    from thoughtkv.experiments import recall_design_agreement, recall_design_served

    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if not args.figure_only:
        trace_cells(args.runs, args.n_samples, args.batch_size, args.threads, log)
    if args.agreement and not (args.work / "speculation_agreement.json").is_file():
        recall_design_agreement.speculation_agreement(args.work, log=log)
    results = write_table(args.out, args.runs, args.work, log)
    if args.served_point and recall_design_served.served_point(results, args.runs, args.work, args.workers, log) is not None:
        results = write_table(args.out, args.runs, args.work, log)
    print(headline(results))
    print(f"wrote {args.out / (TABLE + '.md')}, {draw(args.out)}")
    return 0
