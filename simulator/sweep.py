"""Sweeps: a grid of independent cells (simulations, serving simulations or trace collections) run on a local
process pool or on Ray, each finished cell cached as a small Parquet file, all merged into one table.

    grid = load_grid("examples/sweeps/simulate_budgets.yaml")    # validated YAML -> list of cells
    report = run_sweep(grid.cells, "sweeps/budgets", executor="local", workers=2)
    report.table                                                  # = sweeps/budgets/results.parquet

A cell is a frozen dataclass (one per kind: SimulateCell, ServeCell, CollectCell) with one method `run()`
returning a DataFrame; `cell_key(cell)` hashes what it computes (not where it runs) and the content of what it
reads (`cell_inputs`: the project version, the trace run's manifest and committed sample parts, the profile
file) into the name of its cached result, OUT/cells/<key>.parquet, so a rerun skips finished cells and
recomputes those whose inputs changed. Every cell is validated when the grid is read, before any runs. The scheduler is not ours:
`concurrent.futures.ProcessPoolExecutor` locally, Ray tasks otherwise (`ray.init()` starts a local Ray;
`address=` joins a cluster). Workers return Parquet bytes and only the driver writes files, so on a cluster
the trace runs must be on a path every node sees (and thoughtkv installed on every node), the output
directory only on the driver. Collection cells are the exception: `thoughtkv trace` writes its run itself,
under OUT/runs/<key>/, which must then be shared too.

Grid files (YAML, read bounded by hwprofiles.loader.read_yaml_file): a scalar is fixed, a list is an axis,
the cells are the cross product.
See `examples/sweeps/` and GRID_KEYS below for the keys each kind accepts.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.options import Projection, ServingConfig, SimOptions, grid_keys
from thoughtkv_base import UserError
from traces.layout import write_bytes_atomic


class SweepError(UserError):
    """A grid file or sweep request that cannot run as written (one-line message, exit 2)."""


# ---------------------------------------------------------------- cells (one dataclass per kind) -------------


@dataclass(frozen=True)
class SimulateCell:
    """One `simulate_run` call: a traced run replayed (or re-placed by a what-if) on one hardware profile."""

    run_dir: str
    profile: str
    options: SimOptions = field(default_factory=SimOptions)
    what_if: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs; () = replay as traced
    num_gpus: float = 0.0
    projection: Projection = field(default_factory=Projection)  # as_model, ... (grid keys of the same names)

    def run(self) -> pd.DataFrame:
        from simulator import simulate_run

        result = simulate_run(self.run_dir, self.profile, self.options, what_if=dict(self.what_if) or None,
                              projection=self.projection)
        summary = result.summary
        return summary.copy() if isinstance(summary, pd.DataFrame) else pd.DataFrame([summary])


@dataclass(frozen=True)
class ServeCell:
    """One serving simulation: Poisson arrivals replaying samples of a run, continuous batching (serving.py)."""

    run_dir: str
    profile: str
    config: ServingConfig = field(default_factory=ServingConfig)
    num_gpus: float = 0.0

    def run(self) -> pd.DataFrame:
        from simulator.serving import simulate_serving

        return pd.DataFrame([simulate_serving(self.run_dir, self.profile, self.config).summary])


@dataclass(frozen=True)
class CollectCell:
    """One trace collection: `thoughtkv trace ARGS --out OUT` in a subprocess (the simulator never imports torch).

    On Ray the task asks for `num_gpus` GPUs, so a cluster runs one collection per GPU; Ray sets
    CUDA_VISIBLE_DEVICES for the task and the subprocess inherits it.
    """

    trace_args: tuple[tuple[str, Any], ...]  # sorted (flag, value) pairs, flags without the leading `--`
    out_root: str
    num_gpus: float = 0.0
    cwd: str = ""  # the grid file's directory: relative paths in trace_args are relative to it, as `runs:` are

    def out_dir(self) -> str:
        return str(Path(self.out_root) / "runs" / cell_key(self))

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "thoughtkv.cli", "trace"]
        for flag, value in self.trace_args:
            if value is True:
                args.append(f"--{flag}")
            elif value is not False and value is not None:
                args += [f"--{flag}", str(value)]
        return args + ["--out", self.out_dir()]

    def run(self) -> pd.DataFrame:
        done = subprocess.run(self.command(), capture_output=True, text=True, cwd=self.cwd or None)
        if done.returncode != 0:  # not cached: a rerun retries it (and the tracer resumes its run)
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise SweepError(f"`thoughtkv trace` exited with {done.returncode}: {last}")
        samples = pd.read_parquet(Path(self.out_dir()) / "samples.parquet")
        row: dict[str, Any] = {f"trace_{flag}": value for flag, value in self.trace_args}
        row.update(run_dir=self.out_dir(), returncode=done.returncode, command=shlex.join(self.command()[3:]),
                   n_samples=len(samples), generated_tokens=int(samples["generated_tokens"].sum()),
                   accuracy=samples["correct"].astype("float").mean())
        return pd.DataFrame([row])


CELL_KINDS: dict[str, type] = {"simulate": SimulateCell, "serve": ServeCell, "collect": CollectCell}


# Where a cell runs or writes is not what it computes: these fields stay out of its key.
NOT_IN_KEY = ("num_gpus", "out_root", "cwd")


_SNAPSHOT: dict | None = None  # set inside `inputs_snapshot()`: cell -> key, and each distinct input's digests


@contextmanager
def inputs_snapshot():
    """Within the block each distinct input (a trace run, a profile file) is digested once and each cell's key
    computed once: the inputs as they were when the sweep was planned. A grid of 10,000 cells names a few runs
    and profiles thousands of times each; digesting them per cell (~2 ms) kept the sweep silent for 20 s."""
    global _SNAPSHOT
    outer, _SNAPSHOT = _SNAPSHOT, {} if _SNAPSHOT is None else _SNAPSHOT
    try:
        yield
    finally:
        _SNAPSHOT = outer


def cell_key(cell) -> str:
    """Stable 16-hex key of what a cell computes: the file name of its cached result. It covers the cell's
    parameters and the *content* of what it reads (`cell_inputs`), so a cached result is reused only while the
    trace run, the profile file and the project version it was computed from are unchanged."""
    if _SNAPSHOT is not None and ("key", cell) in _SNAPSHOT:
        return _SNAPSHOT[("key", cell)]
    params = {f.name: _as_plain(getattr(cell, f.name)) for f in fields(cell) if f.name not in NOT_IN_KEY}
    text = json.dumps({"kind": cell_kind(cell), **params, "inputs": cell_inputs(cell)}, sort_keys=True, default=str)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if _SNAPSHOT is not None:
        _SNAPSHOT[("key", cell)] = key
    return key


@functools.lru_cache(maxsize=4096)
def _options_dict(options) -> dict:
    return asdict(options)


def _as_plain(value):
    """A cell field as `dataclasses.asdict` gives it (the key text is unchanged), options dicts computed once."""
    if is_dataclass(value):
        return _options_dict(value)
    return value


def cell_inputs(cell) -> dict:
    """Digests of what a cell's result depends on besides its parameters: the project version (the code),
    and for simulations the trace run (run.json and every committed sample's parts) and the profile file."""
    where = ("inputs", type(cell), getattr(cell, "run_dir", None), getattr(cell, "profile", None),
             getattr(getattr(cell, "config", None), "arrivals_csv", None))
    if _SNAPSHOT is not None and where in _SNAPSHOT:
        return dict(_SNAPSHOT[where])
    inputs = _cell_inputs(cell)
    if _SNAPSHOT is not None:
        _SNAPSHOT[where] = dict(inputs)
    return inputs


def _cell_inputs(cell) -> dict:
    import thoughtkv_base
    from hwprofiles.loader import profile_file

    inputs = {"version": thoughtkv_base.__version__}
    if isinstance(cell, (SimulateCell, ServeCell)):
        inputs["run"] = run_digest(cell.run_dir)
        inputs["profile"] = file_digest(profile_file(cell.profile))
    if isinstance(cell, ServeCell) and cell.config.arrivals_csv:
        inputs["arrivals"] = file_digest(Path(cell.config.arrivals_csv))
    return inputs


_RUN_DIGESTS: dict[tuple, str] = {}  # (run dir, run.json and table-directory stats) -> digest, per process


def run_digest(run_dir: str | Path) -> str:
    """sha256 over run.json and the part files of the run's committed samples (those with a samples part), in
    every table: a sample added, removed or rewritten changes it; a sample still being written does not.

    Computed once per distinct run and state: a grid names each run in thousands of cells, and listing and
    hashing its parts for each (~16 ms) kept a 10,000-cell sweep silent for minutes. The state is the stat of
    run.json and of every table directory (a part committed, replaced or removed renames into its directory,
    which changes the directory's mtime)."""
    from traces.layout import MANIFEST_NAME

    run_dir = Path(run_dir)
    state = (str(run_dir.resolve()), *(_stat_key(p) for p in [run_dir / MANIFEST_NAME, *sorted(run_dir.glob("*.parquet"))]))
    if state not in _RUN_DIGESTS:
        _RUN_DIGESTS[state] = _run_digest(run_dir)
    return _RUN_DIGESTS[state]


def _stat_key(path: Path) -> tuple:
    try:
        stat = path.stat()
    except OSError:
        return (path.name, "missing")
    return (path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino)


def _run_digest(run_dir: Path) -> str:
    from traces.layout import MANIFEST_NAME, list_parts

    digest = hashlib.sha256(file_digest(run_dir / MANIFEST_NAME).encode())
    committed = set(list_parts(run_dir, "samples"))
    for table in sorted(p.name.removesuffix(".parquet") for p in run_dir.glob("*.parquet") if p.is_dir()):
        for sample_id, part in sorted(list_parts(run_dir, table).items()):
            if sample_id in committed:
                digest.update(f"{table}/{sample_id}:{file_digest(part)};".encode())
    return digest.hexdigest()


_FILE_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime, inode) -> sha256: each file is read once per process


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (a missing file: the string "missing", so the cell fails where it runs)."""
    try:
        stat = path.stat()
    except OSError:
        return "missing"
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _FILE_DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        _FILE_DIGESTS[key] = digest.hexdigest()
    return _FILE_DIGESTS[key]


def cell_kind(cell) -> str:
    return next(name for name, cls in CELL_KINDS.items() if isinstance(cell, cls))


def cell_to_dict(cell) -> dict:
    return {"kind": cell_kind(cell), **asdict(cell)}


def cell_from_dict(data: dict):
    data = dict(data)
    cls = CELL_KINDS[data.pop("kind")]
    for name in ("what_if", "trace_args"):
        if name in data:
            data[name] = tuple(tuple(pair) for pair in data[name])
    if "options" in data:
        data["options"] = SimOptions(**data["options"])
    if "projection" in data:
        data["projection"] = Projection(**data["projection"])
    if "config" in data:
        config = dict(data["config"])
        data["config"] = ServingConfig(**{**config, "options": SimOptions(**config["options"]),
                                          "projection": Projection(**config["projection"])})
    return cls(**data)


def run_cell_to_parquet(cell_data: dict, key: str) -> bytes:
    """Worker entry point (process pool or Ray task): run one cell, return its result table as Parquet bytes.
    `key` is the cell's key as the driver computed it (from the inputs it saw when it planned the sweep)."""
    cell = cell_from_dict(cell_data)
    table = cell.run()
    table.insert(0, "cell_key", key)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()


