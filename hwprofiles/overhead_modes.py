"""Framework-overhead modes: what a decode step costs beyond its kernels and copies, and where it came from.

- `measured`: the overheads `thoughtkv calibrate` fitted on the machine itself (a measured CPU profile: the
  "GPU" is the host, so its calibrated per-step and per-layer overheads add to the kernels' time);
- `kernel-only`: none at all: kernel and copy time at the profile's datasheet efficiencies, a bound no
  framework decode loop reaches (label results so);
- `hf-eager`: a transformers eager decode loop (`generate`): the host issues ~36 ops per layer and ~32 per step
  at a cited cost per op, the GPU runs them as they come (`simulator/README.md`, "Host model");
- `cuda-graphs`: an engine that captures the decode step (vLLM, SGLang, gpt-fast): one launch per step, the GPU
  at the bandwidth such engines reach.

Each host mode's figures are in `hwprofiles/overheads/<mode>.yaml`, every number with its measured source (or
"assumed" and why), validated by `hwprofiles.schema.mode_from_dict`. The host's cost per eager op defaults to
the "cited" one (derived from published measured runs); `host_term=<measured profile>` uses the one
`thoughtkv calibrate` measured on that profile's host instead (`tracer/calibrate/host.py`). Every simulator
result row carries the mode (`overhead_mode`) and the host term (`host_term`).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

from hwprofiles.schema import HardwareProfile, HostModel, ModeSpec, OverheadSpec, ProfileError, mode_from_dict

OVERHEAD_MODES = ("measured", "kernel-only", "hf-eager", "cuda-graphs")
HOST_MODES = ("hf-eager", "cuda-graphs")  # the modes with a host model (datasheet GPU profiles)
GPU_TIME_MODE = "cuda-graphs"  # whose decode_hbm_fraction every host mode's GPU time uses (one home)
CITED = "cited"
MODES_DIR = Path(__file__).resolve().parent / "overheads"
BASE_EFFICIENCY_KEY = "hbm_efficiency_before_mode"  # provenance: the profile's own efficiency, before a mode
# Each mode in a few words, for tables and captions (the module docstring says more).
MODE_TEXT = {"measured": "measured (calibrated on the machine)",
             "kernel-only": "kernel-only (no framework overhead: a bound no decode loop reaches)",
             "hf-eager": "hf-eager (datasheet + a cited transformers-eager launch estimate)",
             "cuda-graphs": "cuda-graphs (one launch per captured step)"}


@cache
def load_mode(mode: str) -> ModeSpec:
    """The shipped figures of a host mode (hf-eager, cuda-graphs), validated."""
    from hwprofiles.loader import read_yaml_file

    path = MODES_DIR / f"{mode}.yaml"
    if mode not in HOST_MODES or not path.is_file():
        raise ProfileError(f"overhead mode {mode!r} has no figures file; the host modes are {', '.join(HOST_MODES)}")
    spec = mode_from_dict(read_yaml_file(path, what="an overhead mode"), str(path))
    if spec.name != mode:
        raise ProfileError(f"{path}: mode: {spec.name!r} differs from the file name; set `mode: {mode}`")
    return spec


def check_mode(mode: str | None) -> str | None:
    if mode is not None and mode not in OVERHEAD_MODES:
        raise ProfileError(f"--overhead-mode {mode!r}: use one of {', '.join(OVERHEAD_MODES)}")
    return mode


def mode_of(profile: HardwareProfile) -> str:
    """The overhead mode a profile charges as it is: set by `apply_mode`, else measured/kernel-only by kind."""
    given = profile.provenance.get("overhead_mode")
    if given:
        return given
    return "measured" if profile.provenance.get("kind") == "measured" else "kernel-only"


def measured_host_op_s(name: str, profiles_dir=None) -> float:
    """The host's cost per eager op that `thoughtkv calibrate` measured for the profile `name`
    (provenance.figures.host_op_s, written by tracer/calibrate/host.py)."""
    from hwprofiles.loader import load_profile

    figures = (load_profile(name, profiles_dir).provenance or {}).get("figures") or {}
    value = figures.get("host_op_s")
    if not isinstance(value, int | float) or not value > 0:
        raise ProfileError(f"--host-term {name}: that profile has no measured host cost per op "
                           "(provenance.figures.host_op_s); calibrate it again with `thoughtkv calibrate`, or use "
                           f"--host-term {CITED}")
    return float(value)


def host_model_for(mode: str, host_term: str | None = None, profiles_dir=None) -> HostModel:
    """The host model of a host mode, with the cited cost per op or the one measured on `host_term`'s host."""
    spec = load_mode(mode)
    term = host_term or CITED
    op_s = spec.op_s if term == CITED else measured_host_op_s(term, profiles_dir)
    if not (spec.ops_per_layer or spec.ops_per_step):
        op_s = 0.0  # nothing issued op by op (a captured step): the term names the host, it changes nothing
    return HostModel(ops_per_layer=spec.ops_per_layer, ops_per_step=spec.ops_per_step, lead_ops=spec.lead_ops,
                     op_s=op_s, step_s=spec.step_s, term=term)


