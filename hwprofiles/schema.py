"""Hardware profile schema: the YAML form of the records in `hwprofiles.records` (SI units), read and written.

In YAML every number is a mapping `{value: ..., unit: ..., source: "..."}` with an explicit unit and a source
(datasheet name, paper, or the assumption it rests on). In Python everything is SI: bytes, seconds, B/s,
FLOP/s. `profile_from_dict` turns the YAML form into a `HardwareProfile`, checking on the way every field that
can be wrong (missing, unknown/typo, wrong unit, missing source, non-positive or absurd value) and raising
`ProfileError` with a one-line message naming the file and the field. `profile_to_yaml_dict` is the inverse,
so that calibration can write a measured profile. Both walk one table of fields per section (`GPU_FIELDS`,
...): a field's YAML key, record attribute, dimension and limits are written once.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from hwprofiles.records import (  # noqa: F401  (re-exported: the records' public home is this module too)
    COPY_CURVE_KEYS,
    CopyCurve,
    GPUSpec,
    HardwareProfile,
    HostModel,
    HostSpec,
    LinkSpec,
    MeasuredRun,
    ModeSpec,
    OverheadSpec,
    TierSpec,
    TransferSpec,
)
from thoughtkv_base import UserError


class ProfileError(UserError):
    """A hardware profile that is missing, unreadable or fails validation (one-line message, exit 2)."""


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


# ---------------------------------------------------------------- the YAML reader ---------------------------


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


# ---------------------------------------------------------------- the field tables ---------------------------


@dataclass(frozen=True)
class Field:
    """One field of a YAML section and the record attribute it fills: `_read_fields` parses it, `_dump_fields`
    writes it back. `dimension` is a key of UNITS (a `{value, unit, source}` number; capacities are rounded to
    whole bytes, counts must be whole), "text" (a bare string, one of `choices` if given) or "flag"
    (`{value: true|false, source}`)."""

    key: str
    attr: str
    dimension: str
    limits: tuple[float, float] = (0.0, 0.0)  # SI, inclusive
    positive: bool = True  # a number must be > 0 (else >= 0)
    cpu_limits: tuple[float, float] | None = None  # the limits when the "GPU" is the CPU (link kind "host")
    choices: tuple[str, ...] | None = None
    required: bool = True  # False: an absent number reads as 0
    unit: str | None = None  # the unit the dump writes (default: DISPLAY_UNIT of the dimension)
    omit_zero: bool = False  # the dump leaves a 0 out (it reads back as 0)
    group: str = ""  # fields that come together (all or none; absent: the record's default None)


RATIO = (0.0, 1.0)  # an efficiency: achievable / peak, in (0, 1]
GPU_FIELDS = (
    Field("name", "name", "text"),
    Field("hbm_capacity", "hbm_capacity_bytes", "capacity", HBM_CAPACITY_BYTES),
    Field("hbm_peak_bandwidth", "hbm_peak_bytes_per_s", "bandwidth", HBM_BYTES_PER_S,
          cpu_limits=CPU_DEVICE_BYTES_PER_S),
    Field("hbm_efficiency", "hbm_efficiency", "ratio", RATIO),
    Field("matmul_peak", "matmul_peak_flops_per_s", "flops", MATMUL_FLOPS_PER_S, cpu_limits=CPU_DEVICE_FLOPS_PER_S),
    Field("matmul_efficiency", "matmul_efficiency", "ratio", RATIO),
)
HOST_FIELDS = (
    Field("ddr_capacity", "ddr_capacity_bytes", "capacity", DDR_CAPACITY_BYTES),
    Field("ddr_bandwidth", "ddr_bytes_per_s", "bandwidth", DDR_BYTES_PER_S),
)
LINK_FIELDS = (
    Field("kind", "kind", "text", choices=LINK_KINDS),  # first: the GPU's limits depend on it
    Field("h2d_peak_bandwidth", "h2d_peak_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("d2h_peak_bandwidth", "d2h_peak_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("h2d_bandwidth", "h2d_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("d2h_bandwidth", "d2h_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("transfer_overhead", "transfer_overhead_s", "time", TRANSFER_OVERHEAD_S, positive=False),
    Field("copy_engines", "copy_engines", "count", COPY_ENGINES),
    Field("full_duplex", "full_duplex", "flag"),
)
# The required sections, in the order the YAML form writes them: (key, record class, fields).
SECTIONS = (("gpu", GPUSpec, GPU_FIELDS), ("host", HostSpec, HOST_FIELDS), ("link", LinkSpec, LINK_FIELDS))
# The optional `overheads:` section; the "cached" group is the last-level-cache set (OverheadSpec).
OVERHEAD_FIELDS = (
    Field("step_overhead", "step_overhead_s", "time", OVERHEAD_S, positive=False, required=False),
    Field("layer_overhead", "layer_overhead_s", "time", OVERHEAD_S, positive=False, required=False),
    Field("token_overhead", "token_overhead_s", "time", OVERHEAD_S, positive=False, required=False, omit_zero=True),
    Field("step_overhead_cached", "step_overhead_cached_s", "time", OVERHEAD_S, positive=False, group="cached"),
    Field("layer_overhead_cached", "layer_overhead_cached_s", "time", OVERHEAD_S, positive=False, group="cached"),
    Field("cache_bytes", "cache_bytes", "capacity", CACHE_BYTES, unit="MiB", group="cached"),
)
CACHED_OVERHEAD_FIELDS = tuple(f.key for f in OVERHEAD_FIELDS if f.group == "cached")
# The optional `transfer:` section (every field optional; an absent one stays None).
TRANSFER_FIELDS = (
    Field("sm_copy_h2d_bandwidth", "sm_copy_h2d_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("sm_copy_d2h_bandwidth", "sm_copy_d2h_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("sm_copy_sm_share", "sm_copy_sm_share", "ratio", (0.0, 0.5)),
    Field("sm_copy_overhead", "sm_copy_overhead_s", "time", TRANSFER_OVERHEAD_S, positive=False),
    Field("zero_copy_bandwidth", "zero_copy_bytes_per_s", "bandwidth", LINK_BYTES_PER_S),
    Field("zero_copy_latency", "zero_copy_latency_s", "time", TRANSFER_OVERHEAD_S, positive=False),
    Field("host_attention_flops", "host_attention_flops_per_s", "flops", CPU_DEVICE_FLOPS_PER_S),
)
# One entry of the optional `extra_tiers:` list.
TIER_FIELDS = (
    Field("name", "name", "text"),
    Field("kind", "kind", "text", choices=TIER_KINDS),
    Field("capacity", "capacity_bytes", "capacity", TIER_CAPACITY_BYTES),
    Field("bandwidth", "bytes_per_s", "bandwidth", TIER_BYTES_PER_S),
    Field("latency", "latency_s", "time", TIER_LATENCY_S, positive=False),
)


def _read(s: _Section, f: Field, cpu_device: bool = False) -> Any:
    if f.dimension == "text":
        return s.text(f.key, f.choices)
    if f.dimension == "flag":
        return s.flag(f.key)
    if f.dimension == "count":
        return s.count(f.key, f.limits, positive=f.positive)
    limits = f.cpu_limits if cpu_device and f.cpu_limits else f.limits
    si = s.quantity(f.key, f.dimension, limits, positive=f.positive, required=f.required)
    return round(si) if f.dimension == "capacity" else si


def _read_fields(s: _Section, fields: tuple[Field, ...], cpu_device: bool = False,
                 only_present: bool = False) -> dict[str, Any]:
    """`fields` of section `s` -> {record attribute: value}, read in table order (so the first bad field is the
    one reported). `only_present`: skip the keys `s` lacks (they are not "known fields" in a typo's hint)."""
    return {f.attr: _read(s, f, cpu_device) for f in fields if not only_present or f.key in s.data}


def _dump_fields(record: Any, fields: tuple[Field, ...], source, prefix: str) -> dict:
    """The inverse of `_read_fields`: `record`'s fields in table order, each number with `source(prefix.key)`;
    a None (an absent optional field) and an `omit_zero` 0 are left out."""
    data = {}
    for f in fields:
        value = getattr(record, f.attr)
        if value is None or f.omit_zero and not value:
            continue
        if f.dimension == "text":
            data[f.key] = value
        elif f.dimension == "flag":
            data[f.key] = {"value": value, "source": source(f"{prefix}.{f.key}")}
        else:
            data[f.key] = _quantity_dict(value, f.dimension, source(f"{prefix}.{f.key}"), f.unit)
    return data


# ---------------------------------------------------------------- YAML -> records ----------------------------


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
    cpu_device = _read(lk, LINK_FIELDS[0]) == "host"
    records = {}
    for key, record, fields in SECTIONS:
        s = lk if key == "link" else top.section(key)
        records[key] = record(**_read_fields(s, fields, cpu_device))
        s.done()
    gpu, host, link = records["gpu"], records["host"], records["link"]
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
        present = [key for key in CACHED_OVERHEAD_FIELDS if key in o.data]
        if present and len(present) < len(CACHED_OVERHEAD_FIELDS):
            missing = [key for key in CACHED_OVERHEAD_FIELDS if key not in o.data]
            o.fail(f"{', '.join(present)} without {', '.join(missing)}: the cached overheads need all three of "
                   f"{', '.join(CACHED_OVERHEAD_FIELDS)}; add `{missing[0]}:` or remove {', '.join(present)}")
        cached = _read_fields(o, tuple(f for f in OVERHEAD_FIELDS if f.group)) if present else {}
        overheads = OverheadSpec(**_read_fields(o, tuple(f for f in OVERHEAD_FIELDS if not f.group)), **cached)
        o.done()
    transfer = _parse_transfer(top.section("transfer", required=False), link, host)
    top.done()
    return HardwareProfile(name=name, description=description, gpu=gpu, host=host, link=link,
                           extra_tiers=extra_tiers, overheads=overheads, transfer=transfer,
                           provenance=dict(provenance), path=file)


COPY_CURVE_POINTS = (2, 256)
COPY_CURVE_BYTES = (1.0, 1e12)


def _parse_transfer(t: _Section | None, link: LinkSpec, host: HostSpec) -> TransferSpec:
    if t is None:
        return TransferSpec()
    values = _read_fields(t, TRANSFER_FIELDS, only_present=True)
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
        tier = TierSpec(**_read_fields(t, TIER_FIELDS))
        t.done()
        if tier.name in names or tier.name in ("hbm", "ddr"):
            t.fail(f"name: {tier.name!r:.40} is used twice (hbm and ddr are taken); give each tier its own name")
        if tier.bytes_per_s >= gpu.hbm_peak_bytes_per_s:
            t.fail("bandwidth: not below the HBM bandwidth; an extra tier faster than HBM is a unit mistake")
        names.add(tier.name)
        tiers.append(tier)
    return tuple(tiers)


# ---------------------------------------------------------------- overhead modes (YAML -> records) ----------


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

    data = {"name": profile.name, "description": profile.description, "provenance": dict(profile.provenance)}
    for key, _record, fields in SECTIONS:
        data[key] = _dump_fields(getattr(profile, key), fields, source, key)
    data["overheads"] = _dump_fields(profile.overheads, OVERHEAD_FIELDS, source, "overheads")
    transfer = _transfer_dict(profile.transfer, source)
    if transfer:
        data["transfer"] = transfer
    if profile.extra_tiers:
        data["extra_tiers"] = [_dump_fields(t, TIER_FIELDS, source, f"extra_tiers[{i}]")
                               for i, t in enumerate(profile.extra_tiers)]
    return data


def _transfer_dict(spec: TransferSpec, source) -> dict:
    """The optional `transfer:` section (only the fields the profile has)."""
    data = _dump_fields(spec, TRANSFER_FIELDS, source, "transfer")
    if spec.copy_curves:
        data["copy_curve"] = {
            key: {"bytes": [int(b) if float(b).is_integer() else b for b in curve.bytes],
                  "time": list(curve.seconds), "time_unit": "s",  # seconds: the curve round-trips exactly
                  "source": source(f"transfer.copy_curve.{key}")}
            for key, curve in spec.copy_curves
        }
    return data
