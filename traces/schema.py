"""Trace format v1: the contract between tracer (writes), simulator and analysis (read).

A run is a directory:

    run.json                      manifest (see MANIFEST_REQUIRED)
    samples.parquet/part-*.parquet   one row per sample            (SAMPLES)
    steps.parquet/part-*.parquet     one row per (sample, step, layer)  (STEPS)
    access.parquet/part-*.parquet    per (sample, step, layer) mass of every KV block (ACCESS; optional)
    tokens.parquet/part-*.parquet    one row per (sample, position)  (TOKENS)

Each table is a directory of Parquet part files, one part per sample (Hive/Spark convention), so
`pandas.read_parquet("run/steps.parquet")` and DuckDB's `read_parquet('run/steps.parquet/*.parquet')` open it
without project code. A sample is committed when its `samples` part exists (written last); parts of other
tables without one are crash leftovers that readers ignore and the writer removes on resume.

Conventions: step 0 is the prefill (query_tokens = prompt length, produces the first generated token); steps
1.. are decode steps (query_tokens = 1). Block b covers logical positions [b*block_size, (b+1)*block_size).
Units are in the names: *_tokens are KV entries (tokens) of one layer, *_bytes bytes, *_us microseconds,
*_s seconds; masses are shares of one step's attention (mean over query heads), in [0, 1].
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "thoughtkv.trace/1"
TABLES = ("samples", "steps", "access", "tokens")

# Tier codes used in tokens.final_tier_by_layer.
TIER_HBM, TIER_DDR, TIER_EVICTED = 0, 1, 2
TIER_NAMES = {TIER_HBM: "hbm", TIER_DDR: "ddr", TIER_EVICTED: "evicted"}

SAMPLES = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # task's id, e.g. "gsm8k/test/0012"
        pa.field("sample_index", pa.int32(), nullable=False),  # order in the run
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("generated_tokens", pa.int32(), nullable=False),
        pa.field("stop_reason", pa.string(), nullable=False),  # eos | max_new_tokens | nonfinite
        pa.field("predicted", pa.string()),  # extracted answer (null: none found / no accuracy)
        pa.field("gold", pa.string()),
        pa.field("correct", pa.bool_()),  # null when not scored (random weights, no gold)
        pa.field("wall_s", pa.float64(), nullable=False),  # prefill + decode wall time of this sample
        pa.field("nonfinite", pa.bool_(), nullable=False),  # NaN/inf logits seen (sample stopped there)
        pa.field("generated_text", pa.string()),
        # Added later; parts written before lack them and read as null (LATER_COLUMNS):
        pa.field("grader", pa.string()),  # what scored `correct`, with its version, e.g. "math-verify 0.9.0"
        pa.field("answered_after_think", pa.bool_()),  # `predicted` came from the text after the last </think>
        # Fidelity to the full cache (`thoughtkv trace --fidelity-reference RUN`, tracer/fidelity.py); null in
        # other runs. The reference chain is RUN's greedy continuation of this sample (full cache).
        pa.field("fidelity_reference_tokens", pa.int32()),  # its length
        pa.field("fidelity_reference_loops", pa.bool_()),  # it repeats an 8-gram (a looping chain)
        pa.field("fidelity_reference_repeat", pa.int32()),  # the longest token span it repeats (0: none)
        # Teacher-forced on the reference chain, one value per step (step 0: the prefill's prediction):
        pa.field("fidelity_kl", pa.list_(pa.float32())),  # KL(full || policy) of the next token, nats
        pa.field("fidelity_top1", pa.list_(pa.bool_())),  # the policy's top-1 token is the reference's
        pa.field("fidelity_nll", pa.list_(pa.float32())),  # the reference token's NLL under the policy, nats
        pa.field("fidelity_full_nll", pa.list_(pa.float32())),  # ... and under the full cache
        # Free-running (this row's own generation): the first step whose token leaves the reference (null:
        # none within the shorter chain), and whether the extracted final answers are the same string.
        pa.field("fidelity_first_divergence", pa.int32()),
        pa.field("fidelity_answer_match", pa.bool_()),
        pa.field("fidelity_full_answered", pa.bool_()),  # the full cache's chain has an extractable answer
        # Teacher-forced on the task's human-written solution (null when the task has none), per token:
        pa.field("fidelity_human_kl", pa.list_(pa.float32())),
        pa.field("fidelity_human_top1", pa.list_(pa.bool_())),
        pa.field("fidelity_human_nll", pa.list_(pa.float32())),
        pa.field("fidelity_human_full_nll", pa.list_(pa.float32())),
    ]
)

FIDELITY_COLUMNS = tuple(name for name in SAMPLES.names if name.startswith("fidelity_"))

# Nullable columns added to a table after v1 shipped: a part without them is still v1 (they read as null).
LATER_COLUMNS = {"samples": ("grader", "answered_after_think", *FIDELITY_COLUMNS),
                 "steps": ("measured_deferred_us", "recall_hits", "recall_misses")}

STEPS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),  # 0 = prefill, then one per generated token
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("query_tokens", pa.int32(), nullable=False),  # new tokens processed this step
        pa.field("logical_len", pa.int32(), nullable=False),  # KV entries that exist logically, incl. new ones
        # Tier sizes when attention runs (after this step's recall, before its offload/evict):
        pa.field("hbm_tokens", pa.int32(), nullable=False),  # resident in HBM, incl. new, excl. recalled
        pa.field("ddr_tokens", pa.int32(), nullable=False),  # home in DDR (incl. those recalled this step)
        pa.field("evicted_tokens", pa.int32(), nullable=False),  # dropped for good
        pa.field("recalled_tokens", pa.int32(), nullable=False),  # copied DDR->HBM and attended this step
        pa.field("hbm_blocks", pa.int32(), nullable=False),
        pa.field("ddr_blocks", pa.int32(), nullable=False),
        pa.field("evicted_blocks", pa.int32(), nullable=False),
        # Block movements at this step (block ids):
        pa.field("recalled_block_ids", pa.list_(pa.int32()), nullable=False),  # H2D before attention
        pa.field("promoted_block_ids", pa.list_(pa.int32()), nullable=False),  # recalled, then kept in HBM
        pa.field("offloaded_block_ids", pa.list_(pa.int32()), nullable=False),  # D2H after attention
        pa.field("evicted_block_ids", pa.list_(pa.int32()), nullable=False),  # dropped after attention
        pa.field("bytes_h2d", pa.int64(), nullable=False),  # bytes actually copied host->device
        pa.field("bytes_d2h", pa.int64(), nullable=False),  # bytes actually copied device->host
        pa.field("hbm_kv_bytes", pa.int64(), nullable=False),  # KV bytes in HBM at attention (incl. recalled)
        pa.field("ddr_kv_bytes", pa.int64(), nullable=False),  # KV bytes stored in DDR (as stored: quantized?)
        # Quantized DDR tier (policy ddr_dtype int8/int4): error of the blocks offloaded at this step, relative
        # to the block's max |x|, max and RMS over K and V; null when nothing was quantized at this step.
        pa.field("quant_max_rel_err", pa.float32()),
        pa.field("quant_rms_rel_err", pa.float32()),
        # Attention mass (mean over query heads of the new query's softmax; prefill: last prompt query):
        pa.field("mass_hbm", pa.float32(), nullable=False),  # on HBM-resident entries
        pa.field("mass_ddr", pa.float32(), nullable=False),  # on recalled DDR entries
        pa.field("mass_evicted", pa.float32()),  # on evicted entries: null unless a shadow pass measured it
        pa.field("measured_step_us", pa.float64()),  # whole step (all layers), repeated per layer row
        pa.field("measured_layer_us", pa.float64()),  # this layer, when per-layer timing was on
        # Of which the step's deferred scoring, recording and placement of every layer (run inside the last
        # layer's forward: tracer.decode.LayerTimer); 0 on the other layers. Added later (LATER_COLUMNS).
        pa.field("measured_deferred_us", pa.float64()),
        # Recall buffer (policy recall_buffer_blocks > 0: a per-layer LRU of recalled blocks kept in HBM): of this
        # step's recalled blocks, those the buffer held (not copied) and those copied (bytes_h2d counts these).
        # Null without a buffer, and in parts written before it existed (LATER_COLUMNS).
        pa.field("recall_hits", pa.int32()),
        pa.field("recall_misses", pa.int32()),
    ]
)

# The stored form of block masses is an encoding owned by traces/encoding.py (see run.json "access").
# Readers return `block_mass` decoded as float32 arrays of length ceil(logical_len / block_size).
ACCESS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("block_mass_q", pa.list_(pa.uint8()), nullable=False),
    ]
)

TOKENS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),  # logical position (RoPE position)
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("is_prompt", pa.bool_(), nullable=False),
        # Attention this token received, summed over all decode steps, mean over query heads and layers:
        pa.field("importance", pa.float32(), nullable=False),
        pa.field("importance_max", pa.float32(), nullable=False),  # same, max over heads (mean over layers)
        pa.field("importance_by_layer", pa.list_(pa.float32()), nullable=False),  # mean over heads, per layer
        pa.field("final_tier_by_layer", pa.list_(pa.uint8()), nullable=False),  # TIER_* codes at the end
        # `thoughtkv trace --also-score A,B`: each named scorer's final score of this token, mean over layers
        # (scorers computed alongside, not driving placement; for `thoughtkv analyze correlation`); else null.
        pa.field("importance_by_scorer", pa.map_(pa.string(), pa.float32())),
    ]
)

TABLE_SCHEMAS = {"samples": SAMPLES, "steps": STEPS, "access": ACCESS, "tokens": TOKENS}

# run.json: required keys (nested dicts) -> what they hold. Extra keys are allowed and kept.
MANIFEST_REQUIRED: dict[str, tuple[str, ...]] = {
    "schema": (),  # == SCHEMA_VERSION
    "created": (),  # ISO-8601 UTC
    "kind": (),  # "traced" | "synthetic" | "measured"
    "thoughtkv": ("version", "git_commit"),
    "model": (
        "id", "revision", "architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size",
        "intermediate_size", "vocab_size", "dtype", "kv_bytes_per_token", "weight_bytes", "n_params",
        "random_weights",
    ),
    "task": ("name", "source", "split", "sample_ids"),
    "policy": (
        "name", "hbm_budget", "evict_ratio", "block_size", "scorer", "recall_k", "recall_rule",
        "sink_tokens", "window_tokens", "params",
    ),
    "hardware": ("device", "torch", "cuda", "transformers"),
    "seed": (),
    "access": ("enabled", "encoding"),
}
