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
