"""Grid files: a validated YAML mapping -> the cross product of its axes as cells (GRID_KEYS: the keys each
kind accepts)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from simulator.options import Projection, ServingConfig, SimOptions, grid_keys
from simulator.sweep.cells import CollectCell, ServeCell, SimulateCell, SweepError
from thoughtkv_base import UserError

# Keys each kind accepts; a list value is an axis (every value crossed with every other axis). The option keys
# are the fields of SimOptions / ServingConfig (the flags of `simulate` / `serve-sim`, with _ for -).
SERVE_OPTION_EXCLUDE = ("batch", "engine", "arrivals_csv")  # serving batches itself; arrivals: a CLI file
GRID_KEYS: dict[str, dict[str, str]] = {
    "simulate": {
        "runs": "trace run directories (relative to the grid file); list or one path",
        "profiles": "hardware profile names, or `all` (every profile not calibrated under contention)",
        "what_if": "mapping of what-if axes (e.g. budget: [0.1, 0.3]); omit to replay as traced",
        **grid_keys(SimOptions),
        **grid_keys(Projection),
    },
    "serve": {
        "runs": "trace run directories (relative to the grid file)",
        "profiles": "hardware profile names, or `all` (every profile not calibrated under contention)",
        **grid_keys(ServingConfig, exclude=SERVE_OPTION_EXCLUDE),
        **grid_keys(SimOptions, exclude=SERVE_OPTION_EXCLUDE),
        **grid_keys(Projection),
    },
    "collect": {
        "trace_args": "mapping of `thoughtkv trace` flags (without --) to a value or a list of values",
        "gpus_per_task": "GPUs a Ray task asks for (e.g. 1); the local executor ignores it",
    },
}
COMMON_KEYS = {"kind": "simulate | serve | collect", "description": "free text"}


@dataclass(frozen=True)
class Grid:
    kind: str
    cells: list
    source: str


def load_grid(path: str | Path, out_dir: str | Path | None = None) -> Grid:
    """Read and validate a grid YAML file; relative run paths are relative to the file."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"grid file {path} not found; pass an existing YAML file to --grid")
    from hwprofiles.loader import read_yaml_file

    data = read_yaml_file(path, SweepError, "a sweep grid")  # bounded: size, expanded aliases
    return grid_from_dict(data, base_dir=path.parent, where=str(path), out_dir=out_dir)


def grid_from_dict(data: Any, base_dir: Path, where: str, out_dir: str | Path | None = None) -> Grid:
    if not isinstance(data, dict):
        raise SweepError(f"{where}: the grid must be a mapping of keys to values or lists")
    kind = data.get("kind", "simulate")
    if kind not in GRID_KEYS:
        raise SweepError(f"{where}: kind {kind!r} is unknown; use one of {', '.join(GRID_KEYS)}")
    allowed = {**COMMON_KEYS, **GRID_KEYS[kind]}
    for key in data:
        if key not in allowed:
            raise SweepError(f"{where}: unknown key {key!r} for kind {kind}; allowed: {', '.join(allowed)}")
    for key, value in data.items():
        _check_axis(where, key, value)
    if kind == "collect":
        cells = _collect_cells(data, base_dir, where, out_dir)
    else:
        cells = _simulation_cells(kind, data, base_dir, where)
    return Grid(kind=kind, cells=cells, source=where)


def _check_axis(where: str, key: str, value: Any) -> None:
    if isinstance(value, list) and not value:
        raise SweepError(f"{where}: axis {key!r} is empty; give at least one value or remove the key")
    if isinstance(value, list):  # a value twice would be the same cells twice (run_sweep refuses those too)
        seen = []
        for item in value:
            text = json.dumps(item, sort_keys=True, default=str)
            if text in seen:
                raise SweepError(f"{where}: axis {key!r} lists {item!r} twice; remove the duplicate")
            seen.append(text)
    if isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _check_axis(where, f"{key}.{sub_key}", sub_value)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _simulation_cells(kind: str, data: dict, base_dir: Path, where: str) -> list:
    """The cross product of the grid's axes, every cell validated (options, serving config, what-if against
    its run) before any runs: a bad value anywhere fails the whole grid in one line."""
    from hwprofiles import load_profile
    from hwprofiles.loader import default_profiles

    if "runs" not in data or "profiles" not in data:
        raise SweepError(f"{where}: a {kind} grid needs `runs:` and `profiles:`; add them")
    runs = [_resolve_run(base_dir, run, where) for run in _as_list(data["runs"])]
    profiles = _as_list(data["profiles"])
    if profiles == ["all"]:  # as --all-profiles: profiles calibrated under contention only when named
        profiles = [p.name for p in default_profiles()[0]]
    loaded = {name: load_profile(name) for name in profiles}  # unknown profile -> ProfileError (one line)
    option_names = [f.name for f in fields(SimOptions) if f.name in data]
    config_names = [f.name for f in fields(ServingConfig) if f.name in data] if kind == "serve" else []
    projection_names = [f.name for f in fields(Projection) if f.name in data]
    what_ifs = _what_if_combinations(data.get("what_if"), where) if kind == "simulate" else [()]
    cells = []
    checks = CellChecks()  # each distinct check once: a run is opened once, a what-if parsed once per run
    opened = {}
    for run_dir in runs:
        try:
            opened[run_dir] = _open_with_samples(run_dir)
        except UserError as exc:
            raise SweepError(f"{where}: run {Path(run_dir).name}: {exc}") from None
    for run_dir, profile, what_if, option_values, config_values, projection_values in itertools.product(
            runs, profiles, what_ifs, _combinations(data, option_names), _combinations(data, config_names),
            _combinations(data, projection_names)):
        try:
            options = SimOptions(**option_values)
            projection = Projection(**projection_values)
            checks.check(opened[run_dir], loaded[profile], options, what_if)
            if kind == "simulate":
                cells.append(SimulateCell(run_dir=run_dir, profile=profile, options=options, what_if=what_if,
                                          projection=projection))
            else:
                cells.append(ServeCell(run_dir=run_dir, profile=profile,
                                       config=ServingConfig(**config_values, options=options, projection=projection)))
        except UserError as exc:
            cell = _describe_cell(run_dir, profile, what_if, option_values, config_values, projection_values)
            raise SweepError(f"{where}: {cell}: {exc}") from None
    return cells


