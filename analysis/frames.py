"""Tidy DataFrames behind each figure, from two inputs: a table of trace runs and the simulator's results.

`runs` has one row per trace run (built by `analysis.load.run_table`): run_dir, run_label, model, task,
policy, hbm_budget, evict_ratio, block_size, scorer, recall_k, n_samples, n_scored, n_correct, accuracy,
ci_low, ci_high, evicted_frac. `sim` has the columns of `thoughtkv simulate` results files (one row per
run x profile x configuration x sample). Everything here is pure: DataFrames in, DataFrames out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import stats
from simulator.columns import CAPACITY_COLUMNS, OPTION_COLUMNS, REPLAY_KINDS, SUMMARY_SAMPLE_ID, TIME_PARTS

FULL_LABEL = "full cache"
EVICTION_POLICIES = {"evict", "eviction", "pure_eviction", "pure-eviction"}
FULL_POLICIES = {"full", "dense", "none"}
# The policy knobs that define a method; two rows with equal knobs are the same method.
POLICY_KEYS = ["model", "policy", "hbm_budget", "evict_ratio", "block_size", "scorer", "recall_k"]


# -- methods ---------------------------------------------------------------------------------------------


def is_full_cache(policy: str) -> bool:
    """The full-cache reference: the `full` policy (a budget of 1.0 under another policy is still that policy)."""
    return str(policy) in FULL_POLICIES


def method_label(policy: str, evict_ratio: float, scorer: str | None, show_scorer: bool) -> str:
    """The name of a method in legends and tables: the policy family without its HBM budget (that is the x axis)."""
    if is_full_cache(policy):
        return FULL_LABEL
    if str(policy) in EVICTION_POLICIES:
        label = "pure eviction"
    elif pd.notna(evict_ratio):
        label = f"{policy}, evict {float(evict_ratio):.0%}"
    else:
        label = str(policy)
    if show_scorer and scorer is not None and pd.notna(scorer):
        label += f" [{scorer}]"
    return label


def recall_label(recall_k, recall_budget, recall_rule) -> str:
    """How a hierarchy recalls, for a legend: 'recall <= 10%' (a share of the context) or 'recall 4 blocks', with
    the rule when it is not the default max-over-heads bound."""
    if recall_budget is not None and pd.notna(recall_budget):  # a share of the context, or tokens when > 1
        budget = float(recall_budget)
        text = f"recall ≤ {budget:.0%}" if budget <= 1 else f"recall ≤ {budget:g} tokens"
    elif recall_k is not None and pd.notna(recall_k):
        text = f"recall {int(recall_k)} blocks"
    else:
        text = "recall"
    if isinstance(recall_rule, str) and recall_rule not in ("quest", ""):
        text += f" {recall_rule}"
    return text


def add_method(frame: pd.DataFrame, show_scorer: bool | None = None) -> pd.DataFrame:
    """Copy of `frame` with `method` and `is_full` columns; scorers are named only when there are several, and a
    hierarchy's recall (k, budget, rule) only when its runs differ in it: runs that recalled differently are
    different methods (different traffic), never pooled into one line."""
    frame = frame.copy()
    frame["is_full"] = [is_full_cache(p) for p in frame["policy"]]
    scorer = frame["scorer"] if "scorer" in frame else pd.Series(None, index=frame.index, dtype=object)
    if show_scorer is None:  # the full cache has no scorer; it does not count
        show_scorer = scorer[~frame["is_full"]].dropna().nunique() > 1
    frame["method"] = [
        method_label(p, r, s, show_scorer)
        for p, r, s in zip(frame["policy"], frame["evict_ratio"], scorer)
    ]
    missing = pd.Series(None, index=frame.index, dtype=object)
    recalls = [recall_label(k, b, rule) for k, b, rule in zip(
        *(frame[c] if c in frame else missing for c in ("recall_k", "recall_budget", "recall_rule")))]
    recalling = (frame["policy"] == "hierarchy").to_numpy()
    if len({r for r, h in zip(recalls, recalling) if h}) > 1:
        frame["method"] = [f"{m}, {r}" if h else m for m, r, h in zip(frame["method"], recalls, recalling)]
    if "model" in frame and frame["model"].nunique() > 1:  # never pool two models into one line
        frame["method"] = frame["model"].astype(str) + ": " + frame["method"]
    return frame


def budget_text(budget: float) -> str:
    """An HBM budget as labels write it: '30%' (a share of the context) or '512 tokens' (a count)."""
    budget = float(budget)
    return f"{budget:.0%}" if budget <= 1 else f"{budget:g} tokens"


def with_budget(method: str, budget: float, is_full: bool) -> str:
    """A method at one HBM budget, where no axis shows the budget (tables, serving figures): 'pure eviction @ 30%';
    the full cache alone ('full cache': its budget is the whole context)."""
    return method if is_full else f"{method} @ {budget_text(budget)}"


def method_order(frame: pd.DataFrame) -> list[str]:
    """Methods in a stable legend order: full cache, pure eviction, then the rest by name."""

    def rank(method: str) -> tuple[int, str]:
        bare = method.split(": ", 1)[-1]  # without a model prefix
        return (0 if bare == FULL_LABEL else 1 if bare.startswith("pure eviction") else 2, method)

    return sorted(frame["method"].dropna().unique(), key=rank)


# -- 1. importance long tail -------------------------------------------------------------------------------


def importance_by_layer_matrix(tokens: pd.DataFrame) -> dict[str, np.ndarray]:
    """sample_id -> [layer, position] importance matrix, rows of `tokens` ordered by position."""
    matrices = {}
    for sample_id, group in tokens.sort_values("position").groupby("sample_id", sort=False):
        matrices[sample_id] = np.vstack([np.asarray(v, dtype=np.float64) for v in group["importance_by_layer"]]).T
    return matrices


def importance_cdf(tokens: pd.DataFrame, grid_points: int = 101) -> pd.DataFrame:
    """Cumulative attention mass vs token rank, per layer, averaged over samples.

    Columns: layer, rank_frac (share of tokens, heaviest first), cum_share (share of the mass they hold).
    """
    rank_grid = np.linspace(0.0, 1.0, grid_points)
    rows = []
    for matrix in importance_by_layer_matrix(tokens).values():
        for layer, mass in enumerate(matrix):
            rows.append(pd.DataFrame({"layer": layer, "rank_frac": rank_grid, "cum_share": stats.mass_cdf(mass, rank_grid)}))
    if not rows:
        return pd.DataFrame(columns=["layer", "rank_frac", "cum_share"])
    per_sample = pd.concat(rows, ignore_index=True)
    return per_sample.groupby(["layer", "rank_frac"], as_index=False)["cum_share"].mean()


def top_share_by_layer(tokens: pd.DataFrame, top_frac: float = 0.2) -> pd.DataFrame:
    """Share of a layer's attention mass held by its top `top_frac` tokens; mean and range over samples."""
    rows = [
        {"sample_id": sample_id, "layer": layer, "top_share": stats.top_share(mass, top_frac)}
        for sample_id, matrix in importance_by_layer_matrix(tokens).items()
        for layer, mass in enumerate(matrix)
    ]
    per_sample = pd.DataFrame(rows, columns=["sample_id", "layer", "top_share"])
    return (
        per_sample.groupby("layer")["top_share"]
        .agg(top_share="mean", top_share_min="min", top_share_max="max", n_samples="count")
        .reset_index()
    )


