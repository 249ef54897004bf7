"""`thoughtkv calibrate`: microbenchmarks of this machine -> a measured hardware profile YAML.

    thoughtkv calibrate --device cpu            # -> hwprofiles/measured/measured-cpu.yaml (~2 min here)
    thoughtkv simulate RUN --profile measured-cpu  # used like any datasheet profile

Each profile field is measured so that it means exactly what the simulator's cost model
(`simulator/costs.py`) does with it:

- `link.h2d_bandwidth`, `link.d2h_bandwidth`, `link.transfer_overhead`: a fit of `overhead + bytes / bandwidth`
  to single copies from 4 KB to 256 MB (pinned host memory on CUDA; host -> host on the CPU, the copy the CPU
  tiered cache does). `full_duplex`: both directions at once reach >= 1.6x one direction (CUDA streams).
- `gpu.hbm_*`: peak = the best of a large device-to-device copy (read + write bytes / time) and the matvecs;
  efficiency = the bandwidth of one decode step's weight reads with the model's own linear shapes
  (`--architecture`; GEMV speed depends on the shape) / that peak, so `hbm_bytes_per_s` is what a decode
  step's weight reads see.
- `gpu.matmul_*`: peak = a large GEMM in the compute dtype (bf16 on CUDA, fp32 on the CPU); efficiency = the
  model's own linear layers on 256 tokens at once (a prefill's GEMMs) / peak.
- `overheads`: the framework's fixed cost per step and per layer from decode steps of near-zero-work models
  with 1..8 layers (`tracer.calibrate.overhead`) whose layers stream the model's real weights (so the caches
  are as cold as in a real step), minus those weights' read time; for each decoder in OVERHEAD_DECODERS:
  transformers' DynamicCache loop and the tracer's tiered cache under each policy (its bookkeeping costs
  2-3x the bare loop per layer on a CPU). The profile's `overheads` are those of `--overhead-decoder` (default
  `tiered/full`: decoding under the tracer); every decoder's pair is in `provenance.overheads_by_decoder`,
  where `thoughtkv crosscheck` takes the one matching the policy it measures.
  On the CPU the profile also gets `overheads.*_cached` = the same decoder's fit with near-zero weights (no
  weights streamed) and `overheads.cache_bytes` = the last-level cache (`last_level_cache`, from Linux sysfs):
  the simulator charges those when a model's weights fit in that cache (they then stay resident and the small
  ops run as in the near-zero model; measured: ~2x faster than next to `tiny`'s 87 MB of weights). Omitted on
  CUDA (a GPU's weights never stay in its L2 at these sizes) and when sysfs cannot be read.
- attention decode time vs KV length (the model's head shapes) and the two-directions-at-once figure are
  recorded in `provenance` for the cross-check (the cost model charges attention at `hbm_bytes_per_s`).

Provenance records device, driver, library versions, date, thread count, clock and every raw timing and fit.
Timings are medians (or minima: `--statistic min`) of repeats after warm-up. On the CPU the default is ONE
intra-op thread, timed by that thread's CPU time: two OpenMP threads on a shared 2-core box stall for
milliseconds at random (measured: 8 ms for a 5 us sdpa call), and wall time counts other processes' turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from thoughtkv_base import UserError
from tracer.preflight import resolve_threads

# Weights whose reads run >= 2x memory bandwidth mostly come from the cache; the overheads measured with
# near-zero weights (the cached set) then apply (costs.overheads_for).
CACHED_SPEEDUP = 2.0
FULL_DUPLEX_MIN_RATIO = 1.6  # both-directions throughput / one direction, above which the link is full duplex
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class CalibrationError(UserError):
    """Bad calibrate arguments (one line, exit 2)."""


@dataclass(frozen=True)
class CalibrationPlan:
    """Sizes and repeats of every microbenchmark (per device; `quick` = seconds-long, for tests)."""

    copy_sizes_bytes: tuple[int, ...]
    duplex_bytes: int
    device_copy_bytes: int
    matvec_n: int
    gemm_n: int
    kv_lengths: tuple[int, ...]
    overhead_layer_counts: tuple[int, ...] = (1, 2, 4, 8)
    overhead_steps: int = 64  # 4 of them move blocks (one block of 16 completes every 16 steps)
    # Long enough that hierarchy holds more DDR blocks than recall_k (4) (budget 0.5 of 160: 80 tokens = 5 blocks
    # in DDR), so the recall takes its top-k path; short enough that the per-token correction stays small.
    overhead_prompt_tokens: int = 160
    repeats: int = 11
    warmup: int = 3
    weights_min_bytes: int = 256 * 2**20  # model-shape weight reads: pass the last-level cache
    prefill_tokens: int = 256  # tokens per GEMM of the model-shape matmul benchmark (a prompt's prefill)
    # Prompt lengths of the per-token cost sweep (`token_cost_sweep`: what one more attended token costs a layer).
    token_prompts: tuple[int, ...] = (64, 1024)
    # Weight-read working sets (CPU): where reads stop being served by the cache (`effective_cache_bytes`).
    working_set_sizes_bytes: tuple[int, ...] = tuple(2**20 * 2**i for i in range(9))  # 1 MiB ... 256 MiB


PLAN_LEVELS = ("full", "quick", "smoke")


def plan_for(device_type: str, level: str = "full") -> CalibrationPlan:
    """`full`: the reference (~2 min on a 2-core CPU); `quick`: the same benchmarks and fits with fewer sizes and
    repeats (<= 60 s here: what `thoughtkv demo` runs before it traces, so the cross-check compares with this
    machine today); `smoke`: tiny sizes, seconds, for tests only (its figures mean little)."""
    kib, mib = 2**10, 2**20
    if level == "smoke":
        return CalibrationPlan(
            copy_sizes_bytes=(4 * kib, 64 * kib, 1 * mib, 4 * mib), duplex_bytes=1 * mib,
            device_copy_bytes=4 * mib, matvec_n=512, gemm_n=128, kv_lengths=(64, 256, 1024),
            overhead_layer_counts=(1, 3), overhead_steps=8, overhead_prompt_tokens=105, repeats=3, warmup=1,
            weights_min_bytes=2**20, prefill_tokens=16, working_set_sizes_bytes=(2**20, 2**21, 2**22),
            token_prompts=(16, 240),  # a range wide enough that step-time noise (~1%) is not the slope
        )
    sizes = tuple(4 * kib * 4**i for i in range(9))  # 4 KB ... 256 MB
    if device_type == "cuda":
        plan = CalibrationPlan(
            copy_sizes_bytes=sizes, duplex_bytes=256 * mib, device_copy_bytes=1024 * mib, matvec_n=8192,
            gemm_n=8192, kv_lengths=(256, 1024, 4096, 16384, 65536),
        )
    else:
        plan = CalibrationPlan(
            copy_sizes_bytes=sizes, duplex_bytes=64 * mib, device_copy_bytes=256 * mib, matvec_n=4096,
            gemm_n=1024, kv_lengths=(64, 256, 1024, 4096, 16384),
        )
    if level == "quick":  # the overhead fit keeps its layer counts and statistic: it is what the cross-check needs
        plan = dataclasses.replace(
            plan, copy_sizes_bytes=sizes[:8], duplex_bytes=plan.duplex_bytes // 4,
            device_copy_bytes=plan.device_copy_bytes // 4, kv_lengths=plan.kv_lengths[:4], repeats=7, warmup=2,
            overhead_steps=48,
        )
    return plan


@dataclass
class Calibration:
    """Everything measured: raw series, fits, scalar figures and where it ran."""

    device: str
    device_name: str
    dtype: str
    threads: int
    architecture: str
    plan: CalibrationPlan
    series: dict = field(default_factory=dict)  # name -> {"x": [...], "time_s": [...], "unit": ...}
    fits: dict = field(default_factory=dict)  # name -> {"fixed": s, "slope": s/unit, "rate": unit/s, ...}
    figures: dict = field(default_factory=dict)  # name -> float (SI)
    clock: str = "wall"  # cuda_events | thread_cpu | wall
    statistic: str = "median"  # how repeats are reduced: median | min
    overhead_decoder: str = "tiered/full"  # whose overheads the profile's `overheads` are
    cache_geometry: dict = field(default_factory=lambda: cache_geometry())  # the tiered decoders' blocks and window


# ---------------------------------------------------------------- measuring ----------------------------------


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
    from tracer.calibrate.overhead import model_shapes, overhead_sweep, token_cost_sweep
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

    def overheads(decoder: str, prefix: str, stream) -> None:
        sweep = overhead_sweep(list(plan.overhead_layer_counts), dtype, plan.overhead_steps, timing,
                               decoder_factory(decoder, cal.cache_geometry), plan.overhead_prompt_tokens, stream,
                               own_shapes if stream is None else None)
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

    for decoder in OVERHEAD_DECODERS:
        for prefix, stream in (("overhead", None), ("overhead_with_weights", weights)):
            steps.append((f"{prefix} {decoder}", lambda decoder=decoder, prefix=prefix, stream=stream:
                          overheads(decoder, prefix, stream)))
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


TOKEN_SWEEP_LAYERS = 2
# The decoders whose per-token cost is swept: the tiered full cache attends without scoring; evict scores (and
# records) every attended token, and so does the hierarchy, whose recall is charged apart (per recalling
# layer-step and block), so it takes evict's slope (measured on micro shapes: full 0.13, evict 0.21, hierarchy
# 0.24 us per token and layer; one slope for all under-estimated the scoring decoders' long contexts by ~8%).
TOKEN_SWEEP_DECODERS = ("tiered/full", "tiered/evict")


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


# tiered/hierarchy recalls 4 blocks per layer-step, tiered/hierarchy-k1 one: the recall's fixed and per-block
# costs (simulator.costs.profile_for_policy).
OVERHEAD_DECODERS = ("dynamic-cache", "tiered/full", "tiered/evict", "tiered/hierarchy", "tiered/hierarchy-k1")


def cache_geometry(block_size: int | None = None, sink_tokens: int | None = None,
                   window_tokens: int | None = None) -> dict[str, int]:
    """The tiered cache's block size, sinks and window that the overhead decoders run with (None: the policy
    contract's default), checked by the contract. A trace's per-layer cost depends on them: micro_long with
    block 4 / window 16 (the demo's) costs ~8% more per step than with block 16 / window 32 (four times the
    blocks to score, bound and place, and a placement every 4 steps), which a profile calibrated at block 16
    under-estimated; so the demo and crosscheck calibrate with their runs' geometry."""
    from traces.policy import CACHE_GEOMETRY_KEYS, PolicySpec

    given, default = {"block_size": block_size, "sink_tokens": sink_tokens, "window_tokens": window_tokens}, PolicySpec()
    values = {k: getattr(default, k) if given[k] is None else given[k] for k in CACHE_GEOMETRY_KEYS}
    try:
        PolicySpec(**values)
    except ValueError as exc:
        raise CalibrationError(f"cache geometry: {exc}") from None
    return values


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
            # of step time vs layers put ~80 us of a 3-layer micro step on the wrong side: measured here.)
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
    virtual machine may report its host's whole last-level cache (480 MiB here) while the slice it gets is far
    smaller (measured here: 23 GB/s up to 32 MiB, 16 GB/s at 96 MiB, 10 GB/s from 256 MiB). None when no size
    is that much faster (then no cached set)."""
    series = cal.series.get("working_set_read")
    if series is None:
        return None
    rates = [x / t for x, t in zip(series["x"], series["time_s"])]
    resident = [int(x) for x, rate in zip(series["x"][:-1], rates[:-1]) if rate >= CACHED_SPEEDUP * rates[-1]]
    return max(resident) if resident else None


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


# ---------------------------------------------------------------- the profile --------------------------------


def link_kind_for(device_type: str, device_name: str, h2d_bytes_per_s: float) -> str:
    """The host link's kind: by GPU name where it is unambiguous, else by the measured bandwidth."""
    if device_type == "cpu":
        return "host"
    name = device_name.lower()
    if "gh200" in name or "gb200" in name:
        return "nvlink-c2c"
    gb_per_s = h2d_bytes_per_s / 1e9
    return "pcie5" if gb_per_s > 32 else "pcie4" if gb_per_s > 16 else "pcie3"


CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache(cache_dir: Path = CPU_CACHE_DIR) -> tuple[int, str] | None:
    """(bytes, source) of the CPU's highest-level data or unified cache, from Linux sysfs (`index*/level`,
    `index*/type`, `index*/size` such as "32768K"); None where that cannot be read (not Linux, no sysfs)."""
    best = None
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text().strip())
            kind = (index / "type").read_text().strip() if (index / "type").exists() else "Unified"
            size = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        match = re.fullmatch(r"(\d+)\s*([KMG]?)I?B?", size)
        if kind == "Instruction" or not match or int(match.group(1)) <= 0:
            continue
        if best is None or level > best[0]:
            best = (level, int(match.group(1)) * units[match.group(2)], index / "size", kind)
    if best is None:
        return None
    level, n_bytes, path, kind = best
    return n_bytes, f"measured: {path} (level {level}, {kind}, the last-level cache)"


def memory_bytes(device_type: str) -> tuple[int, int]:
    """(device memory, host memory) in bytes; on the CPU both tiers are the same RAM."""
    import torch

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, host
    return host, host


def build_profile(cal: Calibration, name: str):
    """Calibration -> (HardwareProfile, sources for every field)."""
    from hwprofiles import GPUSpec, HardwareProfile, HostSpec, LinkSpec, OverheadSpec

    fits, fig = cal.fits, cal.figures
    device_bytes, host_bytes = memory_bytes(cal.device)
    h2d, d2h = fits["copy_h2d"], fits["copy_d2h"]
    h2d_rate, d2h_rate = h2d["rate"], d2h["rate"]
    # Peak per direction: the best single copy seen, never below the fitted asymptote.
    h2d_peak = max(h2d_rate, max(x / t for x, t in zip(cal.series["copy_h2d"]["x"], cal.series["copy_h2d"]["time_s"])))
    d2h_peak = max(d2h_rate, max(x / t for x, t in zip(cal.series["copy_d2h"]["x"], cal.series["copy_d2h"]["time_s"])))
    weights = fig["model_weights_read_bytes_per_s"]
    hbm_peak = max(fig["device_copy_bytes_per_s"], fig["matvec_read_bytes_per_s"], weights)
    hbm_efficiency = weights / hbm_peak
    matmul_peak = max(fig["gemm_flops_per_s"], fig["model_gemm_flops_per_s"])
    full_duplex = cal.device == "cuda" and fig["duplex_ratio"] >= FULL_DUPLEX_MIN_RATIO
    overhead = overheads_by_decoder(cal)[cal.overhead_decoder]
    # The simulator moves offloaded KV at min(link, DDR). On a GPU the DDR figure is a host -> host copy; on
    # the CPU the "link" copy IS the DDR access (same memory, same copy), so DDR must not cap it again.
    ddr_bytes_per_s = fig["host_copy_bytes_per_s"] if cal.device == "cuda" else max(h2d_rate, d2h_rate)
    # CPU: the same decoder's overheads with no weights streamed, for models whose weights fit in the last-level
    # cache (see the module docstring); all three fields or none.
    llc = last_level_cache() if cal.device == "cpu" else None
    resident_bytes = effective_cache_bytes(cal) if llc is not None else None
    if resident_bytes is not None:
        resident_bytes = min(resident_bytes, llc[0])
    cached = {}
    if resident_bytes is not None:
        cached = dict(step_overhead_cached_s=max(0.0, overhead["warm_step_overhead_s"]),
                      layer_overhead_cached_s=max(0.0, overhead["warm_layer_overhead_s"]), cache_bytes=resident_bytes)
    profile = HardwareProfile(
        name=name,
        description=f"measured by `thoughtkv calibrate` on {cal.device_name} ({cal.device}, {cal.dtype}, "
                    f"{cal.threads} thread{'s' if cal.threads != 1 else ''})",
        gpu=GPUSpec(
            name=cal.device_name,
            hbm_capacity_bytes=int(device_bytes),
            hbm_peak_bytes_per_s=hbm_peak,
            hbm_efficiency=min(1.0, hbm_efficiency),
            matmul_peak_flops_per_s=matmul_peak,
            matmul_efficiency=fig["model_gemm_flops_per_s"] / matmul_peak,
        ),
        host=HostSpec(ddr_capacity_bytes=int(host_bytes), ddr_bytes_per_s=ddr_bytes_per_s),
        link=LinkSpec(
            kind=link_kind_for(cal.device, cal.device_name, h2d_rate),
            h2d_peak_bytes_per_s=h2d_peak,
            d2h_peak_bytes_per_s=d2h_peak,
            h2d_bytes_per_s=h2d_rate,
            d2h_bytes_per_s=d2h_rate,
            transfer_overhead_s=(h2d["fixed"] + d2h["fixed"]) / 2,
            copy_engines=1,
            full_duplex=full_duplex,
        ),
        overheads=OverheadSpec(step_overhead_s=overhead["step_overhead_s"], layer_overhead_s=overhead["layer_overhead_s"],
                               token_overhead_s=overhead["token_overhead_s"], **cached),
        provenance=provenance(cal),
    )
    p = cal.plan
    g = cal.cache_geometry
    decode = f"{cal.overhead_decoder} decode, block {g['block_size']}, window {g['window_tokens']}, sinks {g['sink_tokens']}"
    copies = f"{p.copy_sizes_bytes[0]} B .. {p.copy_sizes_bytes[-1]} B, {cal.statistic} of {p.repeats}"
    pinned = "pinned host <-> device" if cal.device == "cuda" else "host -> host (the CPU tiered cache's copy)"
    sources = {
        "gpu.hbm_capacity": "measured: torch.cuda total_memory" if cal.device == "cuda" else "measured: physical RAM (sysconf)",
        "gpu.hbm_peak_bandwidth": f"measured: best of a device copy of {p.device_copy_bytes} B ((read + write "
                                  f"bytes) / time) and {p.matvec_n}^2 / model-shape {cal.dtype} matvec weight reads",
        "gpu.hbm_efficiency": f"measured: weight-read bandwidth of one decode step's linear layers with "
                              f"{cal.architecture}'s shapes (1 token, {cal.dtype}) / peak",
        "gpu.matmul_peak": f"measured: best of a {p.gemm_n}^3 {cal.dtype} GEMM (2 n^3 / time) and the model-shape GEMMs",
        "gpu.matmul_efficiency": f"measured: FLOP rate of {cal.architecture}'s linear layers on {p.prefill_tokens} "
                                 f"tokens at once (a prefill's GEMMs) / peak",
        "host.ddr_capacity": "measured: physical RAM (sysconf)",
        "host.ddr_bandwidth": f"measured: host -> host copy of {p.device_copy_bytes} B, bytes / time"
                              if cal.device == "cuda" else "measured: the link fit (on the CPU the link copy is the "
                                                          "DDR access; the simulator takes min(link, DDR))",
        "link.h2d_peak_bandwidth": f"measured: best single {pinned} copy, {copies}",
        "link.d2h_peak_bandwidth": f"measured: best single {pinned} copy, {copies}",
        "link.h2d_bandwidth": f"measured: 1/slope of overhead + bytes/bandwidth fitted to {pinned} copies, {copies}",
        "link.d2h_bandwidth": f"measured: 1/slope of overhead + bytes/bandwidth fitted to {pinned} copies, {copies}",
        "link.transfer_overhead": "measured: mean intercept of the H2D and D2H fits",
        "link.copy_engines": "1: the tiered cache issues copies on one stream per direction",
        "link.full_duplex": f"measured: both directions at once / one direction = {fig['duplex_ratio']:.2f} "
                            f"(full duplex when >= {FULL_DUPLEX_MIN_RATIO}; the CPU path copies synchronously)",
        "overheads.step_overhead": f"measured: intercept of decode-step time vs layers of a near-zero-work Qwen2 "
                                   f"whose layers stream {cal.architecture}'s weights ({decode}, "
                                   f"layers {list(p.overhead_layer_counts)}), minus the lm_head's read time",
        "overheads.layer_overhead": f"measured: slope of the same fit minus one layer's weight-read time and its "
                                    f"attended tokens' token_overhead ({cal.overhead_decoder} decode)",
        "overheads.token_overhead": f"measured: slope of decode-step time vs attended tokens of a "
                                    f"{TOKEN_SWEEP_LAYERS}-layer Qwen2 with {cal.architecture}'s shapes "
                                    f"({token_sweep_decoder(cal.overhead_decoder)} decode, prompts {list(p.token_prompts)}) per layer, minus one token's K and V "
                                    f"read at the measured weight-read bandwidth",
    }
    own = cal.figures.get("warm_sweep_own_shapes", 0.0) > 0
    warm_model = f"a Qwen2 with {cal.architecture}'s shapes" if own else "a near-zero-work Qwen2"
    warm_minus = ", minus its own weights' read time" if own else ""
    if cached:
        sources.update({
            "overheads.step_overhead_cached": f"measured: intercept of decode-step time vs layers of {warm_model}, "
                                              f"no weights streamed ({cal.overhead_decoder} decode, layers "
                                              f"{list(p.overhead_layer_counts)}){warm_minus}: the per-step cost when "
                                              f"the model's weights fit in cache_bytes",
            "overheads.layer_overhead_cached": f"measured: slope of the same no-weights fit ({cal.overhead_decoder} "
                                               f"decode){warm_minus}",
            "overheads.cache_bytes": f"measured: the largest working set of {cal.dtype} weight reads running >= "
                                     f"{CACHED_SPEEDUP:g}x the bandwidth of a "
                                     f"{p.working_set_sizes_bytes[-1] // 2**20} MiB one (sizes "
                                     f"{p.working_set_sizes_bytes[0] // 2**20}..{p.working_set_sizes_bytes[-1] // 2**20} "
                                     f"MiB), at most the last-level cache ({llc[1].removeprefix('measured: ')}: "
                                     f"{llc[0] // 2**20} MiB)",
        })
    # The measured copy curves (time vs bytes per direction), which the simulator interpolates instead of the
    # fitted line (simulator/mechanisms.py, "Copy curve").
    curves = copy_curves(cal)
    profile = dataclasses.replace(profile, transfer=dataclasses.replace(profile.transfer, copy_curves=curves))
    what = "pinned host <-> device copies" if cal.device == "cuda" else \
        "host -> host copies (the CPU tiered cache's copy; a CPU has no pinning, so it stands for the pinned curve)"
    for key, _ in curves:
        copies = what if key.endswith("_pinned") else "pageable host <-> device copies (no pinned buffer)"
        sources[f"transfer.copy_curve.{key}"] = (
            f"measured: {cal.statistic} of {p.repeats} timed {copies}, {p.copy_sizes_bytes[0]} B .. "
            f"{p.copy_sizes_bytes[-1]} B; made non-decreasing in size (a larger copy is never faster: noise)")
    return profile, sources


