"""The columns of `thoughtkv simulate` results, in one place: what each means, which identify a result, and how
a run's summary row combines its samples. `simulate.py` fills rows in this order; `analysis/` reads them by
these names. Pure constants (no pandas), so that any layer can import them cheaply.

Formulas: simulator/README.md ("Outputs").
"""

from __future__ import annotations

from simulator.options import KEY_FIELDS

# The option columns (every SimOptions field but the engine setting: see options.KEY_FIELDS).
OPTION_COLUMNS = KEY_FIELDS

# One row per (run, what-if, profile, options, sample): name -> meaning (units in the name).
RESULT_COLUMNS: dict[str, str] = {
    "run_dir": "the trace run simulated (as given)",
    "run_label": "the run's label, + ' [what-if ...]' for a projection",
    "result_kind": "traced (a traced run's own placement), synthetic (a `traces synth` run's own placement) or "
    "projected (a what-if re-placement or --as-model)",
    "model": "model id from run.json",
    "policy": "placement policy simulated (full | evict | hierarchy)",
    "hbm_budget": "HBM budget: fraction of the logical length (<= 1) or tokens (> 1)",
    "evict_ratio": "hierarchy: share of the logical length evicted",
    "block_size": "tokens per KV block",
    "recall_k": "hierarchy: blocks recalled per layer-step",
    "scorer": "block importance scorer",
    "recall_rule": "how recalled blocks are chosen",
    "policy_key": "the policy's identity (traces.policy.PolicySpec.identity): traced runs and projections join on it",
    "profile": "hardware profile name",
    **{name: f"simulator option {name} (simulator.options.SimOptions)" for name in OPTION_COLUMNS},
    # overhead_mode (an option column) holds the mode charged: measured | kernel-only | hf-eager | cuda-graphs;
    # host_term (an option column) the host's cost per op it used: cited | <measured profile> | none (no host model)
    "engine": "engine that computed the row: des or fast",
    "overhead_set": "which of the profile's overhead sets was charged: streaming or cached",
    "overhead_source": "whose decode path's calibrated overheads were charged (tiered/<policy> or the profile's)",
    "same_host": "a measured profile and the run were recorded on the same host (traces/host.py; null: unknown)",
    "sample_id": "sample id; the summary row (one per run and profile) has SUMMARY_SAMPLE_ID",
    "steps": "steps simulated (prefill + decode steps)",
    "prompt_tokens": "prompt length",
    "total_s": "end of the last step's LM head",
    "prefill_s": "end of step 0",
    "decode_s": "total_s - prefill_s",
    "ms_per_token": "1000 decode_s / decode steps (per sequence)",
    "tokens_per_s": "batch x decode steps / decode_s",
    "compute_s": "time of compute-bound operations",
    "hbm_s": "time of HBM-bandwidth-bound operations",
    "overhead_s": "fixed per-step and per-layer overheads, and the host time the GPU waits for (host model)",
    "host_s": "the host's time issuing every step (steps x the host model's step time; 0 without one)",
    "link_stall_s": "total_s - compute_s - hbm_s - overhead_s: the GPU waits for a copy",
    "link_stall_frac": "link_stall_s / total_s",
    "bytes_h2d": "bytes recalled (all copies of a batch)",
    "bytes_d2h": "bytes offloaded",
    "link_util_h2d": "sum of H2D copy durations / (total_s x engines per channel)",
    "link_util_d2h": "sum of D2H copy durations / (total_s x engines per channel)",
    "d2h_backlog_s": "how long async offloads run after the last token",
    "peak_hbm_bytes": "weights + batch x peak KV in HBM",
    "peak_ddr_bytes": "batch x peak KV in the offload tier",
    "hbm_capacity_bytes": "the profile's HBM",
    "hbm_overflow": "peak_hbm_bytes > hbm_capacity_bytes",
    "ddr_overflow": "peak_ddr_bytes > the offload tier's capacity",
    "weight_bytes": "model weights",
    "kv_bytes_per_seq_full": "KV of the whole final logical length (full cache)",
    "kv_hbm_bytes_per_seq": "decode steps' peak KV in HBM per sequence",
    "kv_ddr_bytes_per_seq": "decode steps' peak KV in the offload tier per sequence",
    "max_concurrency_full": "sequences that fit in HBM with a full cache",
    "max_concurrency_policy": "sequences that fit in HBM under the policy",
    "max_concurrency_ddr": "sequences whose offloaded KV fits in the tier (null when nothing is offloaded)",
    "mass_lost_evicted": "projected: mean attention mass on evicted blocks",
    "mass_lost_not_recalled": "projected: mean attention mass on DDR blocks not recalled",
}

# Replays of a run's own placement: a traced run's, or a synthetic run's (labelled so, never as traced).
REPLAY_KINDS = ("traced", "synthetic")
# What makes two result rows the same result (rerunning into an --out replaces rows with an equal key).
KEY_COLUMNS = ("run_dir", "run_label", "result_kind", "profile", *OPTION_COLUMNS, "sample_id")
# The policy columns (with the model, they name a method).
POLICY_COLUMNS = ("model", "policy", "hbm_budget", "evict_ratio", "block_size", "scorer", "recall_k")
# What any results table has, old ones included: what `thoughtkv plot` needs to call a file a results table.
CORE_COLUMNS = ("run_dir", "profile", "policy", "hbm_budget", "evict_ratio", "steps", "total_s", "ms_per_token",
                "compute_s", "hbm_s", "link_stall_s")
# The parts a step's time is split into: TIME_PARTS[i] + "_s" columns add up to total_s.
TIME_PARTS = ("compute", "hbm", "overhead", "link_stall")
# Per-sequence capacity columns (the same for every sample of a run under one policy and profile).
CAPACITY_COLUMNS = ("kv_bytes_per_seq_full", "kv_hbm_bytes_per_seq", "max_concurrency_full",
                    "max_concurrency_policy", "max_concurrency_ddr")

# The summary row of a run (samples run one after another): sums, maxima, worst-case capacities.
SUMMARY_SAMPLE_ID = "ALL"
SUM_COLUMNS = ("steps", "total_s", "prefill_s", "decode_s", "compute_s", "hbm_s", "overhead_s", "host_s",
               "link_stall_s", "bytes_h2d", "bytes_d2h")
MAX_COLUMNS = ("peak_hbm_bytes", "peak_ddr_bytes", "kv_bytes_per_seq_full", "kv_hbm_bytes_per_seq",
               "kv_ddr_bytes_per_seq", "d2h_backlog_s")
MIN_COLUMNS = ("max_concurrency_full", "max_concurrency_policy", "max_concurrency_ddr")

# steps.parquet: one row per (sample, step), plus the KEY_COLUMNS of its result.
STEP_RESULT_COLUMNS = ("sample_id", "step", "latency_s", "compute_s", "hbm_s", "overhead_s", "link_stall_s",
                       "hbm_kv_bytes", "ddr_kv_bytes")
