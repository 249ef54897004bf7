"""Hardware profile records: what the simulator reads of a machine, in SI units (bytes, seconds, B/s, FLOP/s).

`hwprofiles.schema` reads them from, and writes them to, the YAML form with units and sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_capacity_bytes: int
    hbm_peak_bytes_per_s: float
    hbm_efficiency: float  # achievable / peak, in (0, 1]
    matmul_peak_flops_per_s: float  # dense bf16/fp16 tensor-core peak
    matmul_efficiency: float  # achievable / peak, in (0, 1]

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_peak_bytes_per_s * self.hbm_efficiency

    @property
    def matmul_flops_per_s(self) -> float:
        return self.matmul_peak_flops_per_s * self.matmul_efficiency


@dataclass(frozen=True)
class HostSpec:
    ddr_capacity_bytes: int
    ddr_bytes_per_s: float  # achievable host-memory bandwidth


@dataclass(frozen=True)
class LinkSpec:
    kind: str  # one of LINK_KINDS
    h2d_peak_bytes_per_s: float  # per direction
    d2h_peak_bytes_per_s: float
    h2d_bytes_per_s: float  # achievable (pinned-memory copies)
    d2h_bytes_per_s: float
    transfer_overhead_s: float  # fixed cost of one copy (launch + DMA setup)
    copy_engines: int
    full_duplex: bool  # H2D and D2H can run at full speed at the same time


@dataclass(frozen=True)
class TierSpec:
    """An extra memory tier beyond HBM and host DDR, e.g. a CXL memory expander."""

    name: str
    kind: str  # one of TIER_KINDS
    capacity_bytes: int
    bytes_per_s: float  # achievable, to/from the GPU
    latency_s: float  # added access latency of one transfer


@dataclass(frozen=True)
class OverheadSpec:
    """Framework/launch overheads: 0 in datasheet profiles, filled in by calibration on a real machine.

    `step_overhead_s` / `layer_overhead_s` are the "streaming" set: measured while the decode streams a model's
    weights from memory. A CPU profile may also carry the "cached" set (all three optional fields or none):
    the same fixed costs measured with near-zero weights, which apply when the model's weights fit in the
    last-level cache of `cache_bytes` (then nothing evicts the ops' code and data between steps);
    `simulator.costs.overheads_for` chooses.

    `placement_overhead_s` / `recall_overhead_s` (and their cached twins) are the extra cost of a layer-step in
    which the tiered cache's placement moved blocks (offload, eviction, promotion) / recalled blocks: measured
    per policy by `thoughtkv calibrate` and kept in `provenance.overheads_by_decoder`, from where
    `simulator.costs.profile_for_policy` sets them for the policy being simulated (policy-specific, so no YAML
    field of their own; 0 everywhere else). `token_overhead_s` (YAML `token_overhead`) is charged per token a
    layer-step reads or writes KV of.
    """

    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    step_overhead_cached_s: float | None = None
    layer_overhead_cached_s: float | None = None
    cache_bytes: int | None = None  # the working set that stays in the cache (the cached set applies below it)
    placement_overhead_s: float = 0.0
    placement_overhead_cached_s: float = 0.0
    recall_overhead_s: float = 0.0  # per layer-step that recalls: the hierarchy's recall bookkeeping (likewise set)
    recall_overhead_cached_s: float = 0.0
    recall_block_overhead_s: float = 0.0  # per block a recalling layer-step recalls (likewise set)
    recall_block_overhead_cached_s: float = 0.0
    token_overhead_s: float = 0.0  # per token a layer-step reads or writes KV of (attention, scoring, bookkeeping)

    def __post_init__(self):
        given = [v is not None for v in (self.step_overhead_cached_s, self.layer_overhead_cached_s, self.cache_bytes)]
        if any(given) and not all(given):
            raise ValueError("OverheadSpec: step_overhead_cached_s, layer_overhead_cached_s and cache_bytes go "
                             "together (all three or none)")

    @property
    def has_cached(self) -> bool:
        return self.cache_bytes is not None


@dataclass(frozen=True)
class CopyCurve:
    """Measured time of one copy against its size (one direction, pinned or pageable host memory).

    Points are strictly increasing in bytes; `simulator.mechanisms.curve_time_s` interpolates linearly between
    them and extends the first / last segment beyond them (so a curve that is a line is that line everywhere).
    """

    bytes: tuple[float, ...]
    seconds: tuple[float, ...]


COPY_CURVE_KEYS = ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")


@dataclass(frozen=True)
class TransferSpec:
    """Parameters of the transfer mechanisms other than per-copy DMA (`simulator/mechanisms.py`); all optional.

    A mechanism that needs a field the profile lacks is refused on that profile with a one-line error.
    """

    sm_copy_h2d_bytes_per_s: float | None = None  # a copy kernel on a few SMs, achievable
    sm_copy_d2h_bytes_per_s: float | None = None
    sm_copy_sm_share: float | None = None  # fraction of the GPU's SMs the copy kernel occupies while it runs
    sm_copy_overhead_s: float | None = None  # launch cost of one copy kernel
    zero_copy_bytes_per_s: float | None = None  # a kernel reading host memory over the link (no staging)
    zero_copy_latency_s: float | None = None  # added once per kernel that reads host memory
    host_attention_flops_per_s: float | None = None  # achievable CPU FLOP/s for attention over DDR blocks
    copy_curves: tuple[tuple[str, CopyCurve], ...] = ()  # (key in COPY_CURVE_KEYS, curve)

    def curve(self, key: str) -> CopyCurve | None:
        return dict(self.copy_curves).get(key)


@dataclass(frozen=True)
class HostModel:
    """The host's side of a decode step on a GPU: the framework's Python, dispatcher and launches that issue the
    step's GPU work (`simulator/README.md`, "Host model"; the formulas are `simulator.costs.host_times`).

    The host issues `ops_per_layer` ops per decoder layer and `ops_per_step` outside the layers at `op_s` each,
    plus `step_s` once per step (a CUDA graph's launch, the decode loop's own Python). The GPU runs them as they
    are issued, so a step costs about max(host, GPU); the GPU cannot start before the host has issued the step's
    first `lead_ops` ops (and `step_s`), and the token is out no sooner than the host has issued every op (the
    host waits for it: sampling, stop checks). All zero: no host model (kernel-only, or a measured CPU profile
    whose calibrated overheads are host time already). `term` names the host cost per op that was used:
    "cited" (the mode's measured sources) or the measured profile whose calibration timed this host.
    """

    ops_per_layer: float = 0.0
    ops_per_step: float = 0.0
    lead_ops: float = 0.0
    op_s: float = 0.0
    step_s: float = 0.0
    term: str = "none"

    @property
    def active(self) -> bool:
        return self.op_s > 0 or self.step_s > 0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    gpu: GPUSpec
    host: HostSpec
    link: LinkSpec
    extra_tiers: tuple[TierSpec, ...] = ()
    overheads: OverheadSpec = field(default_factory=OverheadSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    provenance: dict = field(default_factory=lambda: {"kind": "datasheet"})
    path: str = ""
    host_model: HostModel = field(default_factory=HostModel)  # set by an overhead mode (overhead_modes.apply_mode)


# ---------------------------------------------------------------- overhead modes -----------------------------


@dataclass(frozen=True)
class MeasuredRun:
    """One measured decode the host's cost per op is derived from: time per token / ops the code issues per token."""

    run: str
    time_per_token_s: float
    ops_per_token: int

    @property
    def op_s(self) -> float:
        return self.time_per_token_s / self.ops_per_token


@dataclass(frozen=True)
class ModeSpec:
    """An overhead mode's cited figures (`hwprofiles/overheads/<mode>.yaml`; `overhead_modes.apply_mode` uses them).

    `op_s` is the geometric mean of `runs`' time per op (the one figure whose largest relative error over those
    runs is smallest), 0 when the mode issues no eager op. `decode_hbm_fraction`: the share of a profile's
    achievable HBM bandwidth a decode step's kernels reach (None: the mode takes another mode's, see there).
    """

    name: str
    ops_per_layer: int
    ops_per_step: int
    lead_ops: int
    step_s: float
    runs: tuple[MeasuredRun, ...] = ()
    decode_hbm_fraction: float | None = None

    @property
    def op_s(self) -> float:
        if not self.runs:
            return 0.0
        return math.exp(sum(math.log(r.op_s) for r in self.runs) / len(self.runs))