def _combinations(data: dict, names: list[str]) -> list[dict]:
    return [dict(zip(names, values)) for values in itertools.product(*(_as_list(data[n]) for n in names))]


def _describe_cell(run_dir: str, profile: str, what_if: tuple, *values: dict) -> str:
    parts = [f"run {Path(run_dir).name}", f"profile {profile}"]
    parts += [f"{k}={v!r}" for k, v in what_if]
    parts += [f"{k}={v!r}" for d in values for k, v in d.items()]
    return "cell " + ", ".join(parts)


def _open_with_samples(run_dir: str):
    """The run, opened once for every cell that replays it; refused when it has no committed sample."""
    from traces.reader import open_run

    run = open_run(run_dir)
    if not run.sample_ids():
        raise SweepError(f"{run.path}: no committed samples to simulate; let the trace run finish (or resume it)")
    return run


class CellChecks:
    """What simulate_run / simulate_serving check before they work, for each cell of a grid (its run opened once
    by `_open_with_samples`): the what-if against its traced policy, the offload tier on the profile, layer-prefetch
    against the recall rule. Each part depends on a few of the cell's axes, so each distinct part is checked once:
    a grid crosses them (10,000 cells from 4 runs x 14 profiles x 200 what-ifs)."""

    def __init__(self) -> None:
        self.configs: dict[tuple, object] = {}  # (run, what-if) -> the placement it replays
        self.done: set[tuple] = set()

    def check(self, run, profile, options: SimOptions, what_if: tuple) -> None:
        from simulator.simulate import check_prefetch
        from simulator.tiers import tier_chain
        from simulator.whatif import parse_what_if, traced_config, what_if_config

        placement = (str(run.path), what_if)
        if placement not in self.configs:
            policy = run.manifest["policy"]
            self.configs[placement] = (what_if_config(policy, parse_what_if(dict(what_if))) if what_if
                                       else traced_config(policy))
        if ("tier", profile.name, options.offload_tier) not in self.done:
            tier_chain(profile, options.offload_tier)  # a tier, or a spill chain ddr+TIER
            self.done.add(("tier", profile.name, options.offload_tier))
        if options.overlap == "layer-prefetch" and ("prefetch", placement) not in self.done:
            check_prefetch(run, self.configs[placement], bool(what_if))
            self.done.add(("prefetch", placement))


def _what_if_combinations(spec: Any, where: str) -> list[tuple]:
    if spec is None:
        return [()]
    if not isinstance(spec, dict):
        raise SweepError(f"{where}: what_if must be a mapping like {{budget: [0.1, 0.3], block: [16]}}")
    names = sorted(spec)
    return [tuple(zip(names, values)) for values in itertools.product(*(_as_list(spec[n]) for n in names))]


def _resolve_run(base_dir: Path, run: Any, where: str) -> str:
    if not isinstance(run, str):
        raise SweepError(f"{where}: runs must be paths (strings), got {run!r}")
    path = (base_dir / run).resolve()
    if not (path / "run.json").is_file():
        raise SweepError(f"{where}: {path} is not a trace run (no run.json); fix the path in `runs:`")
    return str(path)


def _collect_cells(data: dict, base_dir: Path, where: str, out_dir: str | Path | None) -> list:
    args = data.get("trace_args")
    if not isinstance(args, dict) or not args:
        raise SweepError(f"{where}: a collect grid needs `trace_args:` (flags of `thoughtkv trace`); add it")
    if "out" in args:
        raise SweepError(f"{where}: trace_args must not set `out`; each cell writes under the sweep's --out")
    gpus = data.get("gpus_per_task", 0)
    if not isinstance(gpus, (int, float)) or isinstance(gpus, bool) or gpus < 0:
        raise SweepError(f"{where}: gpus_per_task must be a number >= 0, got {gpus!r}")
    names = sorted(args)
    out_root = str(Path(out_dir or ".").resolve())
    return [
        CollectCell(trace_args=tuple(zip(names, values)), out_root=out_root, num_gpus=float(gpus),
                    cwd=str(base_dir.resolve()))
        for values in itertools.product(*(_as_list(args[n]) for n in names))
    ]