# ---------------------------------------------------------------- grid files ---------------------------------

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


# ---------------------------------------------------------------- executors ----------------------------------

Executor = Callable[[list, int], Iterator[tuple[Any, bytes | BaseException]]]


def execute_local(cells: list, workers: int, keys: dict | None = None) -> Iterator[tuple[Any, bytes | BaseException]]:
    """A process pool (spawned workers: safe next to a Ray driver's threads); yields cells as they finish.
    Stopped early (Ctrl-C, SIGTERM, the caller closing this generator), it terminates its workers at once
    (thoughtkv_base.pool); finished cells are already on disk, the driver writes them."""
    from concurrent.futures import as_completed

    from thoughtkv_base.pool import process_pool

    if workers == 1:  # no pool: same code path, no start-up cost
        for cell in cells:
            yield cell, _call(cell, keys)
        return
    with process_pool(min(workers, len(cells) or 1)) as pool:
        futures = {pool.submit(run_cell_to_parquet, cell_to_dict(cell), _key(cell, keys)): cell for cell in cells}
        for future in as_completed(futures):
            exc = future.exception()
            yield futures[future], exc if exc is not None else future.result()


def _key(cell, keys: dict | None) -> str:
    return keys[cell] if keys is not None else cell_key(cell)


def _call(cell, keys: dict | None = None) -> bytes | BaseException:
    try:
        return run_cell_to_parquet(cell_to_dict(cell), _key(cell, keys))
    except Exception as exc:  # a failed cell is reported at the end; the others still run
        return exc


