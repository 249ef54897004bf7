"""Writing a measured profile: atomically, after reading it back through the schema; and its one-line summary."""

from __future__ import annotations

from pathlib import Path


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


def summary_line(profile) -> str:
    g, lk, o = profile.gpu, profile.link, profile.overheads
    return (f"{profile.name}: memory {g.hbm_bytes_per_s / 1e9:.1f} GB/s (copy peak {g.hbm_peak_bytes_per_s / 1e9:.1f}), "
            f"matmul {g.matmul_flops_per_s / 1e9:.1f} GFLOP/s, link h2d {lk.h2d_bytes_per_s / 1e9:.1f} GB/s "
            f"d2h {lk.d2h_bytes_per_s / 1e9:.1f} GB/s + {lk.transfer_overhead_s * 1e6:.1f} us/copy, "
            f"duplex={lk.full_duplex}, overhead {o.step_overhead_s * 1e6:.0f} us/step + "
            f"{o.layer_overhead_s * 1e6:.0f} us/layer"
            + (f" (weights in the {o.cache_bytes / 2**20:.0f} MiB last-level cache: {o.step_overhead_cached_s * 1e6:.0f} "
               f"us/step + {o.layer_overhead_cached_s * 1e6:.0f} us/layer)" if o.has_cached else ""))