def copy_curves(cal: Calibration) -> tuple:
    """The copy sweeps as hwprofiles CopyCurves: ("h2d_pinned", curve), ("d2h_pinned", curve), and on CUDA
    ("h2d_pageable", ...), ("d2h_pageable", ...); each time is at least the one of the size before it (the schema
    refuses a curve that gets faster with size)."""
    import numpy as np

    from hwprofiles import CopyCurve

    curves = []
    for memory, suffix in (("pinned", ""), ("pageable", "_pageable")):
        for direction in ("h2d", "d2h"):
            series = cal.series.get(f"copy_{direction}{suffix}")
            if series is None:
                continue
            times = np.maximum.accumulate(np.asarray(series["time_s"], dtype=np.float64))
            curves.append((f"{direction}_{memory}", CopyCurve(tuple(float(x) for x in series["x"]),
                                                               tuple(float(t) for t in times))))
    return tuple(curves)


def provenance(cal: Calibration) -> dict:
    import torch
    import transformers

    from thoughtkv_base import __version__, git_commit
    from traces.host import host_facts

    def rounded(obj):
        if isinstance(obj, float):
            return float(f"{obj:.6g}")
        if isinstance(obj, dict):
            return {k: rounded(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [rounded(v) for v in obj]
        return obj

    cuda = torch.version.cuda if cal.device == "cuda" else None
    driver = None
    if cal.device == "cuda":
        try:
            driver = str(torch._C._cuda_getDriverVersion())
        except (AttributeError, RuntimeError):
            driver = None
    return {
        "kind": "measured",
        "tool": "thoughtkv calibrate",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": cal.device,
        "device_name": cal.device_name,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "host_facts": host_facts(),  # identity + load at calibration: simulate/plot/crosscheck compare it
        "driver": driver,
        "cuda": cuda,
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "python": platform.python_version(),
        "thoughtkv": __version__,
        "git_commit": git_commit(),
        "threads": cal.threads,
        "clock": cal.clock,
        "statistic": cal.statistic,
        "dtype": cal.dtype,
        "architecture_for_attention": cal.architecture,
        "overhead_decoder": cal.overhead_decoder,
        "cache_geometry": dict(cal.cache_geometry),
        "overheads_by_decoder": rounded(overheads_by_decoder(cal)),
        "plan": rounded(asdict(cal.plan)),
        "figures": rounded(cal.figures),
        "fits": rounded(cal.fits),
        "series": rounded(cal.series),
    }


def write_profile(profile, sources: dict, out: Path) -> None:
    """Writes the YAML atomically (`traces.layout.write_atomic`), after reading it back through the schema, so
    that a profile the simulator would refuse is never left behind."""
    import yaml

    from hwprofiles import ProfileError, profile_from_dict, profile_to_yaml_dict
    from traces.layout import write_atomic

    text = "# Measured hardware profile written by `thoughtkv calibrate`; rerun it to refresh.\n"
    text += yaml.safe_dump(profile_to_yaml_dict(profile, sources), sort_keys=False, width=120)

    def read_back(temp: Path) -> None:
        written = profile_from_dict(yaml.safe_load(temp.read_text(encoding="utf-8")), str(out))
        if written.name != out.stem:
            raise ProfileError(f"{out}: the profile is named {written.name!r}; name the file {written.name}.yaml")

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda temp: temp.write_text(text, encoding="utf-8"), check=read_back)


# ---------------------------------------------------------------- CLI ----------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="device to calibrate (default: cuda when available, else cpu)")
    parser.add_argument("--out", default=None,
                        help="profile YAML to write; its stem is the profile name "
                             "(default: hwprofiles/measured/measured-<device>.yaml)")
    parser.add_argument("--architecture", default=None,
                        help="model shapes for the weight-read, GEMM and attention benchmarks: a known architecture "
                             "or a bundled model (micro, micro_long); calibrate for the model you will trace "
                             "(default: tiny on cpu, qwen2-7b on cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 on cpu, torch's default on cuda); recorded")
    parser.add_argument("--overhead-decoder", default="tiered/full", choices=OVERHEAD_DECODERS,
                        help="whose per-step/per-layer overheads the profile's `overheads` are (all are measured "
                             "and kept in provenance.overheads_by_decoder); default: tiered/full")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="reduce repeated timings by their median (default) or minimum (the uncontended cost "
                             "on a shared machine); recorded, and `thoughtkv crosscheck` reduces its repeats alike")
    parser.add_argument("--quick", action="store_true",
                        help="the same benchmarks with fewer sizes and repeats (<= 60 s on a 2-core CPU; what the demo runs)")
    for flag, what in (("--block-size", "tokens per KV block"), ("--sink-tokens", "attention sinks kept in HBM"),
                       ("--window-tokens", "recent window kept in HBM")):
        parser.add_argument(flag, type=int, default=None,
                            help=f"{what} of the tiered overhead decoders (default: the policy contract's); "
                                 "calibrate with the geometry of the runs the profile will be compared with")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: for tests only (figures mean little)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")