def block_mass_heatmap(access: pd.DataFrame, sample_id: str) -> np.ndarray:
    """[decode step, block] attention mass of one sample, mean over layers; NaN where a block did not exist yet.

    `access` rows are (sample_id, step, layer, block_mass) with block_mass decoded to float arrays.
    The prefill (step 0) is left out: its mass is that of the last prompt query, not of a decode step.
    """
    rows = access[(access["sample_id"] == sample_id) & (access["step"] > 0)]
    if rows.empty:
        return np.zeros((0, 0))
    steps = np.sort(rows["step"].unique())
    n_blocks = max(len(m) for m in rows["block_mass"])
    heatmap = np.full((len(steps), n_blocks), np.nan)
    step_index = {step: i for i, step in enumerate(steps)}
    for step, group in rows.groupby("step"):
        masses = [np.asarray(m, dtype=np.float64) for m in group["block_mass"]]
        width = max(len(m) for m in masses)
        padded = np.vstack([np.pad(m, (0, width - len(m))) for m in masses])
        heatmap[step_index[step], :width] = padded.mean(axis=0)
    return heatmap


# -- 2. capacity-accuracy ---------------------------------------------------------------------------------


def accuracy_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Scored runs with method labels, sorted for plotting; accuracy with its 95% Wilson CI and n."""
    scored = runs[runs["n_scored"] > 0]
    if scored.empty:
        return scored.assign(method=pd.Series(dtype=object), is_full=pd.Series(dtype=bool))
    return add_method(scored).sort_values(["method", "hbm_budget"]).reset_index(drop=True)


def pooled_accuracy(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, hbm_budget): runs of the same method and budget (e.g. two seeds) pooled."""
    grouped = frame.groupby(["method", "hbm_budget", "is_full"], as_index=False)[["n_correct", "n_scored"]].sum()
    intervals = [stats.wilson_interval(int(k), int(n)) for k, n in zip(grouped["n_correct"], grouped["n_scored"])]
    grouped["accuracy"] = grouped["n_correct"] / grouped["n_scored"]
    grouped["ci_low"] = [low for low, _ in intervals]
    grouped["ci_high"] = [high for _, high in intervals]
    return grouped


