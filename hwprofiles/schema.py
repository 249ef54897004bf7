"""Hardware profile schema: the records the simulator uses (SI units) and the YAML form they are read from.

In YAML every number is a mapping `{value: ..., unit: ..., source: "..."}` with an explicit unit and a source
(datasheet name, paper, or the assumption it rests on). In Python everything is SI: bytes, seconds, B/s,
FLOP/s. `profile_from_dict` turns the YAML form into a `HardwareProfile`, checking on the way every field that
can be wrong (missing, unknown/typo, wrong unit, missing source, non-positive or absurd value) and raising
`ProfileError` with a one-line message naming the file and the field. `profile_to_yaml_dict` is the inverse,
so that calibration can write a measured profile.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from thoughtkv_base import UserError


class ProfileError(UserError):
    """A hardware profile that is missing, unreadable or fails validation (one-line message, exit 2)."""


# ---------------------------------------------------------------- records (SI units) -------------------------


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


# ---------------------------------------------------------------- units and limits ---------------------------

# Unit -> factor to SI, per dimension. GB = 1e9 B, GiB = 2**30 B (both allowed for capacities).
UNITS: dict[str, dict[str, float]] = {
    "capacity": {
        "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
        "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
    },
    "bandwidth": {"B/s": 1.0, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "MiB/s": 2.0**20, "GiB/s": 2.0**30},
    "time": {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
    "flops": {"FLOP/s": 1.0, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15},
    "ratio": {"ratio": 1.0},
    "count": {"count": 1.0},
}
# The unit `profile_to_yaml_dict` writes for each dimension (the one the shipped profiles use).
DISPLAY_UNIT = {"capacity": "GB", "bandwidth": "GB/s", "time": "us", "flops": "TFLOP/s", "ratio": "ratio",
                "count": "count"}

# "host": no separate device; the "GPU" is the CPU and both tiers are host RAM (`thoughtkv calibrate --device cpu`).
LINK_KINDS = ("pcie3", "pcie4", "pcie5", "pcie6", "nvlink-c2c", "cxl", "host")
TIER_KINDS = ("cxl", "ddr", "lpddr", "nvme")
PROVENANCE_KINDS = ("datasheet", "measured")
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# Plausible ranges in SI units: anything outside is a unit mistake (MB for GB, ...) rather than real hardware.
GB, TB = 1e9, 1e12
HBM_CAPACITY_BYTES = (1 * GB, 4 * TB)
HBM_BYTES_PER_S = (100 * GB, 20 * TB)
MATMUL_FLOPS_PER_S = (1e12, 1e17)
# A CPU standing in for the GPU (link kind "host") is legitimately much slower.
CPU_DEVICE_BYTES_PER_S = (0.1 * GB, 20 * TB)
CPU_DEVICE_FLOPS_PER_S = (1e8, 1e17)
DDR_CAPACITY_BYTES = (1 * GB, 64 * TB)
DDR_BYTES_PER_S = (1 * GB, 10 * TB)
LINK_BYTES_PER_S = (0.1 * GB, 4 * TB)
TRANSFER_OVERHEAD_S = (0.0, 1e-2)
COPY_ENGINES = (1, 64)
TIER_CAPACITY_BYTES = (1 * GB, 1000 * TB)
TIER_BYTES_PER_S = (0.1 * GB, 10 * TB)
TIER_LATENCY_S = (0.0, 1.0)
OVERHEAD_S = (0.0, 1.0)
CACHE_BYTES = (16 * 2**10, 64 * GB)  # a last-level cache: 16 KiB (a tiny core's L2) .. 64 GB
CACHED_OVERHEAD_FIELDS = ("step_overhead_cached", "layer_overhead_cached", "cache_bytes")


# ---------------------------------------------------------------- YAML -> records ----------------------------


class _Section:
    """Reads one YAML mapping, remembering which keys were used so that typos can be reported."""

    def __init__(self, data: Any, where: str, file: str):
        self.where, self.file = where, file
        if not isinstance(data, dict):
            self.fail(f"must be a mapping of fields, got {type(data).__name__}")
        self.data, self.used = data, set()

    def fail(self, problem: str):
        raise ProfileError(f"{self.file}: {self.where}: {problem}" if self.where else f"{self.file}: {problem}")

    def _get(self, key: str, required: bool = True) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise ProfileError(f"{self.file}: {self._at(key)}: missing field; add `{key}:`")
            return None
        return self.data[key]

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def text(self, key: str, choices: tuple[str, ...] | None = None, required: bool = True) -> str | None:
        value = self._get(key, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip():
            raise ProfileError(f"{self.file}: {self._at(key)}: must be a non-empty string, got {value!r:.60}")
        if choices is not None and value not in choices:
            raise ProfileError(f"{self.file}: {self._at(key)}: unknown value {value!r:.40}; use one of {', '.join(choices)}")
        return value

    def quantity(self, key: str, dimension: str, limits: tuple[float, float], positive: bool = True,
                 required: bool = True, default: float = 0.0) -> float:
        """A `{value, unit, source}` mapping -> SI float, checked against `limits` (inclusive)."""
        raw = self._get(key, required)
        if raw is None and not required:
            return default
        at = self._at(key)
        value = self._value(raw, at, allow_unit=True)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProfileError(f"{self.file}: {at}.value: must be a number, got {value!r:.40}")
        unit = raw.get("unit")
        units = UNITS[dimension]
        if not isinstance(unit, str) or unit not in units:
            raise ProfileError(f"{self.file}: {at}.unit: {unit!r:.40} is not a {dimension} unit; use one of "
                               f"{', '.join(units)}")
        try:
            si = float(value) * units[unit]
        except OverflowError:
            si = math.inf
        if not math.isfinite(si):
            raise ProfileError(f"{self.file}: {at}.value: must be a finite number, got {value!r:.40}")
        if positive and si <= 0 or si < 0:
            raise ProfileError(f"{self.file}: {at}: must be {'positive' if positive else '>= 0'}, got {value} {unit}")
        low, high = limits
        if not low <= si <= high:
            raise ProfileError(f"{self.file}: {at}: {value} {unit} is outside the plausible range "
                               f"[{_show(low, dimension)}, {_show(high, dimension)}]; check the value and unit")
        return si

    def ratio(self, key: str) -> float:
        """An efficiency: achievable / peak, in (0, 1]."""
        return self.quantity(key, "ratio", (0.0, 1.0), positive=True)

    def count(self, key: str, limits: tuple[int, int], positive: bool = True) -> int:
        si = self.quantity(key, "count", limits, positive=positive)
        if si != int(si):
            raise ProfileError(f"{self.file}: {self._at(key)}.value: must be a whole number, got {si}")
        return int(si)

    def flag(self, key: str) -> bool:
        raw = self._get(key)
        value = self._value(raw, self._at(key), allow_unit=False)
        if not isinstance(value, bool):
            raise ProfileError(f"{self.file}: {self._at(key)}.value: must be true or false, got {value!r:.40}")
        return value

    def _value(self, raw: Any, at: str, allow_unit: bool) -> Any:
        """Checks the `{value, unit, source}` shape (a source is mandatory) and returns `value`."""
        allowed = ("value", "unit", "source") if allow_unit else ("value", "source")
        form = "{value: ..., unit: ..., source: ...}" if allow_unit else "{value: ..., source: ...}"
        if not isinstance(raw, dict):
            raise ProfileError(f"{self.file}: {at}: must be a mapping {form}, got {raw!r:.40}")
        for key in raw:
            if key not in allowed:
                raise ProfileError(f"{self.file}: {at}: unknown key {key!r:.40}; allowed: {', '.join(allowed)}")
        for key in allowed:
            if key not in raw:
                raise ProfileError(f"{self.file}: {at}.{key}: missing; write it as {form}")
        source = raw["source"]
        if not isinstance(source, str) or not source.strip():
            raise ProfileError(f"{self.file}: {at}.source: must name a document or assumption (non-empty text)")
        return raw["value"]

    def section(self, key: str, required: bool = True) -> _Section | None:
        raw = self._get(key, required)
        if raw is None and not required:
            return None
        return _Section(raw, self._at(key), self.file)

    def done(self) -> None:
        """Rejects keys nobody asked for (typos), suggesting the closest known one."""
        for key in self.data:
            if key in self.used:
                continue
            close = difflib.get_close_matches(str(key), sorted(self.used), n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"known fields: {', '.join(sorted(self.used))}"
            raise ProfileError(f"{self.file}: {self._at(str(key))}: unknown field; {hint}")


def _show(si: float, dimension: str) -> str:
    unit = DISPLAY_UNIT[dimension]
    return f"{si / UNITS[dimension][unit]:g} {unit}"


def profile_from_dict(data: Any, file: str) -> HardwareProfile:
    """The YAML form (already parsed by `yaml.safe_load`) -> a validated `HardwareProfile`."""
    top = _Section(data, "", file)
    name = top.text("name")
    if not NAME_PATTERN.match(name):
        top.fail(f"name: {name!r:.40} must be lower-case letters, digits, '.', '_' or '-' (it is the CLI name)")
    description = top.text("description")

    provenance = top._get("provenance")
    if not isinstance(provenance, dict) or provenance.get("kind") not in PROVENANCE_KINDS:
        top.fail(f"provenance: must be a mapping with `kind:` one of {', '.join(PROVENANCE_KINDS)}")
    if not all(isinstance(k, str) for k in provenance):
        top.fail("provenance: keys must be strings")

    lk = top.section("link")
    cpu_device = lk.text("kind", LINK_KINDS) == "host"

    g = top.section("gpu")
    gpu = GPUSpec(
        name=g.text("name"),
        hbm_capacity_bytes=round(g.quantity("hbm_capacity", "capacity", HBM_CAPACITY_BYTES)),
        hbm_peak_bytes_per_s=g.quantity("hbm_peak_bandwidth", "bandwidth",
                                        CPU_DEVICE_BYTES_PER_S if cpu_device else HBM_BYTES_PER_S),
        hbm_efficiency=g.ratio("hbm_efficiency"),
        matmul_peak_flops_per_s=g.quantity("matmul_peak", "flops",
                                           CPU_DEVICE_FLOPS_PER_S if cpu_device else MATMUL_FLOPS_PER_S),
        matmul_efficiency=g.ratio("matmul_efficiency"),
    )
    g.done()

    h = top.section("host")
    host = HostSpec(
        ddr_capacity_bytes=round(h.quantity("ddr_capacity", "capacity", DDR_CAPACITY_BYTES)),
        ddr_bytes_per_s=h.quantity("ddr_bandwidth", "bandwidth", DDR_BYTES_PER_S),
    )
    h.done()

    link = LinkSpec(
        kind=lk.text("kind", LINK_KINDS),
        h2d_peak_bytes_per_s=lk.quantity("h2d_peak_bandwidth", "bandwidth", LINK_BYTES_PER_S),
        d2h_peak_bytes_per_s=lk.quantity("d2h_peak_bandwidth", "bandwidth", LINK_BYTES_PER_S),
        h2d_bytes_per_s=lk.quantity("h2d_bandwidth", "bandwidth", LINK_BYTES_PER_S),
        d2h_bytes_per_s=lk.quantity("d2h_bandwidth", "bandwidth", LINK_BYTES_PER_S),
        transfer_overhead_s=lk.quantity("transfer_overhead", "time", TRANSFER_OVERHEAD_S, positive=False),
        copy_engines=lk.count("copy_engines", COPY_ENGINES),
        full_duplex=lk.flag("full_duplex"),
    )
    lk.done()
    for direction in ("h2d", "d2h"):
        achievable = getattr(link, f"{direction}_bytes_per_s")
        peak = getattr(link, f"{direction}_peak_bytes_per_s")
        if achievable > peak:
            lk.fail(f"{direction}_bandwidth ({achievable / GB:g} GB/s) exceeds {direction}_peak_bandwidth "
                    f"({peak / GB:g} GB/s); achievable cannot beat peak")
        if peak >= gpu.hbm_peak_bytes_per_s and not cpu_device:  # on a CPU both "tiers" are the same RAM
            lk.fail(f"{direction}_peak_bandwidth ({peak / GB:g} GB/s) is not below the HBM bandwidth "
                    f"({gpu.hbm_peak_bytes_per_s / GB:g} GB/s); a host link faster than HBM is a unit mistake")

    extra_tiers = _parse_tiers(top._get("extra_tiers", required=False), gpu, file)

    o = top.section("overheads", required=False)
    overheads = OverheadSpec()
    if o is not None:
        cached = {}
        present = [key for key in CACHED_OVERHEAD_FIELDS if key in o.data]
        if present and len(present) < len(CACHED_OVERHEAD_FIELDS):
            missing = [key for key in CACHED_OVERHEAD_FIELDS if key not in o.data]
            o.fail(f"{', '.join(present)} without {', '.join(missing)}: the cached overheads need all three of "
                   f"{', '.join(CACHED_OVERHEAD_FIELDS)}; add `{missing[0]}:` or remove {', '.join(present)}")
        if present:
            cached = dict(
                step_overhead_cached_s=o.quantity("step_overhead_cached", "time", OVERHEAD_S, positive=False),
                layer_overhead_cached_s=o.quantity("layer_overhead_cached", "time", OVERHEAD_S, positive=False),
                cache_bytes=round(o.quantity("cache_bytes", "capacity", CACHE_BYTES)),
            )
        overheads = OverheadSpec(
            step_overhead_s=o.quantity("step_overhead", "time", OVERHEAD_S, positive=False, required=False),
            layer_overhead_s=o.quantity("layer_overhead", "time", OVERHEAD_S, positive=False, required=False),
            token_overhead_s=o.quantity("token_overhead", "time", OVERHEAD_S, positive=False, required=False),
            **cached,
        )
        o.done()
    transfer = _parse_transfer(top.section("transfer", required=False), link, host)
    top.done()
    return HardwareProfile(name=name, description=description, gpu=gpu, host=host, link=link,
                           extra_tiers=extra_tiers, overheads=overheads, transfer=transfer,
                           provenance=dict(provenance), path=file)


# The optional `transfer:` section: (YAML key, TransferSpec field, dimension, limits).
TRANSFER_FIELDS = (
    ("sm_copy_h2d_bandwidth", "sm_copy_h2d_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    ("sm_copy_d2h_bandwidth", "sm_copy_d2h_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    ("sm_copy_sm_share", "sm_copy_sm_share", "ratio", (0.0, 0.5)),
    ("sm_copy_overhead", "sm_copy_overhead_s", "time", TRANSFER_OVERHEAD_S),
    ("zero_copy_bandwidth", "zero_copy_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    ("zero_copy_latency", "zero_copy_latency_s", "time", TRANSFER_OVERHEAD_S),
    ("host_attention_flops", "host_attention_flops_per_s", "flops", CPU_DEVICE_FLOPS_PER_S),
)
COPY_CURVE_POINTS = (2, 256)
COPY_CURVE_BYTES = (1.0, 1e12)


def _parse_transfer(t: _Section | None, link: LinkSpec, host: HostSpec) -> TransferSpec:
    if t is None:
        return TransferSpec()
    values = {}
    for key, attr, dimension, limits in TRANSFER_FIELDS:
        if key in t.data:
            positive = dimension not in ("time",)
            values[attr] = t.quantity(key, dimension, limits, positive=positive)
    for direction in ("h2d", "d2h"):  # a kernel moves bytes over the same wire as the DMA engines
        rate = values.get(f"sm_copy_{direction}_bytes_per_s")
        peak = getattr(link, f"{direction}_peak_bytes_per_s")
        if rate is not None and rate > peak:
            t.fail(f"sm_copy_{direction}_bandwidth ({rate / GB:g} GB/s) exceeds link.{direction}_peak_bandwidth "
                   f"({peak / GB:g} GB/s); a copy kernel cannot beat the wire")
    zero = values.get("zero_copy_bytes_per_s")
    if zero is not None and zero > link.h2d_peak_bytes_per_s:
        t.fail(f"zero_copy_bandwidth ({zero / GB:g} GB/s) exceeds link.h2d_peak_bandwidth "
               f"({link.h2d_peak_bytes_per_s / GB:g} GB/s); reads over the link cannot beat it")
    curves = []
    raw_curves = t.section("copy_curve", required=False)
    if raw_curves is not None:
        for key in COPY_CURVE_KEYS:
            if key in raw_curves.data:
                curves.append((key, _parse_curve(raw_curves.section(key))))
        raw_curves.done()
    t.done()
    return TransferSpec(**values, copy_curves=tuple(curves))


def _parse_curve(c: _Section) -> CopyCurve:
    """`{bytes: [...], time: [...], time_unit: us, source: ...}`, or `bandwidth: [...], bandwidth_unit: GB/s` in
    place of the times (what bandwidthTest and nvbandwidth report: time = bytes / bandwidth) -> a CopyCurve in bytes
    and seconds."""
    by_rate = "bandwidth" in c.data
    sizes, values = c._get("bytes"), c._get("bandwidth" if by_rate else "time")
    unit = c.text("bandwidth_unit" if by_rate else "time_unit", tuple(UNITS["bandwidth" if by_rate else "time"]))
    source = c.text("source")
    del source  # required (every number cites where it comes from) but not kept in the record
    low, high = COPY_CURVE_POINTS
    what = "bandwidth" if by_rate else "time"
    if not isinstance(sizes, list) or not isinstance(values, list) or len(sizes) != len(values) \
            or not low <= len(sizes) <= high:
        c.fail(f"bytes and {what} must be lists of the same length ({low}..{high} points)")
    numbers = [v for v in sizes + values if not isinstance(v, bool) and isinstance(v, int | float)]
    if len(numbers) != 2 * len(sizes) or not all(math.isfinite(v) for v in numbers):
        c.fail(f"bytes and {what} must hold finite numbers only")
    if any(b <= a for a, b in zip(sizes, sizes[1:])) or not COPY_CURVE_BYTES[0] <= sizes[0] \
            or sizes[-1] > COPY_CURVE_BYTES[1]:
        c.fail("bytes must be strictly increasing, from >= 1 B to <= 1 TB")
    if by_rate:
        rates = [float(v) * UNITS["bandwidth"][unit] for v in values]
        if not all(LINK_BYTES_PER_S[0] * 1e-3 <= r <= LINK_BYTES_PER_S[1] for r in rates):
            c.fail(f"bandwidth must lie in [{_show(LINK_BYTES_PER_S[0] * 1e-3, 'bandwidth')}, "
                   f"{_show(LINK_BYTES_PER_S[1], 'bandwidth')}]; check the values and bandwidth_unit")
        seconds = [float(b) / r for b, r in zip(sizes, rates)]
    else:
        seconds = [float(v) * UNITS["time"][unit] for v in values]
    if any(s <= 0 for s in seconds) or any(b < a for a, b in zip(seconds, seconds[1:])):
        c.fail("time must be positive and never decrease with size (a larger copy is not faster)")
    c.done()
    return CopyCurve(tuple(float(v) for v in sizes), tuple(seconds))


def _parse_tiers(raw: Any, gpu: GPUSpec, file: str) -> tuple[TierSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ProfileError(f"{file}: extra_tiers: must be a list of tiers, got {type(raw).__name__}")
    tiers, names = [], set()
    for index, item in enumerate(raw):
        t = _Section(item, f"extra_tiers[{index}]", file)
        tier = TierSpec(
            name=t.text("name"),
            kind=t.text("kind", TIER_KINDS),
            capacity_bytes=round(t.quantity("capacity", "capacity", TIER_CAPACITY_BYTES)),
            bytes_per_s=t.quantity("bandwidth", "bandwidth", TIER_BYTES_PER_S),
            latency_s=t.quantity("latency", "time", TIER_LATENCY_S, positive=False),
        )
        t.done()
        if tier.name in names or tier.name in ("hbm", "ddr"):
            t.fail(f"name: {tier.name!r:.40} is used twice (hbm and ddr are taken); give each tier its own name")
        if tier.bytes_per_s >= gpu.hbm_peak_bytes_per_s:
            t.fail("bandwidth: not below the HBM bandwidth; an extra tier faster than HBM is a unit mistake")
        names.add(tier.name)
        tiers.append(tier)
    return tuple(tiers)


# ---------------------------------------------------------------- overhead modes (YAML -> records) ----------


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


MODE_OPS = (0, 100_000)  # ops a decode step issues per layer / outside the layers
HOST_OP_S = (1e-7, 1e-3)  # one op's host time derived from a run: 0.1 us .. 1 ms
TIME_PER_TOKEN_S = (1e-5, 10.0)


def mode_from_dict(data: Any, file: str) -> ModeSpec:
    """An overhead mode file (already parsed by `yaml.safe_load`) -> a validated `ModeSpec` (the same rules as
    profiles: every number {value, unit, source}, unknown keys refused, absurd values refused)."""
    top = _Section(data, "", file)
    name = top.text("mode")
    h = top.section("host")
    ops = {key: h.count(key, MODE_OPS, positive=False) for key in ("ops_per_layer", "ops_per_step", "lead_ops")}
    step_s = h.quantity("step_host", "time", OVERHEAD_S, positive=False)
    h.done()
    if ops["lead_ops"] > ops["ops_per_layer"] + ops["ops_per_step"]:
        h.fail(f"lead_ops ({ops['lead_ops']}) exceeds the ops of a one-layer step; it counts the ops issued before the "
               "step's first matmul")
    runs = []
    raw_runs = top._get("host_op_from", required=False)
    if raw_runs is not None:
        if not isinstance(raw_runs, list) or not raw_runs:
            top.fail("host_op_from: must be a non-empty list of measured runs")
        for index, item in enumerate(raw_runs):
            r = _Section(item, f"host_op_from[{index}]", file)
            run = MeasuredRun(r.text("run"), r.quantity("time_per_token", "time", TIME_PER_TOKEN_S),
                              r.count("ops_per_token", (1, MODE_OPS[1])))
            r.done()
            if not HOST_OP_S[0] <= run.op_s <= HOST_OP_S[1]:
                r.fail(f"{run.op_s * 1e6:.3g} us per op is not a host's cost per op (0.1 us .. 1 ms); check "
                       "time_per_token and ops_per_token")
            runs.append(run)
    if (ops["ops_per_layer"] or ops["ops_per_step"]) and not runs:
        top.fail("host_op_from: the mode issues eager ops, so it needs the measured runs its cost per op comes from")
    g = top.section("gpu", required=False)
    fraction = None
    if g is not None:
        fraction = g.ratio("decode_hbm_fraction")
        g.done()
    top.done()
    return ModeSpec(name, ops["ops_per_layer"], ops["ops_per_step"], ops["lead_ops"], step_s, tuple(runs), fraction)


# ---------------------------------------------------------------- records -> YAML ----------------------------


def _quantity_dict(si: float, dimension: str, source: str, unit: str | None = None) -> dict:
    unit = unit or DISPLAY_UNIT[dimension]
    value = si / UNITS[dimension][unit]
    value = int(value) if dimension == "count" else float(f"{value:.12g}")
    return {"value": value, "unit": unit, "source": source}


def profile_to_yaml_dict(profile: HardwareProfile, sources: dict[str, str]) -> dict:
    """A `HardwareProfile` -> the YAML form that `profile_from_dict` reads back.

    `sources` maps dotted YAML field names (e.g. "gpu.hbm_peak_bandwidth", "link.h2d_bandwidth",
    "extra_tiers[0].latency") to their source text; "*" is the fallback for fields not listed.
    """

    def source(key: str) -> str:
        text = sources.get(key, sources.get("*"))
        if not isinstance(text, str) or not text.strip():
            raise ProfileError(f"profile {profile.name}: no source for {key}; pass sources[{key!r}] or sources['*']")
        return text

    g, h, lk, o = profile.gpu, profile.host, profile.link, profile.overheads
    data = {
        "name": profile.name,
        "description": profile.description,
        "provenance": dict(profile.provenance),
        "gpu": {
            "name": g.name,
            "hbm_capacity": _quantity_dict(g.hbm_capacity_bytes, "capacity", source("gpu.hbm_capacity")),
            "hbm_peak_bandwidth": _quantity_dict(g.hbm_peak_bytes_per_s, "bandwidth", source("gpu.hbm_peak_bandwidth")),
            "hbm_efficiency": _quantity_dict(g.hbm_efficiency, "ratio", source("gpu.hbm_efficiency")),
            "matmul_peak": _quantity_dict(g.matmul_peak_flops_per_s, "flops", source("gpu.matmul_peak")),
            "matmul_efficiency": _quantity_dict(g.matmul_efficiency, "ratio", source("gpu.matmul_efficiency")),
        },
        "host": {
            "ddr_capacity": _quantity_dict(h.ddr_capacity_bytes, "capacity", source("host.ddr_capacity")),
            "ddr_bandwidth": _quantity_dict(h.ddr_bytes_per_s, "bandwidth", source("host.ddr_bandwidth")),
        },
        "link": {
            "kind": lk.kind,
            "h2d_peak_bandwidth": _quantity_dict(lk.h2d_peak_bytes_per_s, "bandwidth", source("link.h2d_peak_bandwidth")),
            "d2h_peak_bandwidth": _quantity_dict(lk.d2h_peak_bytes_per_s, "bandwidth", source("link.d2h_peak_bandwidth")),
            "h2d_bandwidth": _quantity_dict(lk.h2d_bytes_per_s, "bandwidth", source("link.h2d_bandwidth")),
            "d2h_bandwidth": _quantity_dict(lk.d2h_bytes_per_s, "bandwidth", source("link.d2h_bandwidth")),
            "transfer_overhead": _quantity_dict(lk.transfer_overhead_s, "time", source("link.transfer_overhead")),
            "copy_engines": _quantity_dict(lk.copy_engines, "count", source("link.copy_engines")),
            "full_duplex": {"value": lk.full_duplex, "source": source("link.full_duplex")},
        },
        "overheads": {
            "step_overhead": _quantity_dict(o.step_overhead_s, "time", source("overheads.step_overhead")),
            "layer_overhead": _quantity_dict(o.layer_overhead_s, "time", source("overheads.layer_overhead")),
        },
    }
    if o.token_overhead_s:
        data["overheads"]["token_overhead"] = _quantity_dict(o.token_overhead_s, "time", source("overheads.token_overhead"))
    if o.has_cached:
        data["overheads"].update({
            "step_overhead_cached": _quantity_dict(o.step_overhead_cached_s, "time",
                                                   source("overheads.step_overhead_cached")),
            "layer_overhead_cached": _quantity_dict(o.layer_overhead_cached_s, "time",
                                                    source("overheads.layer_overhead_cached")),
            "cache_bytes": _quantity_dict(o.cache_bytes, "capacity", source("overheads.cache_bytes"), unit="MiB"),
        })
    transfer = _transfer_dict(profile.transfer, source)
    if transfer:
        data["transfer"] = transfer
    if profile.extra_tiers:
        data["extra_tiers"] = [
            {
                "name": t.name,
                "kind": t.kind,
                "capacity": _quantity_dict(t.capacity_bytes, "capacity", source(f"extra_tiers[{i}].capacity")),
                "bandwidth": _quantity_dict(t.bytes_per_s, "bandwidth", source(f"extra_tiers[{i}].bandwidth")),
                "latency": _quantity_dict(t.latency_s, "time", source(f"extra_tiers[{i}].latency")),
            }
            for i, t in enumerate(profile.extra_tiers)
        ]
    return data


def _transfer_dict(spec: TransferSpec, source) -> dict:
    """The optional `transfer:` section (only the fields the profile has)."""
    data = {}
    for key, attr, dimension, _limits in TRANSFER_FIELDS:
        value = getattr(spec, attr)
        if value is not None:
            data[key] = _quantity_dict(value, dimension, source(f"transfer.{key}"))
    if spec.copy_curves:
        data["copy_curve"] = {
            key: {"bytes": [int(b) if float(b).is_integer() else b for b in curve.bytes],
                  "time": list(curve.seconds), "time_unit": "s",  # seconds: the curve round-trips exactly
                  "source": source(f"transfer.copy_curve.{key}")}
            for key, curve in spec.copy_curves
        }
    return data
