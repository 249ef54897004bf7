"""Sweep cells: one frozen dataclass per kind (simulate, serve, collect) with one method `run()`, the
key that names a cell's cached result (its parameters and the digests of what it reads), and the worker entry
point that runs one cell to Parquet bytes."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import shlex
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from simulator.options import Projection, ServingConfig, SimOptions
from thoughtkv_base import UserError


class SweepError(UserError):
    """A grid file or sweep request that cannot run as written (one-line message, exit 2)."""


@dataclass(frozen=True)
class SimulateCell:
    """One `simulate_run` call: a traced run replayed (or re-placed by a what-if) on one hardware profile."""

    run_dir: str
    profile: str
    options: SimOptions = field(default_factory=SimOptions)
    what_if: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs; () = replay as traced
    num_gpus: float = 0.0
    projection: Projection = field(default_factory=Projection)  # as_model, ... (grid keys of the same names)
    per_sample: bool = False  # one row per sample (simulate's samples table) instead of one for the run

    def run(self) -> pd.DataFrame:
        from simulator import simulate_run

        result = simulate_run(self.run_dir, self.profile, self.options, what_if=dict(self.what_if) or None,
                              projection=self.projection)
        if self.per_sample:
            return result.samples.copy()
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
