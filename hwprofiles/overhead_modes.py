"""Framework-overhead modes: what per-step and per-layer overhead a profile charges, and where it came from.

- `measured`: the overheads `thoughtkv calibrate` fitted on the machine itself (measured profiles);
- `kernel-only`: none at all — datasheet GPU profiles as written: kernel and copy time only, a bound no
  framework decode loop reaches (label results so);
- `hf-eager`: datasheet profiles plus an estimate of a transformers eager decode loop's launch cost:
  launches per layer and per step (counted by tracer/calibrate/launches.py) x a cited cost per launch, from
  `hwprofiles/overheads/hf-eager.yaml` (its comments say what the estimate leaves out).

Every simulator result row and figure caption carries the mode it was computed with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from hwprofiles.schema import ProfileError

OVERHEAD_MODES = ("measured", "kernel-only", "hf-eager")
ESTIMATES_DIR = Path(__file__).resolve().parent / "overheads"
UNIT_TO_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class LaunchEstimate:
    launches_per_layer: int
    launches_per_step: int
    launch_overhead_s: float
    sources: dict

    @property
    def layer_overhead_s(self) -> float:
        return self.launches_per_layer * self.launch_overhead_s

    @property
    def step_overhead_s(self) -> float:
        return self.launches_per_step * self.launch_overhead_s


def load_estimate(mode: str = "hf-eager") -> LaunchEstimate:
    """The shipped estimate for `mode` (only hf-eager has one); every number must cite its source."""
    path = ESTIMATES_DIR / f"{mode}.yaml"
    if not path.is_file():
        raise ProfileError(f"overhead mode {mode!r} has no estimate file; use one of {', '.join(OVERHEAD_MODES)}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    try:
        fields = {name: data[name] for name in ("launches_per_layer", "launches_per_step", "launch_overhead")}
        if not all(isinstance(f, dict) and str(f.get("source", "")).strip() for f in fields.values()):
            raise KeyError("source")
        unit = fields["launch_overhead"].get("unit", "s")
        return LaunchEstimate(
            launches_per_layer=int(fields["launches_per_layer"]["value"]),
            launches_per_step=int(fields["launches_per_step"]["value"]),
            launch_overhead_s=float(fields["launch_overhead"]["value"]) * UNIT_TO_S[unit],
            sources={name: f["source"] for name, f in fields.items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: every field needs value and source ({exc}); see its comments") from None


def check_mode(mode: str | None) -> str | None:
    if mode is not None and mode not in OVERHEAD_MODES:
        raise ProfileError(f"--overhead-mode {mode!r}: use one of {', '.join(OVERHEAD_MODES)}")
    return mode


def mode_of(profile) -> str:
    """The overhead mode a profile charges as it is: set by `apply_mode`, else measured/kernel-only by kind."""
    given = profile.provenance.get("overhead_mode")
    if given:
        return given
    return "measured" if profile.provenance.get("kind") == "measured" else "kernel-only"


def apply_mode(profile, mode: str | None):
    """`profile` charging `mode`'s framework overheads (None: as it is). kernel-only zeroes them (any profile);
    hf-eager adds the cited launch estimate to a datasheet profile; measured needs a measured profile."""
    import dataclasses

    from hwprofiles.schema import OverheadSpec

    check_mode(mode)
    if mode is None or mode == mode_of(profile):
        return profile
    if mode == "measured":
        raise ProfileError(f"--overhead-mode measured: {profile.name} is a datasheet profile with no measured "
                           "overheads; calibrate with `thoughtkv calibrate`, or use hf-eager / kernel-only")
    if mode == "hf-eager" and profile.provenance.get("kind") == "measured":
        raise ProfileError(f"--overhead-mode hf-eager: {profile.name} is measured; its calibrated overheads are "
                           "what this machine's decode loop costs (use measured, or kernel-only)")
    if mode == "kernel-only":
        overheads, source = OverheadSpec(), "none: kernel and copy time only"
    else:
        estimate = load_estimate("hf-eager")
        overheads = OverheadSpec(step_overhead_s=estimate.step_overhead_s, layer_overhead_s=estimate.layer_overhead_s)
        source = (f"hf-eager estimate: {estimate.launches_per_layer} launches/layer + {estimate.launches_per_step}"
                  f"/step x {estimate.launch_overhead_s * 1e6:.1f} us (hwprofiles/overheads/hf-eager.yaml)")
    provenance = {**profile.provenance, "overhead_mode": mode, "overhead_mode_source": source}
    if mode == "kernel-only":
        provenance.pop("overheads_by_decoder", None)  # per-policy measured overheads would come back otherwise
    return dataclasses.replace(profile, overheads=overheads, provenance=provenance)