def execute_ray(cells: list, workers: int, address: str | None = None,
                keys: dict | None = None) -> Iterator[tuple[Any, bytes | BaseException]]:
    """Ray tasks, one per cell (`num_cpus=1`, `num_gpus` from the cell); yields cells as they finish.

    Joins the running Ray if this process already initialised one, else `ray.init(address)`: None starts a
    local Ray with `workers` CPUs, "auto" or "ray://host:10001" joins a cluster (see README).
    """
    try:
        import ray
    except ImportError:
        raise SweepError("Ray is not installed; `pip install 'thoughtkv[ray]'` or use --executor local") from None
    started_here = False
    if not ray.is_initialized():
        if address is None:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        started_here = True
    try:
        remote = ray.remote(run_cell_to_parquet)
        pending = {
            remote.options(num_cpus=1, num_gpus=cell.num_gpus, max_retries=0).remote(cell_to_dict(cell),
                                                                                    _key(cell, keys)): cell
            for cell in cells
        }
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            cell = pending.pop(done[0])
            try:
                yield cell, ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                yield cell, exc.as_instanceof_cause()
    finally:
        if started_here:
            ray.shutdown()


# ---------------------------------------------------------------- the sweep ----------------------------------


# ---------------------------------------------------------------- size and time, before the sweep starts -----
# What a cell costs, measured on the 2-core development machine (tests/test_sweep.py checks the estimate against a
# small sweep's own files): a simulate cell replays its run in ~10 ms per sample + ~4 us per layer-step; a what-if
# re-places the recorded masses, ~20 ms per sample + ~0.12 us per layer-block more (the shipped micro runs: 0.2-0.35
# s a replay, 0.5-1.3 s a what-if; a 4-sample qwen2-7b synth run of 2,000 steps: 0.9 s and 5.3 s). Each cached result
# is a ~34 kB Parquet file; the merge reads them all (~6 ms and ~60 kB of memory a cell); a worker process holds
# ~200 MiB of libraries plus its run (~30 B per layer-block of its longest sample under a what-if).
SIM_SECONDS_PER_SAMPLE, SIM_SECONDS_PER_LAYER_STEP = 0.010, 4e-6
WHAT_IF_SECONDS_PER_SAMPLE, WHAT_IF_SECONDS_PER_LAYER_BLOCK = 0.020, 0.12e-6
CELL_FILE_BYTES, RESULT_ROW_BYTES = 34_000, 1_000
MERGE_SECONDS_PER_CELL, MERGE_BYTES_PER_CELL = 0.006, 60_000
WORKER_BASE_BYTES, WORKER_BYTES_PER_LAYER_BLOCK = 200 * 2**20, 30


