"""hwprofiles: shipped profiles validate, bad profiles are refused with the right message, the loader only ever
raises ProfileError, and the CLI exits 0/2."""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwprofiles import (
    PROFILES_DIR,
    HardwareProfile,
    ProfileError,
    list_profiles,
    load_profile,
    load_profile_file,
    profile_to_yaml_dict,
    validate_profile_file,
)
from thoughtkv.cli import main
from thoughtkv_base import UserError

REQUIRED_NAMES = ["a100-80gb-pcie", "h100-pcie", "h100-sxm", "h200-sxm", "gh200-96gb", "gh200-144gb", "b200",
                  "mi300x", "rtx-4090", "l40s", "rtx-5080", "h100-sxm-cxl"]
SHIPPED_FILES = sorted(PROFILES_DIR.glob("*.yaml"))
BASE_FILE = PROFILES_DIR / "h100-sxm-cxl.yaml"  # the one with every optional section


def base_dict() -> dict:
    return yaml.safe_load(BASE_FILE.read_text())


def write_profile(directory: Path, data, name: str | None = None) -> Path:
    path = directory / f"{name or data['name']}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def numbers_in(node, prefix=""):
    """Every `{value, unit, source}` leaf of a raw profile dict, as (dotted name, leaf)."""
    if isinstance(node, dict) and "source" in node:
        yield prefix, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from numbers_in(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from numbers_in(value, f"{prefix}[{index}]")


# ---------------------------------------------------------------- shipped profiles ---------------------------


def test_all_required_profiles_ship():
    assert {p.name for p in list_profiles()} >= set(REQUIRED_NAMES)


@pytest.mark.parametrize("path", SHIPPED_FILES, ids=[p.stem for p in SHIPPED_FILES])
def test_shipped_profile_validates_and_cites_every_number(path: Path):
    profile = validate_profile_file(path)
    assert profile.name == path.stem and profile.provenance["kind"] in ("datasheet", "measured")
    raw = yaml.safe_load(path.read_text())
    leaves = list(numbers_in(raw))
    # gpu 5 + host 2 + link 7 + overheads 2 numbers, 3 per extra tier, one per transfer-mechanism parameter
    # and one per copy curve (a table with one source), each with a non-trivial source
    transfer = {k: v for k, v in raw.get("transfer", {}).items() if k != "copy_curve"}
    curves = raw.get("transfer", {}).get("copy_curve", {})
    assert len(leaves) == 16 + 3 * len(raw.get("extra_tiers", [])) + len(transfer) + len(curves)
    assert all(len(leaf["source"]) > 20 for _, leaf in leaves)
    # achievable never beats peak, and the link is far slower than HBM on every real machine
    assert profile.link.h2d_bytes_per_s <= profile.link.h2d_peak_bytes_per_s
    assert profile.link.h2d_peak_bytes_per_s * 5 < profile.gpu.hbm_peak_bytes_per_s


def test_si_conversion_against_raw_yaml():
    """Loader SI values equal the raw YAML numbers times the unit factors written out here."""
    factor = {"GB": 1e9, "TB/s": 1e12, "GB/s": 1e9, "TFLOP/s": 1e12, "us": 1e-6, "ratio": 1.0}
    raw = base_dict()
    p = load_profile("h100-sxm-cxl")

    def si(section, key):
        leaf = raw[section][key] if isinstance(section, str) else section[key]
        return leaf["value"] * factor[leaf["unit"]]

    assert p.gpu.hbm_capacity_bytes == si("gpu", "hbm_capacity") == 80e9
    assert p.gpu.hbm_bytes_per_s == pytest.approx(si("gpu", "hbm_peak_bandwidth") * si("gpu", "hbm_efficiency"))
    assert p.gpu.matmul_flops_per_s == pytest.approx(si("gpu", "matmul_peak") * si("gpu", "matmul_efficiency"))
    assert p.link.h2d_bytes_per_s == pytest.approx(si("link", "h2d_bandwidth"))
    assert p.link.transfer_overhead_s == pytest.approx(si("link", "transfer_overhead"))
    tier = raw["extra_tiers"][0]
    assert p.extra_tiers[0].latency_s == pytest.approx(si(tier, "latency"))
    assert p.extra_tiers[0].capacity_bytes == si(tier, "capacity")
    assert p.host.ddr_capacity_bytes == si("host", "ddr_capacity")


def test_binary_units_and_derived_properties(tmp_path):
    data = base_dict()
    data["gpu"]["hbm_capacity"].update(value=80, unit="GiB")
    data["gpu"]["hbm_peak_bandwidth"].update(value=3000, unit="GB/s")
    data["gpu"]["hbm_efficiency"]["value"] = 0.5
    data["link"]["transfer_overhead"].update(value=0.009, unit="ms")
    p = load_profile_file(write_profile(tmp_path, data))
    assert p.gpu.hbm_capacity_bytes == 80 * 1024**3
    assert p.gpu.hbm_bytes_per_s == pytest.approx(1.5e12)
    assert p.link.transfer_overhead_s == pytest.approx(9e-6)


def test_overheads_section_is_optional(tmp_path):
    data = base_dict()
    del data["overheads"], data["extra_tiers"]
    p = load_profile_file(write_profile(tmp_path, data))
    assert p.overheads.step_overhead_s == 0.0 and p.extra_tiers == ()


# ---------------------------------------------------------------- bad profiles -------------------------------


def _set(data: dict, dotted: str, value):
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value


DELETE = object()
BAD_PROFILES = [
    # (id, dotted field, new value, expected message fragment)
    ("missing-field", "gpu.hbm_capacity", DELETE, "gpu.hbm_capacity: missing field"),
    ("missing-section", "link", DELETE, "link: missing field"),
    ("typo", "gpu.hbm_capasity", {"value": 80, "unit": "GB", "source": "x"}, "did you mean `hbm_capacity`"),
    ("top-typo", "overhead", {}, "did you mean `overheads`"),
    ("missing-source", "gpu.hbm_peak_bandwidth.source", DELETE, "gpu.hbm_peak_bandwidth.source: missing"),
    ("empty-source", "host.ddr_capacity.source", "  ", "host.ddr_capacity.source: must name a document"),
    ("missing-unit", "gpu.hbm_capacity.unit", DELETE, "gpu.hbm_capacity.unit: missing"),
    ("extra-key", "gpu.matmul_peak.note", "x", "gpu.matmul_peak: unknown key 'note'"),
    ("bare-number", "gpu.hbm_capacity", 80, "gpu.hbm_capacity: must be a mapping"),
    ("wrong-dimension", "gpu.hbm_peak_bandwidth.unit", "GB", "'GB' is not a bandwidth unit"),
    ("unknown-unit", "link.h2d_bandwidth.unit", "Gbit/s", "'Gbit/s' is not a bandwidth unit"),
    ("string-value", "gpu.hbm_capacity.value", "80", "gpu.hbm_capacity.value: must be a number"),
    ("bool-value", "gpu.matmul_peak.value", True, "gpu.matmul_peak.value: must be a number"),
    ("infinite", "host.ddr_bandwidth.value", math.inf, "must be a finite number"),
    ("negative", "gpu.hbm_peak_bandwidth.value", -3.35, "gpu.hbm_peak_bandwidth: must be positive"),
    ("zero-capacity", "host.ddr_capacity.value", 0, "host.ddr_capacity: must be positive"),
    ("negative-overhead", "link.transfer_overhead.value", -1, "link.transfer_overhead: must be >= 0"),
    ("hbm-too-fast", "gpu.hbm_peak_bandwidth.value", 50, "gpu.hbm_peak_bandwidth: 50 TB/s is outside the plausible"),
    ("hbm-in-wrong-unit", "gpu.hbm_peak_bandwidth.unit", "MB/s", "outside the plausible range"),
    ("hbm-capacity-absurd", "gpu.hbm_capacity.value", 80000, "gpu.hbm_capacity: 80000 GB is outside"),
    ("efficiency-above-1", "gpu.hbm_efficiency.value", 1.2, "gpu.hbm_efficiency: 1.2 ratio is outside"),
    ("efficiency-zero", "gpu.matmul_efficiency.value", 0, "gpu.matmul_efficiency: must be positive"),
    ("link-faster-than-hbm", "link.h2d_peak_bandwidth.value", 3500, "is not below the HBM bandwidth"),
    ("achievable-above-peak", "link.d2h_bandwidth.value", 70, "d2h_bandwidth (70 GB/s) exceeds d2h_peak"),
    ("fractional-engines", "link.copy_engines.value", 1.5, "link.copy_engines.value: must be a whole number"),
    ("no-engines", "link.copy_engines.value", 0, "link.copy_engines: must be positive"),
    ("duplex-not-bool", "link.full_duplex.value", "yes", "link.full_duplex.value: must be true or false"),
    ("unknown-link-kind", "link.kind", "pcie7", "link.kind: unknown value 'pcie7'"),
    ("bad-name", "name", "H100 SXM", "must be lower-case"),
    ("no-provenance", "provenance", DELETE, "provenance: missing field"),
    ("bad-provenance", "provenance", {"kind": "guess"}, "provenance: must be a mapping with `kind:`"),
    ("tier-named-hbm", "extra_tiers.0.name", "hbm", "extra_tiers[0]: name: 'hbm' is used twice"),
    ("tier-kind", "extra_tiers.0.kind", "tape", "extra_tiers[0].kind: unknown value 'tape'"),
    ("tier-faster-than-hbm", "extra_tiers.0.bandwidth.value", 3400, "extra_tiers[0]: bandwidth: not below"),
    ("tiers-not-list", "extra_tiers", {"name": "x"}, "extra_tiers: must be a list"),
    ("overheads-typo", "overheads.step_overheads", {"value": 1, "unit": "us", "source": "x"}, "did you mean"),
]


@pytest.mark.parametrize("field, value, expected", [case[1:] for case in BAD_PROFILES],
                         ids=[case[0] for case in BAD_PROFILES])
def test_bad_profile_is_rejected_with_message(tmp_path, field, value, expected):
    data = base_dict()
    _set(data, field, value)
    path = write_profile(tmp_path, data, name="h100-sxm-cxl")
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    message = str(info.value)
    assert expected in message
    assert message.startswith(str(path)) and "\n" not in message


@pytest.mark.parametrize("text, expected", [
    ("gpu: [unclosed", "not valid YAML at line"),
    ("", "must be a mapping of fields, got NoneType"),
    ("- a\n- b\n", "must be a mapping of fields, got list"),
    ("!!python/object:os.system {}", "not valid YAML"),  # safe_load refuses object construction
], ids=["syntax", "empty", "list", "python-tag"])
def test_unreadable_file_is_rejected(tmp_path, text, expected):
    path = write_profile(tmp_path, text, name="x")
    with pytest.raises(ProfileError, match=expected):
        load_profile_file(path)


def test_file_name_must_match_profile_name(tmp_path):
    path = write_profile(tmp_path, base_dict(), name="my-gpu")
    with pytest.raises(ProfileError, match="differs from the file name"):
        load_profile_file(path)


# ---------------------------------------------------------------- search directories -------------------------


def test_user_profiles_dir_adds_profiles_and_refuses_duplicates(tmp_path):
    data = base_dict()
    data["name"] = "my-gpu"
    write_profile(tmp_path, data)
    assert load_profile("my-gpu", profiles_dir=tmp_path).name == "my-gpu"
    assert "my-gpu" in {p.name for p in list_profiles(tmp_path)}
    with pytest.raises(ProfileError, match="unknown hardware profile 'my-gpu'"):
        load_profile("my-gpu")  # not without the directory

    write_profile(tmp_path, base_dict())  # h100-sxm-cxl again, shadowing the shipped one
    with pytest.raises(ProfileError, match="'h100-sxm-cxl' is also defined in"):
        list_profiles(tmp_path)
    with pytest.raises(ProfileError, match="'h100-sxm-cxl' is also defined in"):
        load_profile("h100-sxm-cxl", profiles_dir=tmp_path)
    with pytest.raises(ProfileError, match="not a directory"):
        list_profiles(tmp_path / "missing")


def test_load_by_path(tmp_path):
    path = write_profile(tmp_path, base_dict())
    assert load_profile(str(path)).path == str(path)
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(str(tmp_path / "nope.yaml"))


# ---------------------------------------------------------------- writing (calibration) ----------------------


@pytest.mark.parametrize("name", ["h100-sxm-cxl", "gh200-96gb", "rtx-5080"])
def test_profile_to_yaml_dict_round_trips(tmp_path, name):
    original = load_profile(name)
    measured = dataclasses.replace(original, overheads=dataclasses.replace(original.overheads, step_overhead_s=2.5e-5),
                                   provenance={"kind": "measured", "date": "2026-11-30", "tool": "calibrate"})
    data = profile_to_yaml_dict(measured, {"*": "datasheet", "overheads.step_overhead": "measured: 200 decode steps"})
    assert data["overheads"]["step_overhead"]["source"] == "measured: 200 decode steps"
    loaded = load_profile_file(write_profile(tmp_path, data))
    for part in ("gpu", "host", "link", "overheads"):
        for f in dataclasses.fields(getattr(measured, part)):
            expected, actual = getattr(getattr(measured, part), f.name), getattr(getattr(loaded, part), f.name)
            assert actual == (pytest.approx(expected, rel=1e-9) if isinstance(expected, float) else expected), f.name
    assert [t.name for t in loaded.extra_tiers] == [t.name for t in measured.extra_tiers]
    assert loaded.provenance == measured.provenance


def test_profile_to_yaml_dict_needs_a_source_for_every_number():
    with pytest.raises(ProfileError, match="no source for gpu.hbm_capacity"):
        profile_to_yaml_dict(load_profile("h100-sxm"), {})


# ---------------------------------------------------------------- property: only ProfileError comes out ------

yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12),
                         st.sampled_from(["GB", "TB/s", "us", "ratio", "count", "pcie5", "source", "value"]))