def apply_mode(profile: HardwareProfile, mode: str | None, host_term: str | None = None,
               profiles_dir=None) -> HardwareProfile:
    """`profile` charging `mode` (None: as it is). kernel-only: no overheads and no host model (any profile);
    hf-eager / cuda-graphs: the mode's host model and its GPU time (a datasheet profile); measured: a measured
    profile as calibrated. `host_term` (hf-eager, cuda-graphs): "cited" (default) or a measured profile's name."""
    check_mode(mode)
    current = mode_of(profile)
    if mode is None:
        mode = current
        if mode not in HOST_MODES or host_term is None or host_term == profile.host_model.term:
            return profile
    elif mode == current and (mode not in HOST_MODES or (host_term or CITED) == profile.host_model.term):
        return profile
    if mode == "measured":
        raise ProfileError(f"--overhead-mode measured: {profile.name} is a datasheet profile with no measured "
                           "overheads; calibrate with `thoughtkv calibrate`, or use hf-eager / cuda-graphs / kernel-only")
    if mode in HOST_MODES and profile.provenance.get("kind") == "measured":
        raise ProfileError(f"--overhead-mode {mode}: {profile.name} is measured; its calibrated overheads are what "
                           "this machine's decode loop costs (use measured, or kernel-only)")
    base_efficiency = profile.provenance.get(BASE_EFFICIENCY_KEY, profile.gpu.hbm_efficiency)
    provenance = {key: value for key, value in profile.provenance.items() if key != BASE_EFFICIENCY_KEY}
    gpu = dataclasses.replace(profile.gpu, hbm_efficiency=base_efficiency)
    if mode == "kernel-only":
        host, source = HostModel(), "none: kernel and copy time only"
        provenance.pop("overheads_by_decoder", None)  # per-policy measured overheads would come back otherwise
    else:
        host = host_model_for(mode, host_term, profiles_dir)
        fraction = load_mode(GPU_TIME_MODE).decode_hbm_fraction
        gpu = dataclasses.replace(gpu, hbm_efficiency=base_efficiency * fraction)
        provenance[BASE_EFFICIENCY_KEY] = base_efficiency
        ops = (f"{host.ops_per_layer} ops/layer + {host.ops_per_step}/step x {host.op_s * 1e6:.1f} us/op + "
               if host.op_s else "")
        source = (f"{mode}: host {ops}{host.step_s * 1e6:.0f} us/step (host term {host.term}); GPU at "
                  f"{fraction:.3f} of the achievable HBM bandwidth (hwprofiles/overheads/{mode}.yaml)")
    provenance.update(overhead_mode=mode, overhead_mode_source=source)
    return dataclasses.replace(profile, gpu=gpu, overheads=OverheadSpec(), host_model=host, provenance=provenance)