@dataclass(frozen=True)
class SweepEstimate:
    cells: int  # to compute
    workers: int
    seconds: float | None  # None when no cell's time can be estimated
    untimed: int  # cells whose time is not estimated (serve, collect)
    disk_bytes: int
    memory_bytes: int

    def text(self) -> str:
        from simulator.synth import duration_text, size_text

        if self.seconds is None:
            time = "time not estimated (serving and collection cells)"
        else:
            time = f"~{duration_text(self.seconds)}" + (f" + {self.untimed:,} untimed serve/collect cells"
                                                        if self.untimed else "")
        return (f"{self.cells:,} cells to compute on {self.workers} worker(s): {time}, ~{size_text(self.disk_bytes)} "
                f"on disk, ~{size_text(self.memory_bytes)} peak memory")


def estimate_sweep(cells: list, todo: list, workers: int) -> SweepEstimate:
    """Time, disk and memory of computing `todo` and merging `cells`, from each run's size (the constants above)."""
    sizes: dict[str, dict] = {}
    seconds, untimed, worker_bytes = 0.0, 0, WORKER_BASE_BYTES
    for cell in todo:
        if not isinstance(cell, SimulateCell):
            untimed += 1
            continue
        if cell.run_dir not in sizes:
            sizes[cell.run_dir] = _run_size(cell.run_dir)
        size = sizes[cell.run_dir]
        seconds += SIM_SECONDS_PER_SAMPLE * size["samples"] + SIM_SECONDS_PER_LAYER_STEP * size["layer_steps"]
        if cell.what_if:
            seconds += WHAT_IF_SECONDS_PER_SAMPLE * size["samples"] + WHAT_IF_SECONDS_PER_LAYER_BLOCK * size["layer_blocks"]
            worker_bytes = max(worker_bytes, WORKER_BASE_BYTES + WORKER_BYTES_PER_LAYER_BLOCK * size["max_sample_layer_blocks"])
    workers = max(1, min(workers, len(todo) or 1))
    timed = len(todo) - untimed
    total = seconds / workers + MERGE_SECONDS_PER_CELL * len(cells) if timed or not todo else None
    return SweepEstimate(cells=len(todo), workers=workers, seconds=total, untimed=untimed,
                         disk_bytes=CELL_FILE_BYTES * len(todo) + RESULT_ROW_BYTES * len(cells),
                         memory_bytes=MERGE_BYTES_PER_CELL * len(cells) + workers * worker_bytes)