# -- simulator results -------------------------------------------------------------------------------------


def headline_config(sim: pd.DataFrame) -> dict:
    """The (overlap, async_offload, batch) the latency figures show: batch 1 if simulated, else the most common."""
    traced = sim[sim["result_kind"].isin(REPLAY_KINDS)] if "result_kind" in sim else sim
    if traced.empty:
        return {}
    configs = traced[["overlap", "async_offload", "batch"]].astype(str).value_counts()
    # Most rows first; ties go to the simulator's defaults (no overlap, async offload), so the choice is stable.
    ranked = sorted(configs.index, key=lambda c: (-configs[c], c[0] != "none", c[1] != "True", c))
    batch_one = [c for c in ranked if c[2] == "1"]
    overlap, async_offload, batch = batch_one[0] if batch_one else ranked[0]
    return {"overlap": overlap, "async_offload": async_offload, "batch": batch}


def _select_config(sim: pd.DataFrame, config: dict) -> pd.DataFrame:
    mask = pd.Series(True, index=sim.index)
    for column, value in config.items():
        mask &= sim[column].astype(str) == value
    return sim[mask]


AGGREGATE_SAMPLE_IDS = {SUMMARY_SAMPLE_ID}  # the simulator's whole-run summary rows


def _per_sample_rows(sim: pd.DataFrame) -> pd.DataFrame:
    """Drop whole-run summary rows when per-sample rows exist, so nothing is counted twice."""
    if "sample_id" not in sim:
        return sim
    has_sample = sim["sample_id"].notna() & ~sim["sample_id"].isin(AGGREGATE_SAMPLE_IDS)
    return sim[has_sample] if has_sample.any() else sim


def latency_frame(sim: pd.DataFrame, runs: pd.DataFrame | None = None, config: dict | None = None) -> pd.DataFrame:
    """One row per (traced run, profile) at the headline configuration: per-token times and capacities.

    Per-token times are step-weighted means over samples (= total time / total steps), the breakdown
    columns (compute_ms, hbm_ms, link_stall_ms per token) likewise. `accuracy` comes from `runs`, joined on
    run_dir, when given.
    """
    traced = sim[sim["result_kind"].isin(REPLAY_KINDS)] if "result_kind" in sim else sim
    config = headline_config(traced) if config is None else config
    rows = _per_sample_rows(_select_config(traced, config))
    if rows.empty:
        return pd.DataFrame()
    keys = ["run_dir", "profile"]
    constant = [
        c
        for c in [*POLICY_KEYS, "run_label", *OPTION_COLUMNS, *CAPACITY_COLUMNS]
        if c in rows and c not in keys
    ]
    out = []
    for (run_dir, profile), group in rows.groupby(keys, sort=False, dropna=False):
        steps = group["steps"].to_numpy(dtype=np.float64)
        total_steps = steps.sum()
        record = {"run_dir": run_dir, "profile": profile, "n_samples": len(group), "steps": total_steps}
        record.update({c: group[c].iloc[0] for c in constant})
        record["ms_per_token"] = _ms_per_token(group)
        record["tokens_per_s"] = float(record.get("batch", 1) or 1) * 1000.0 / record["ms_per_token"]
        # Mean time per step (prefill included) split into its parts; the parts add up to total_s.
        for part in BREAKDOWN_PARTS:
            record[f"{part}_ms"] = 1000.0 * group[f"{part}_s"].sum() / total_steps if f"{part}_s" in group else 0.0
        record["step_ms"] = 1000.0 * group["total_s"].sum() / total_steps
        record["link_stall_frac"] = float(group["link_stall_s"].sum() / group["total_s"].sum())
        record["bytes_h2d"] = group["bytes_h2d"].sum()
        record["bytes_d2h"] = group["bytes_d2h"].sum()
        record["hbm_overflow"] = bool(group["hbm_overflow"].any()) if "hbm_overflow" in group else False
        out.append(record)
    latency = add_method(pd.DataFrame(out))
    if runs is not None and not runs.empty:
        # Accuracy with what bought it: the run's traffic (traces.stats.traffic_summary), never one without the other.
        wanted = ["run_dir", "accuracy", "ci_low", "ci_high", "n_scored", *TRAFFIC_COLUMNS]
        accuracy = runs[[c for c in wanted if c in runs]]
        latency = latency.merge(accuracy, on="run_dir", how="left")
    return latency.sort_values(["profile", "method", "hbm_budget"]).reset_index(drop=True)