def resolve_out(out: str | None, device_type: str, force: bool) -> Path:
    from hwprofiles import MEASURED_DIR

    path = Path(out) if out else MEASURED_DIR / f"measured-{device_type}.yaml"
    if path.suffix not in (".yaml", ".yml"):
        raise CalibrationError(f"--out {path}: must end in .yaml (the profile is YAML)")
    if not NAME_PATTERN.match(path.stem):
        raise CalibrationError(f"--out {path}: the file stem is the profile name and must be lower-case letters, "
                               "digits, '.', '_' or '-'")
    if path.exists() and not force:
        raise CalibrationError(f"--out {path}: exists; pass --force to overwrite it or choose another file")
    if path.exists() and not path.is_file():
        raise CalibrationError(f"--out {path}: is not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not os.access(parent, os.W_OK):
        raise CalibrationError(f"--out {path}: directory {parent} is not writable")
    return path


def resolve_device(device: str | None) -> str:
    from tracer import preflight  # the one check of --device (a CPU build of torch -> the install line)

    return preflight.resolve_device(device, allow_index=False)


def run(args: argparse.Namespace) -> int:
    device_type = resolve_device(args.device)
    out = resolve_out(args.out, device_type, args.force)
    architecture = args.architecture or ("qwen2-7b" if device_type == "cuda" else "tiny")
    try:
        resolve_architecture(architecture)
    except UserError as exc:
        raise CalibrationError(f"--architecture: {exc}") from None
    threads = resolve_threads(device_type, args.threads)
    geometry = cache_geometry(args.block_size, args.sink_tokens, args.window_tokens)
    cal = measure(device_type, architecture, plan_for(device_type, "smoke" if args.smoke else "quick" if args.quick else "full"), threads, args.overhead_decoder,
                  args.statistic, geometry=geometry)
    profile, sources = build_profile(cal, out.stem)
    write_profile(profile, sources, out)
    print(summary_line(profile))
    print(f"wrote {out}")
    return 0


def calibrate_here(device_type: str, out: Path, threads: int, level: str = "quick", architecture: str | None = None,
                   progress: bool = True, geometry: dict | None = None) -> Path:
    """Calibrate this machine now (the `quick` plan: <= 60 s on a 2-core CPU) into `out`, for a command that
    then measures on it (demo, crosscheck): the profile and the timings it is compared with come from the same
    machine in the same run, and its tiered decoders use the runs' `geometry` (`cache_geometry`). Returns `out`."""
    architecture = architecture or ("qwen2-7b" if device_type == "cuda" else "tiny")
    cal = measure(device_type, architecture, plan_for(device_type, level), threads, progress=progress,
                  geometry=geometry)
    profile, sources = build_profile(cal, out.stem)
    write_profile(profile, sources, out)
    print(summary_line(profile), file=sys.stderr)
    return out


def summary_line(profile) -> str:
    g, lk, o = profile.gpu, profile.link, profile.overheads
    return (f"{profile.name}: memory {g.hbm_bytes_per_s / 1e9:.1f} GB/s (copy peak {g.hbm_peak_bytes_per_s / 1e9:.1f}), "
            f"matmul {g.matmul_flops_per_s / 1e9:.1f} GFLOP/s, link h2d {lk.h2d_bytes_per_s / 1e9:.1f} GB/s "
            f"d2h {lk.d2h_bytes_per_s / 1e9:.1f} GB/s + {lk.transfer_overhead_s * 1e6:.1f} us/copy, "
            f"duplex={lk.full_duplex}, overhead {o.step_overhead_s * 1e6:.0f} us/step + "
            f"{o.layer_overhead_s * 1e6:.0f} us/layer"
            + (f" (weights in the {o.cache_bytes / 2**20:.0f} MiB last-level cache: {o.step_overhead_cached_s * 1e6:.0f} "
               f"us/step + {o.layer_overhead_cached_s * 1e6:.0f} us/layer)" if o.has_cached else ""))