yaml_trees = st.recursive(yaml_scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=5)), max_leaves=20)


def _only_profile_error(path: Path) -> None:
    try:
        profile = load_profile_file(path)
    except ProfileError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(profile, HardwareProfile)


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(text=st.text(max_size=300))
def test_random_text_only_raises_profile_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _only_profile_error(path)


@FAST
@given(tree=yaml_trees)
def test_random_yaml_only_raises_profile_error(tree):
    with tempfile.TemporaryDirectory() as tmp:
        _only_profile_error(write_profile(Path(tmp), yaml.safe_dump(tree), name="x"))


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


BASE = base_dict()
BASE_PATHS = [p for p in _paths(BASE) if p]


@FAST
@given(where=st.sampled_from(BASE_PATHS), replacement=yaml_trees)
def test_mutated_profile_only_raises_profile_error(where, replacement):
    data = copy.deepcopy(BASE)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = replacement
    with tempfile.TemporaryDirectory() as tmp:
        _only_profile_error(write_profile(Path(tmp), yaml.safe_dump(data), name="h100-sxm-cxl"))


def test_profile_error_is_a_user_error():
    assert issubclass(ProfileError, UserError)


# ---------------------------------------------------------------- CLI ----------------------------------------


def test_cli_list_and_show(capsys):
    assert main(["profiles", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in REQUIRED_NAMES)
    assert main(["profiles", "show", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "gpu.hbm_peak_bandwidth = 3.35 TB/s" in out and "H100 Tensor Core GPU datasheet" in out


def test_cli_validate_exit_codes(tmp_path, capsys):
    good = [str(p) for p in SHIPPED_FILES]
    assert main(["profiles", "validate", *good]) == 0
    assert capsys.readouterr().out.count("ok ") == len(good)

    data = base_dict()
    data["name"] = "broken"
    data["gpu"]["hbm_efficiency"]["value"] = 2
    bad = write_profile(tmp_path, data)
    assert main(["profiles", "validate", good[0], str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpu.hbm_efficiency" in err[0]

    shadow = write_profile(tmp_path, base_dict())  # same name as a shipped profile
    assert main(["profiles", "validate", str(shadow)]) == 2
    assert "already a shipped profile" in capsys.readouterr().err


def test_cli_unknown_profile_is_one_line_exit_2(capsys):
    assert main(["profiles", "show", "no-such-gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown hardware profile 'no-such-gpu'" in err and "\n" not in err


def test_cli_module_does_not_import_torch():
    code = "import sys, hwprofiles, hwprofiles.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _cpu_profile() -> HardwareProfile:
    """What `thoughtkv calibrate --device cpu` measures on a small machine: the "GPU" is the CPU and its RAM."""
    from hwprofiles import GPUSpec, HostSpec, LinkSpec, OverheadSpec

    return HardwareProfile(
        name="cpu-local", description="2-core CPU",
        gpu=GPUSpec("cpu", 24 * 2**30, 12e9, 0.6, 8e10, 1.0), host=HostSpec(24 * 2**30, 9e9),
        link=LinkSpec("host", 14e9, 14e9, 9e9, 9e9, 2e-6, 1, False),
        overheads=OverheadSpec(3e-4, 5e-5),
        provenance={"kind": "measured", "series": {"copy_h2d": {"x": [1, 2, 3], "time_s": [0.1, 0.2, 0.3]}}},
    )


def test_measured_cpu_profile_is_accepted_only_as_link_kind_host(tmp_path, capsys):
    profile = _cpu_profile()
    path = write_profile(tmp_path, profile_to_yaml_dict(profile, {"*": "measured"}))
    loaded = load_profile_file(path)
    assert loaded.gpu.hbm_bytes_per_s == pytest.approx(12e9 * 0.6) and loaded.link.kind == "host"
    assert loaded.provenance == profile.provenance
    assert main(["profiles", "show", str(path)]) == 0
    assert "provenance.series.copy_h2d.x = [1, 2, 3]" in capsys.readouterr().out

    as_gpu = dataclasses.replace(profile, link=dataclasses.replace(profile.link, kind="pcie4"))
    path = write_profile(tmp_path, profile_to_yaml_dict(as_gpu, {"*": "measured"}))
    with pytest.raises(ProfileError, match="gpu.hbm_peak_bandwidth: 12.0 GB/s is outside the plausible range"):
        load_profile_file(path)


# ---------------------------------------------------------------- cached overheads ---------------------------


def _cpu_profile_with_cached():
    from hwprofiles import OverheadSpec

    return dataclasses.replace(_cpu_profile(), overheads=OverheadSpec(1.3e-3, 7.2e-4, 2.75e-4, 3.9e-4, 32 * 2**20))


def test_cached_overheads_round_trip(tmp_path):
    profile = _cpu_profile_with_cached()
    data = profile_to_yaml_dict(profile, {"*": "measured", "overheads.cache_bytes": "measured: sysfs index3/size"})
    assert data["overheads"]["cache_bytes"] == {"value": 32.0, "unit": "MiB", "source": "measured: sysfs index3/size"}
    loaded = load_profile_file(write_profile(tmp_path, data))
    assert loaded.overheads.has_cached
    for name in ("step_overhead_s", "layer_overhead_s", "step_overhead_cached_s", "layer_overhead_cached_s"):
        assert getattr(loaded.overheads, name) == pytest.approx(getattr(profile.overheads, name), rel=1e-11)
    assert loaded.overheads.cache_bytes == 32 * 2**20


def test_profiles_without_cached_overheads_keep_none():
    for path in SHIPPED_FILES:
        o = load_profile_file(path).overheads
        assert not o.has_cached and o.step_overhead_cached_s is None and o.layer_overhead_cached_s is None


@pytest.mark.parametrize("keep", [("step_overhead_cached",), ("cache_bytes",),
                                  ("step_overhead_cached", "layer_overhead_cached"),
                                  ("layer_overhead_cached", "cache_bytes")])
def test_cached_overheads_are_all_three_or_none(tmp_path, keep):
    data = profile_to_yaml_dict(_cpu_profile_with_cached(), {"*": "measured"})
    for key in ("step_overhead_cached", "layer_overhead_cached", "cache_bytes"):
        if key not in keep:
            del data["overheads"][key]
    path = write_profile(tmp_path, data)
    with pytest.raises(ProfileError) as err:
        load_profile_file(path)
    message = str(err.value)
    assert "\n" not in message and "overheads:" in message and "all three" in message
    missing = [k for k in ("step_overhead_cached", "layer_overhead_cached", "cache_bytes") if k not in keep]
    assert f"add `{missing[0]}:`" in message


def test_cached_overheads_need_units_and_plausible_cache_size(tmp_path):
    data = profile_to_yaml_dict(_cpu_profile_with_cached(), {"*": "measured"})
    data["overheads"]["cache_bytes"] = {"value": 32, "unit": "B", "source": "a unit mistake"}
    with pytest.raises(ProfileError, match="overheads.cache_bytes: 32 B is outside the plausible range"):
        load_profile_file(write_profile(tmp_path, data))
    data["overheads"]["cache_bytes"] = {"value": 32, "unit": "us", "source": "wrong dimension"}
    with pytest.raises(ProfileError, match="overheads.cache_bytes.unit: 'us' is not a capacity unit"):
        load_profile_file(write_profile(tmp_path, data))


def test_overhead_spec_refuses_a_partial_cached_set():
    from hwprofiles import OverheadSpec

    with pytest.raises(ValueError, match="all three or none"):
        OverheadSpec(1e-3, 1e-4, step_overhead_cached_s=1e-4)
    assert not OverheadSpec(1e-3, 1e-4).has_cached
