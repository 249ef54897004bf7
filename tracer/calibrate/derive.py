"""The figures a profile takes from the measured series: each decoder's per-step, per-layer and per-token
overheads (fitted from the overhead and token sweeps, less the weights' and KV's own read time, which the cost
model charges apart), the placement's extra per layer, and the working set whose weights stay in the cache.
"""

from __future__ import annotations

from tracer.calibrate.plan import TOKEN_SWEEP_LAYERS, Calibration

# Weights whose reads run >= 2x memory bandwidth mostly come from the cache; the overheads measured with
# near-zero weights (the cached set) then apply (costs.overheads_for).
CACHED_SPEEDUP = 2.0


def token_sweep_decoder(decoder: str) -> str:
    """The swept decoder whose per-token cost `decoder` is charged: evict's for the scoring policies (evict,
    hierarchy), the full cache's for the others (tiered/full, dynamic-cache)."""
    policy = decoder.removeprefix("tiered/").partition("-k")[0]
    return "tiered/evict" if policy in ("evict", "hierarchy") else "tiered/full"


def token_overhead_s(cal: Calibration, decoder: str = "tiered/full") -> float:
    """Framework cost of one attended token in one layer-step of `decoder`: its token sweep's slope per layer,
    minus that token's K and V read at the measured bandwidth (the cost model charges those bytes already);
    >= 0. A calibration from before the per-decoder sweeps has one, `token_cost` (tiered/full): used for all."""
    fit = cal.fits.get(f"token_cost/{token_sweep_decoder(decoder)}") or cal.fits.get("token_cost")
    if fit is None:
        return 0.0
    kv_s = cal.figures["kv_bytes_per_token_layer"] / cal.figures["model_weights_read_bytes_per_s"]
    return max(0.0, fit["slope"] / TOKEN_SWEEP_LAYERS - kv_s)


def overheads_by_decoder(cal: Calibration) -> dict[str, dict[str, float]]:
    """Per decoder: the overheads the simulator adds to the weights' roofline time.

    From the sweep whose layers stream the model's weights: step time = a + b * layers, minus the weights' own
    time at the measured weight-read bandwidth (b - layer_bytes / bw per layer, a - head_bytes / bw per step),
    so that roofline + overhead reproduces the sweep. The near-zero sweep alone (`warm_*`) is kept to show how
    much cold caches add."""
    bandwidth = cal.figures["model_weights_read_bytes_per_s"]
    layer_s = cal.figures["layer_weight_bytes"] / bandwidth
    head_s = cal.figures["head_weight_bytes"] / bandwidth
    out = {}
    for name, cold in cal.fits.items():
        if not name.startswith("overhead_with_weights/"):
            continue
        decoder = name.removeprefix("overhead_with_weights/")
        warm = cal.fits[f"overhead/{decoder}"]
        # A warm sweep on the architecture's own shapes read its own weights (from the cache): subtract them too.
        own = cal.figures.get("warm_sweep_own_shapes", 0.0) > 0
        # The sweeps' layers attended ~prompt tokens each; the simulator charges those per token
        # (token_overhead_s), so the per-layer figure is what is left at zero tokens.
        per_token = token_overhead_s(cal, decoder)
        cold_tokens = per_token * cal.figures.get(f"attended_tokens/overhead_with_weights/{decoder}", 0.0)
        warm_tokens = per_token * cal.figures.get(f"attended_tokens/overhead/{decoder}", 0.0)
        warm_fixed, warm_slope = warm["fixed"], warm["slope"]
        split = (cal.series.get(f"layers_overhead/{decoder}"), cal.series.get(f"rest_overhead/{decoder}"))
        if None not in split:
            # The no-weights sweep reads no weights outside its layers, so the trace's own layer timer splits
            # its steps as a trace's: per layer = the layers' time / layers, per step = the median rest. (A fit
            # of step time vs layers attributes part of a small model's per-step cost to its layers.)
            import numpy as np

            warm_slope = per_layer(split[0])
            warm_fixed = float(np.median(split[1]["time_s"]))
        out[decoder] = {
            "step_overhead_s": max(0.0, cold["fixed"] - head_s),
            "layer_overhead_s": max(0.0, cold["slope"] - layer_s - cold_tokens),
            "warm_step_overhead_s": max(0.0, warm_fixed - head_s) if own else warm_fixed,
            "warm_layer_overhead_s": max(0.0, warm_slope - (layer_s if own else 0.0) - warm_tokens),
            "token_overhead_s": per_token,
            "max_rel_residual": cold["max_rel_residual"],
        }
        for key, series in (("placement_layer_overhead_s", f"placement_overhead_with_weights/{decoder}"),
                            ("warm_placement_layer_overhead_s", f"placement_overhead/{decoder}")):
            if series in cal.series:
                out[decoder][key] = per_layer(cal.series[series])
    return out


def per_layer(series: dict) -> float:
    """Least-squares slope through the origin of time vs layers: the placement runs on every layer of a moving
    step (all layers have the same length in the sweep), so its extra time has no per-step part to fit."""
    import numpy as np

    x, t = np.asarray(series["x"], dtype=np.float64), np.asarray(series["time_s"], dtype=np.float64)
    return max(0.0, float(x @ t / (x @ x)))


def effective_cache_bytes(cal: Calibration) -> int | None:
    """The largest working set whose weight reads run at least CACHED_SPEEDUP x the bandwidth of the largest
    one (from memory): up to that size weights stay resident between steps. Measured, not the sysfs size: a
    virtual machine may report its host's whole last-level cache while the slice it gets is far smaller (the
    profile's `working_set_read` series shows the read rate against the size). None when no size is that much
    faster (then no cached set)."""
    series = cal.series.get("working_set_read")
    if series is None:
        return None
    rates = [x / t for x, t in zip(series["x"], series["time_s"])]
    resident = [int(x) for x, rate in zip(series["x"][:-1], rates[:-1]) if rate >= CACHED_SPEEDUP * rates[-1]]
    return max(resident) if resident else None