BREAKDOWN_PARTS = TIME_PARTS  # the parts of a step's time, as the simulator splits it
TRAFFIC_COLUMNS = ("attended_frac", "hbm_frac", "recalled_frac", "recalled_tokens_per_layer_step", "h2d_bytes_per_token",
                   "d2h_bytes_per_token", "h2d_bytes_per_token_ref", "d2h_bytes_per_token_ref")


def _ms_per_token(group: pd.DataFrame) -> float:
    """Decode time per generated token over all samples (the simulator's per-sample definition, pooled)."""
    if "decode_s" in group:
        decode_steps = (group["steps"] - 1).sum()
        if decode_steps > 0:
            return float(1000.0 * group["decode_s"].sum() / decode_steps)
    return float(np.average(group["ms_per_token"], weights=group["steps"]))


def focus_method(latency: pd.DataFrame) -> str | None:
    """The method most figures single out: the non-full one with the most budgets; on ties not pure eviction,
    then the most accurate (mean over its budgets), then by name."""
    candidates = latency[~latency["is_full"]]
    if candidates.empty:
        return None
    budgets = candidates.groupby("method")["hbm_budget"].nunique()
    accuracy = candidates.groupby("method")["accuracy"].mean() if "accuracy" in candidates else pd.Series(dtype=float)

    def rank(method: str):
        mean_accuracy = accuracy.get(method, np.nan)
        return (budgets[method], not method.startswith("pure eviction"),
                -1.0 if pd.isna(mean_accuracy) else mean_accuracy, method)

    return max(budgets.index, key=rank)


def breakdown_frame(latency: pd.DataFrame, hbm_budget: float | None = None, method: str | None = None) -> pd.DataFrame:
    """Per-profile time per token split into compute, HBM and link stall, for one method at one budget.

    Default: the focus method at its smallest budget (where offload costs the most).
    """
    method = method or focus_method(latency)
    if method is None:
        method, chosen = FULL_LABEL, latency[latency["is_full"]]
    else:
        chosen = latency[latency["method"] == method]
    if chosen.empty:
        return pd.DataFrame()
    if hbm_budget is None:
        hbm_budget = chosen["hbm_budget"].min()
    nearest = chosen.iloc[(chosen["hbm_budget"] - hbm_budget).abs().argsort()]["hbm_budget"].iloc[0]
    rows = chosen[np.isclose(chosen["hbm_budget"], nearest)]
    columns = ["profile", "method", "hbm_budget", *(f"{p}_ms" for p in BREAKDOWN_PARTS), "step_ms", "ms_per_token"]
    return rows[columns].sort_values("step_ms").reset_index(drop=True)


# -- 4. Pareto, 5. capacity ---------------------------------------------------------------------------------


def pareto_frame(latency: pd.DataFrame) -> pd.DataFrame:
    """Points (policy x profile) with accuracy; marks the frontier in latency and in HBM bytes per sequence."""
    if latency.empty or "accuracy" not in latency:
        return pd.DataFrame()
    points = latency.dropna(subset=["accuracy"]).reset_index(drop=True)
    # A policy at 0% accuracy is never a trade-off, however fast or small: it stays off the frontier (a frontier
    # through it reads as "the cheapest option"); the report's caption counts such points.
    answers = points["accuracy"] > 0
    points["on_frontier_latency"] = stats.pareto_frontier(points[answers], "ms_per_token", "accuracy").reindex(
        points.index, fill_value=False)
    # HBM bytes do not depend on the profile: one point per run.
    per_run = points.drop_duplicates("run_dir").copy()
    per_run["on_frontier_bytes"] = stats.pareto_frontier(per_run[per_run["accuracy"] > 0], "kv_hbm_bytes_per_seq",
                                                         "accuracy").reindex(per_run.index, fill_value=False)
    return points.merge(per_run[["run_dir", "on_frontier_bytes"]], on="run_dir", how="left")


