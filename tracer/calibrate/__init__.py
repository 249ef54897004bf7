"""`thoughtkv calibrate`: microbenchmarks of this machine -> a measured hardware profile YAML.

    thoughtkv calibrate --device cpu            # -> hwprofiles/measured/measured-cpu.yaml (minutes)
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
milliseconds at random, longer than the microsecond calls being timed, and wall time counts other processes'
turns.

The modules: `plan` (what is measured, and `Calibration`, what a run collects), `measure` (running the plan:
`bench`, `overhead`, `tiered` are the microbenchmarks, `fit` the line fit), `derive` (the overheads and cached
set fitted from the sweeps), `profile` (the profile and every field's source), `provenance`, `write` (the YAML,
atomically), `cli` (`thoughtkv calibrate` and `calibrate_here`); `measured` and `launches` serve the
cross-check and the overhead estimate. This package only re-exports them.
"""

from tracer.calibrate.cli import add_arguments, calibrate_here, resolve_out, run
from tracer.calibrate.derive import (
    effective_cache_bytes,
    overheads_by_decoder,
    per_layer,
    token_overhead_s,
    token_sweep_decoder,
)
from tracer.calibrate.measure import (
    architecture_for_model,
    decoder_factory,
    device_name,
    measure,
    resolve_architecture,
)
from tracer.calibrate.plan import (
    OVERHEAD_DECODERS,
    PLAN_LEVELS,
    TOKEN_SWEEP_DECODERS,
    TOKEN_SWEEP_LAYERS,
    Calibration,
    CalibrationError,
    CalibrationPlan,
    cache_geometry,
    plan_for,
)
from tracer.calibrate.profile import build_profile, copy_curves, last_level_cache, link_kind_for, memory_bytes
from tracer.calibrate.provenance import provenance
from tracer.calibrate.write import summary_line, write_profile

__all__ = [
    "OVERHEAD_DECODERS", "PLAN_LEVELS", "TOKEN_SWEEP_DECODERS", "TOKEN_SWEEP_LAYERS", "Calibration",
    "CalibrationError", "CalibrationPlan", "add_arguments", "architecture_for_model", "build_profile",
    "cache_geometry", "calibrate_here", "copy_curves", "decoder_factory", "device_name", "effective_cache_bytes",
    "last_level_cache", "link_kind_for", "measure", "memory_bytes", "overheads_by_decoder", "per_layer", "plan_for",
    "provenance", "resolve_architecture", "resolve_out", "run", "summary_line", "token_overhead_s",
    "token_sweep_decoder", "write_profile",
]