def _run_size(run_dir: str) -> dict:
    """Samples, layer-steps and layer-blocks (blocks attended per layer and step, summed) of a trace run."""
    import numpy as np

    from traces.reader import open_run

    run = open_run(run_dir)
    samples = run.samples()
    n_layers, block_size = run.n_layers, run.block_size
    blocks = [int((-(-(int(p) + np.arange(int(g) + 1)) // block_size)).sum()) * n_layers
              for p, g in zip(samples["prompt_tokens"], samples["generated_tokens"])]
    return {"samples": len(samples), "layer_steps": int((samples["generated_tokens"] + 1).sum()) * n_layers,
            "layer_blocks": sum(blocks), "max_sample_layer_blocks": max(blocks, default=0)}


def check_estimate(estimate: SweepEstimate, out_dir: Path, allow_large: bool) -> None:
    """Refuse, before any cell runs, a sweep whose estimate exceeds the memory available or the disk free."""
    from simulator.synth import exceeded_limit

    exceeded = None if allow_large else exceeded_limit(estimate.memory_bytes, estimate.disk_bytes, out_dir)
    if exceeded:
        raise SweepError(f"the sweep needs {exceeded} ({estimate.text()}); split the grid, use fewer --workers, "
                         "or --allow-large to try anyway")


@dataclass
class SweepReport:
    table: pd.DataFrame
    computed: int
    cached: int
    failed: dict[str, str]  # cell key -> one-line error
    results_path: Path | None = None  # the merged table, None when no cell has a result (nothing written)


def cell_result_path(out_dir: Path, cell) -> Path:
    return out_dir / "cells" / f"{cell_key(cell)}.parquet"


def run_sweep(
    cells: list, out_dir: str | Path, executor: str = "local", workers: int | None = None,
    address: str | None = None, progress: bool = True,
) -> SweepReport:
    """Run the cells not cached under `out_dir/cells/`, then merge every cell's table into `results.parquet`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SweepError(f"--out {out_dir} is a file; pass a directory")
    if executor not in ("local", "ray"):
        raise SweepError(f"executor {executor!r} is unknown; use local or ray")
    workers = workers or os.cpu_count() or 1
    with inputs_snapshot():
        paths = {cell: cell_result_path(out_dir, cell) for cell in cells}  # keys from the inputs as they are now
    check_distinct_cells(cells, {cell: path.stem for cell, path in paths.items()})
    (out_dir / "cells").mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not _readable(paths[c])]  # a damaged cached result is computed again
    keys = {cell: path.stem for cell, path in paths.items()}
    finished = execute_local(todo, workers, keys) if executor == "local" else execute_ray(todo, workers, address, keys)
    failed: dict[str, str] = {}
    from tqdm import tqdm

    # closing: a Ctrl-C raised here, between two results, still stops the executor's workers now (an unclosed
    # generator would run its cleanup only when collected, after the command has exited)
    with closing(finished), tqdm(total=len(cells), initial=len(cells) - len(todo), unit="cell",
                                 disable=not progress, desc=f"sweep ({executor})") as bar:
        for cell, result in finished:
            if isinstance(result, BaseException):
                lines = str(result).strip().splitlines() or [""]
                failed[paths[cell].stem] = f"{type(result).__name__}: {lines[-1]}"
            else:
                write_bytes_atomic(paths[cell], result)
            bar.update(1)
    table, written = merge_results(cells, out_dir, [paths[c] for c in cells])
    return SweepReport(table=table, computed=len(todo) - len(failed), cached=len(cells) - len(todo), failed=failed,
                       results_path=written)


def check_distinct_cells(cells: list, keys: dict) -> None:
    """Refuse a grid whose cells compute the same thing twice (axis values that differ as written but mean the
    same, such as 1 and 1.0), naming the cell key; `keys`: cell -> cell_key. (A value listed twice as written
    is refused when the grid is read, naming its axis.)"""
    seen: set[str] = set()
    for cell in cells:
        if keys[cell] in seen:
            raise SweepError(f"the grid lists the same cell twice (cell {keys[cell]}); remove the duplicate value "
                             "from its axis")
        seen.add(keys[cell])


def is_cached(out_dir: Path, cell) -> bool:
    """The cell has a usable result under out_dir (what run_sweep skips)."""
    return _readable(cell_result_path(out_dir, cell))


def _readable(path: Path) -> bool:
    """A cached cell result that pyarrow can open (a truncated or foreign file is not one)."""
    if not path.is_file():
        return False
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(path)
    except Exception:  # noqa: BLE001 - pyarrow raises many types for a damaged file
        return False
    return True


def merge_results(cells: list, out_dir: Path, paths: list[Path] | None = None) -> tuple[pd.DataFrame, Path | None]:
    """One table of every finished cell of this grid, sorted so that any executor gives the same table, and
    where it was written (None when no cell has a result: nothing is written then)."""
    paths = paths if paths is not None else [cell_result_path(out_dir, c) for c in cells]
    parts = [pd.read_parquet(p) for p in paths if p.is_file()]
    if not parts:
        return pd.DataFrame(), None
    table = pd.concat(parts, ignore_index=True)
    sort_by = ["cell_key"] + [c for c in ("sample_id",) if c in table.columns]
    table = table.sort_values(sort_by, kind="stable").reset_index(drop=True)
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    write_bytes_atomic(out_dir / "results.parquet", buffer.getvalue())
    write_bytes_atomic(out_dir / "results.csv", table.to_csv(index=False).encode())
    return table, out_dir / "results.parquet"