def capacity_frame(latency: pd.DataFrame, sim: pd.DataFrame | None = None) -> pd.DataFrame:
    """Max concurrent sequences and aggregate throughput per (method, budget, profile).

    Throughput is simulated where the results hold a batched replay (batch > 1, at most the concurrency that
    fits; the largest such batch); elsewhere it is the bound concurrent sequences x single-sequence tokens/s,
    which overstates (decode is memory-bound: batching raises the time per step). `throughput_source` says which.
    """
    if latency.empty:
        return pd.DataFrame()
    frame = latency.copy()
    ddr_limit = pd.to_numeric(frame["max_concurrency_ddr"], errors="coerce").fillna(np.inf)  # null: no DDR used
    frame["max_concurrency"] = np.minimum(pd.to_numeric(frame["max_concurrency_policy"]), ddr_limit)
    frame["throughput_tokens_per_s"] = frame["max_concurrency"] * frame["tokens_per_s"]
    frame["throughput_source"] = "bound"
    batched = _batched_throughput(sim) if sim is not None and not sim.empty else pd.DataFrame()
    for index, row in frame.iterrows():
        rows = batched[(batched["run_dir"] == row["run_dir"]) & (batched["profile"] == row["profile"])
                       & (batched["batch"] <= row["max_concurrency"])] if not batched.empty else batched
        if not rows.empty:
            best = rows.loc[rows["batch"].idxmax()]
            frame.loc[index, "throughput_tokens_per_s"] = best["tokens_per_s"]
            frame.loc[index, "throughput_source"] = f"simulated at batch {int(best['batch'])}"
    return frame


def _batched_throughput(sim: pd.DataFrame) -> pd.DataFrame:
    """Aggregate tokens/s of every traced (run, profile, batch > 1): all sequences' decode tokens over decode time."""
    traced = sim[sim["result_kind"].isin(REPLAY_KINDS)] if "result_kind" in sim else sim
    rows = _per_sample_rows(traced[pd.to_numeric(traced["batch"]) > 1])
    if rows.empty or "decode_s" not in rows:
        return pd.DataFrame(columns=["run_dir", "profile", "batch", "tokens_per_s"])
    rows = rows.assign(batch=pd.to_numeric(rows["batch"]), decode_tokens=(rows["steps"] - 1) * pd.to_numeric(rows["batch"]))
    grouped = rows.groupby(["run_dir", "profile", "batch"], as_index=False)[["decode_tokens", "decode_s"]].sum()
    return grouped.assign(tokens_per_s=grouped["decode_tokens"] / grouped["decode_s"])


# -- 6. simulated vs measured, 7. mass lost vs accuracy -------------------------------------------------------


def sim_vs_measured_frame(sim: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Per sample: simulated total_s on each profile vs measured seconds (`measured`: run_dir, sample_id, measured_s).

    Keeps only (run, profile) pairs whose profile was named as the measuring machine's (`measured` column
    `profile`), so a GPU trace is never compared with a simulated CPU.
    """
    if measured.empty or sim.empty:
        return pd.DataFrame()
    traced = sim[sim["result_kind"].isin(REPLAY_KINDS)] if "result_kind" in sim else sim
    traced = _per_sample_rows(_select_config(traced, headline_config(traced)))  # one sequence, as measured
    joined = traced.merge(measured, on=["run_dir", "sample_id", "profile"], how="inner")
    joined = joined.rename(columns={"total_s": "simulated_s"})
    joined["rel_err"] = (joined["simulated_s"] - joined["measured_s"]) / joined["measured_s"]
    extra = [c for c in ("contended", "same_host") if c in joined]  # how far to trust each pair (kept, flagged)
    return joined[["run_dir", "profile", "sample_id", "simulated_s", "measured_s", "rel_err", *extra]].reset_index(drop=True)


def mass_lost_frame(sim: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Projected attention mass lost (what-if replays) next to the measured accuracy of the same policy.

    A projected row and a traced run are the same policy when their model and `policy_key`
    (traces.policy.PolicySpec.identity, written by both sides from the one spec) are equal. Mass lost =
    evicted + not recalled, mean over samples. Results written before `policy_key` existed do not join.
    """
    if sim.empty or "result_kind" not in sim or runs.empty or "policy_key" not in sim or "policy_key" not in runs:
        return pd.DataFrame()
    projected = _per_sample_rows(sim[sim["result_kind"] == "projected"]).copy()
    if projected.empty:
        return pd.DataFrame()
    projected["mass_lost"] = projected["mass_lost_evicted"].fillna(0) + projected["mass_lost_not_recalled"].fillna(0)
    keys = ["model", "policy_key"]
    per_policy = projected.groupby(keys, as_index=False)[["mass_lost", "mass_lost_evicted", "mass_lost_not_recalled"]].mean()
    scored = runs[runs["n_scored"] > 0]
    columns = [*keys, *(c for c in POLICY_KEYS if c not in keys), "accuracy", "ci_low", "ci_high", "n_scored", "run_dir"]
    joined = per_policy.merge(scored[[c for c in columns if c in scored]], on=keys)
    return add_method(joined) if not joined.empty else joined

