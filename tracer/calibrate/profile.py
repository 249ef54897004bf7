"""A `Calibration` -> a hardware profile (hwprofiles.HardwareProfile) and the source of every field: the link,
memory and matmul figures, the overheads of the profile's decoder, the measured copy curves; and the facts of
this machine the profile records (link kind, last-level cache, memory sizes).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from tracer.calibrate.derive import (
    CACHED_SPEEDUP,
    effective_cache_bytes,
    overheads_by_decoder,
    token_sweep_decoder,
)
from tracer.calibrate.plan import TOKEN_SWEEP_LAYERS, Calibration
from tracer.calibrate.provenance import provenance

FULL_DUPLEX_MIN_RATIO = 1.6  # both-directions throughput / one direction, above which the link is full duplex


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
