"""Running the plan: every microbenchmark of tracer.calibrate.bench and tracer.calibrate.overhead on this machine,
each series fitted as it comes (tracer.calibrate.fit), into a `Calibration`; and the model shapes and decoders
they run with.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import asdict
from pathlib import Path

from tracer.calibrate.plan import (
    OVERHEAD_DECODERS,
    TOKEN_SWEEP_DECODERS,
    TOKEN_SWEEP_LAYERS,
    Calibration,
    CalibrationPlan,
    cache_geometry,
)


def measure(
    device_type: str,
    architecture: str,
    plan: CalibrationPlan,
    threads: int,
    overhead_decoder: str = "tiered/full",
    statistic: str = "median",
    progress: bool = True,
    geometry: dict | None = None,
) -> Calibration:
    """Run the plan's benchmarks; the tiered overhead decoders use `geometry` (`cache_geometry`: block size,
    sinks, window; default the policy contract's). In a frozen heap, as `thoughtkv trace` decodes
    (tracer.decode.frozen_heap), so the overheads it fits are timed as the traces' steps run."""
    from tracer.decode import frozen_heap

    with frozen_heap():
        return _measure(device_type, architecture, plan, threads, overhead_decoder, statistic, progress, geometry)


def _measure(device_type, architecture, plan, threads, overhead_decoder, statistic, progress, geometry) -> Calibration:
    import numpy as np
    import torch

    from tracer.calibrate import bench
    from tracer.calibrate.fit import fit_fixed_plus_linear
    from tracer.calibrate.overhead import model_shapes, overhead_sweeps, token_cost_sweep
    torch.set_num_threads(threads)
    device = torch.device(device_type)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    arch = resolve_architecture(architecture)
    clock_name, clock = ("cuda_events", time.perf_counter) if device_type == "cuda" else bench.cpu_clock(threads)
    cal = Calibration(device_type, device_name(device), str(dtype).removeprefix("torch."), threads, architecture,
                      plan, clock=clock_name, statistic=statistic, overhead_decoder=overhead_decoder,
                      cache_geometry=dict(geometry or cache_geometry()))
    timing = bench.Timing(device, plan.repeats, plan.warmup, clock, statistic)

    def record(series: bench.Series) -> None:
        fit = fit_fixed_plus_linear(np.array(series.x), np.array(series.time_s))
        cal.series[series.name] = {"x": series.x, "time_s": series.time_s, "unit": series.unit}
        cal.fits[series.name] = {**asdict(fit), "rate": fit.rate}

    def figure(name: str, value: float) -> None:
        cal.figures[name] = value

    weights = bench.ModelWeights(arch, dtype, device, plan.weights_min_bytes)
    cal.figures["layer_weight_bytes"] = float(weights.layer_bytes)
    cal.figures["head_weight_bytes"] = float(weights.head_bytes)
    sizes = list(plan.copy_sizes_bytes)
    # Two threads' work is not one thread's CPU time: the duplex figure is wall time (recorded only, on a CPU).
    wall = dataclasses.replace(timing, clock=time.perf_counter)
    steps = [
        ("copy h2d", lambda: record(bench.copy_sweep("h2d", sizes, timing))),
        ("copy d2h", lambda: record(bench.copy_sweep("d2h", sizes, timing))),
        ("duplex", lambda: _duplex(cal, bench.duplex_time_s(plan.duplex_bytes, wall))),
        ("host copy", lambda: figure("host_copy_bytes_per_s", _one_copy_rate(
            bench.copy_sweep("h2h", [plan.device_copy_bytes], timing)))),
        ("device copy", lambda: _device_copy(cal, bench.copy_sweep("d2d", [plan.device_copy_bytes], timing))),
        ("matvec", lambda: figure("matvec_read_bytes_per_s", bench.matvec_read_bytes_per_s(plan.matvec_n, dtype, timing))),
        ("model weights", lambda: figure(
            "model_weights_read_bytes_per_s", bench.model_weights_read_bytes_per_s(weights, timing))),
        ("gemm", lambda: figure("gemm_flops_per_s", bench.gemm_flops_per_s(plan.gemm_n, dtype, timing))),
        ("model gemm", lambda: figure("model_gemm_flops_per_s",
                                      bench.model_gemm_flops_per_s(weights, plan.prefill_tokens, timing))),
        ("attention", lambda: record(bench.attention_decode_sweep(
            list(plan.kv_lengths), arch.n_heads, arch.n_kv_heads, arch.head_dim, dtype, timing))),
    ]
    if device_type == "cuda":  # pageable host memory: what a framework without pinned pools copies from / to
        for direction in ("h2d", "d2h"):
            steps.append((f"copy {direction} pageable", lambda direction=direction: record(
                bench.copy_sweep(direction, sizes, timing, pinned=False))))
    if device_type == "cpu":  # the cached overheads' condition: up to which size weights stay in the cache
        steps.append(("cache size", lambda: record(bench.working_set_sweep(list(plan.working_set_sizes_bytes), dtype,
                                                                           timing))))

    # The no-weights ("warm", cached-set) sweep runs the architecture's own layer shapes when its largest model
    # is small (at most `weights_min_bytes`): those are the models whose weights stay in the cache, and their
    # non-matmul ops (norms, rotary, attention on real heads) cost more than a near-zero model's.
    largest_bytes = max(plan.overhead_layer_counts) * weights.layer_bytes + weights.head_bytes
    own_shapes = model_shapes(arch) if largest_bytes <= plan.weights_min_bytes else None
    cal.figures["warm_sweep_own_shapes"] = float(own_shapes is not None)

    cal.figures["kv_bytes_per_token_layer"] = float(2 * arch.n_kv_heads * arch.head_dim
                                                    * torch.tensor([], dtype=dtype).element_size())
    for decoder in TOKEN_SWEEP_DECODERS:
        steps.append((f"token cost {decoder}", lambda decoder=decoder: record(_named(token_cost_sweep(
            decoder_factory(decoder, cal.cache_geometry), list(plan.token_prompts), max(8, plan.overhead_steps // 2), dtype, timing,
            model_shapes(arch), TOKEN_SWEEP_LAYERS), f"token_cost/{decoder}"))))

    def overheads(prefix: str, stream) -> None:
        # All decoders in one interleaved sweep: the per-policy overheads are then measured side by side.
        sweeps = overhead_sweeps(list(plan.overhead_layer_counts), dtype, plan.overhead_steps, timing,
                                 {decoder: decoder_factory(decoder, cal.cache_geometry) for decoder in OVERHEAD_DECODERS},
                                 plan.overhead_prompt_tokens, stream, own_shapes if stream is None else None)
        for decoder, sweep in sweeps.items():
            quiet, placement = sweep.quiet, sweep.placement
            record(_named(quiet, f"{prefix}/{decoder}"))
            if sweep.attended_tokens is not None:
                cal.figures[f"attended_tokens/{prefix}/{decoder}"] = sweep.attended_tokens
            if sweep.split is not None:  # the step split as the trace splits it (layer timer), recorded raw
                for part in sweep.split:
                    cal.series[f"{part.name.split('/')[0]}_{prefix}/{decoder}"] = {"x": part.x, "time_s": part.time_s,
                                                                                "unit": part.unit}
            if placement is not None:  # the steps whose placement moved blocks, timed apart (overhead.py)
                cal.series[f"placement_{prefix}/{decoder}"] = {"x": placement.x, "time_s": placement.time_s,
                                                               "unit": placement.unit}

    for prefix, stream in (("overhead", None), ("overhead_with_weights", weights)):
        steps.append((f"{prefix} (all decoders)", lambda prefix=prefix, stream=stream: overheads(prefix, stream)))
    from tracer.calibrate.host import host_step  # the host's cost per eager op: the simulator's host term
    steps.append(host_step(cal.figures, timing))
    from tqdm import tqdm

    with tqdm(steps, desc="calibrate", unit="bench", disable=not progress) as bar:
        for name, run_step in bar:
            bar.set_postfix_str(name)
            run_step()
    return cal


def resolve_architecture(name: str):
    """A known architecture (traces.architectures) or a bundled model's own shapes (`micro`, `micro_long`: read
    from its config.json), so that a calibration measures weight reads with the shapes of the model it is for."""
    import json

    from tracer.models import BUNDLED_MODELS
    from traces.architectures import ARCHITECTURES, architecture_from_config, get_architecture

    if name in BUNDLED_MODELS and name not in ARCHITECTURES:
        config = BUNDLED_MODELS[name] / "config.json"
        return architecture_from_config(name, json.loads(config.read_text(encoding="utf-8")), str(config))
    return get_architecture(name)


def architecture_for_model(model: str, device_type: str) -> str:
    """The calibration architecture for a model spec: its own shapes when they are known here (a bundled model,
    `random:NAME`, a known name), else the device's default (qwen2-7b on CUDA, tiny on the CPU)."""
    from tracer.models import BUNDLED_MODELS
    from traces.architectures import ARCHITECTURES

    name = model.removeprefix("random:")
    if name in ARCHITECTURES or name in BUNDLED_MODELS:
        return name
    return "qwen2-7b" if device_type == "cuda" else "tiny"


def decoder_factory(name: str, geometry: dict | None = None):
    """A decode-loop factory for the overhead benchmark: transformers' DynamicCache or the tracer's tiered
    cache with one policy (budget 0.5, recall_k 4) and `geometry` (`cache_geometry`; default block 16,
    window 32, 4 sinks)."""
    from tracer.calibrate.overhead import dynamic_cache_decoder

    if name == "dynamic-cache":
        return dynamic_cache_decoder
    from tracer.calibrate.tiered import tiered_decoder_factory

    policy, _, k = name.removeprefix("tiered/").partition("-k")
    return tiered_decoder_factory(policy, recall_k=int(k) if k else 4, **(geometry or cache_geometry()))


def _named(series, name: str):
    series.name = name
    return series


def _duplex(cal: Calibration, times: tuple[float, float, float]) -> None:
    h2d_s, d2h_s, both_s = times
    n = cal.plan.duplex_bytes
    cal.figures["duplex_one_way_bytes_per_s"] = n / max(h2d_s, d2h_s)
    cal.figures["duplex_both_bytes_per_s"] = 2 * n / both_s
    cal.figures["duplex_ratio"] = cal.figures["duplex_both_bytes_per_s"] / cal.figures["duplex_one_way_bytes_per_s"]


def _one_copy_rate(series) -> float:
    return series.x[0] / series.time_s[0]


def _device_copy(cal: Calibration, series) -> None:
    # A copy reads and writes every byte: the memory traffic is twice the size.
    cal.figures["device_copy_bytes_per_s"] = 2 * series.x[0] / series.time_s[0]


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
