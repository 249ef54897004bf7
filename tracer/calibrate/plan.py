"""What a calibration measures and what it produced: the plan (sizes and repeats per device and level), the
decoders whose overheads are swept, the tiered cache geometry they run with, and `Calibration`, the raw series,
fits and figures a run collects (tracer.calibrate.measure) and the profile is built from (tracer.calibrate.profile).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from thoughtkv_base import UserError


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


TOKEN_SWEEP_LAYERS = 2
# The decoders whose per-token cost is swept: the tiered full cache attends without scoring; evict scores (and
# records) every attended token, and so does the hierarchy, whose recall is charged apart (per recalling
# layer-step and block), so it takes evict's slope (scoring costs per attended token: one slope for all would
# under-charge the scoring decoders at long contexts).
TOKEN_SWEEP_DECODERS = ("tiered/full", "tiered/evict")

# tiered/hierarchy recalls 4 blocks per layer-step, tiered/hierarchy-k1 one: the recall's fixed and per-block
# costs (simulator.costs.profile_for_policy).
OVERHEAD_DECODERS = ("dynamic-cache", "tiered/full", "tiered/evict", "tiered/hierarchy", "tiered/hierarchy-k1")


def cache_geometry(block_size: int | str | None = None, sink_tokens: int | str | None = None,
                   window_tokens: int | str | None = None) -> dict[str, int]:
    """The tiered cache's block size, sinks and window that the overhead decoders run with (None: the policy
    contract's default), checked and parsed by the contract (a flag's text becomes its whole number). A trace's
    per-layer cost depends on them: micro_long with block 4 / window 16 (the demo's) costs ~8% more per step than
    with block 16 / window 32 (four times the blocks to score, bound and place, and a placement every 4 steps),
    which a profile calibrated at block 16 under-estimated; so the demo and crosscheck calibrate with their runs'
    geometry."""
    from traces.policy import CACHE_GEOMETRY_KEYS, PolicySpec

    given, default = {"block_size": block_size, "sink_tokens": sink_tokens, "window_tokens": window_tokens}, PolicySpec()
    values = {k: getattr(default, k) if given[k] is None else given[k] for k in CACHE_GEOMETRY_KEYS}
    try:
        spec = PolicySpec(**values)
    except ValueError as exc:
        raise CalibrationError(f"cache geometry: {exc}") from None
    return {k: getattr(spec, k) for k in CACHE_GEOMETRY_KEYS}


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
