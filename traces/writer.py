"""TraceWriter: append samples to a run directory, atomically per sample, resumable after a crash.

Commit protocol: for each sample, the steps, tokens and access parts are written first (each to a temp
name, fsync, rename), then the samples part, which is the commit record. A crash at any point leaves either
a committed sample or orphan parts without a samples part; readers ignore orphans and the writer removes
them when it reopens the run.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from traces.encoding import encode_block_mass
from traces.errors import TraceFormatError
from traces.layout import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    commit_file,
    list_parts,
    part_path,
    table_dir,
    temp_path_for,
)
from traces.manifest import check_manifest, load_manifest, resume_mismatch, write_manifest
from traces.schema import TABLE_SCHEMAS, TABLES
from traces.tables import to_table

# zstd level 9: the access table compresses ~10% better than at the default level 1 and one sample of
# 2,000 decode steps still writes in well under a second.
COMPRESSION, COMPRESSION_LEVEL = "zstd", 9


class TraceWriter:
    def __init__(self, run_dir: str | Path, manifest: dict, *, resume: bool = True):
        self.path = Path(run_dir)
        check_manifest(manifest, where="manifest")
        self.manifest = manifest
        self.damaged: dict[str, str] = {}
        self._open(resume)
        self._done = set(list_parts(self.path, "samples"))

    # -- opening -------------------------------------------------------------------------------------------

    def _open(self, resume: bool) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise TraceFormatError(f"{self.path}: exists and is not a directory; choose another --out")
        if (self.path / MANIFEST_NAME).exists():
            self._reopen(resume)
            return
        if self.path.is_dir() and any(self.path.iterdir()):
            raise TraceFormatError(
                f"{self.path}: a non-empty directory that is not a trace run (no {MANIFEST_NAME}); choose another --out"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        for table in self._tables():
            table_dir(self.path, table).mkdir(exist_ok=True)
        write_manifest(self.path, self.manifest)

    def _reopen(self, resume: bool) -> None:
        existing = load_manifest(self.path)
        if not resume:
            raise TraceFormatError(f"{self.path}: a trace run already exists there; resume it or choose another --out")
        mismatch = resume_mismatch(existing, self.manifest)
        if mismatch is not None:
            raise TraceFormatError(f"{self.path}: cannot resume: {mismatch}; use a new --out for a different run")
        self._remove_leftovers()
        self.damaged = self._remove_damaged()
        # Keep what the first run recorded (created, versions); only let the sample list grow.
        known = existing["task"]["sample_ids"]
        added = [s for s in self.manifest["task"]["sample_ids"] if s not in set(known)]
        if added:
            existing["task"]["sample_ids"] = known + added
            write_manifest(self.path, existing)
        self.manifest = existing
        for table in self._tables():
            table_dir(self.path, table).mkdir(exist_ok=True)

    def _tables(self) -> list[str]:
        return [t for t in TABLES if t != "access" or self.manifest["access"]["enabled"]]

    def _remove_leftovers(self) -> None:
        """Orphan parts (a crash before the sample's commit) and temp files of interrupted writes."""
        committed = set(list_parts(self.path, "samples"))
        for table in TABLES:
            directory = table_dir(self.path, table)
            if not directory.is_dir():
                continue
            for entry in directory.iterdir():
                if entry.name.startswith(TEMP_PREFIX) and ".tmp-" in entry.name:
                    entry.unlink()
            for sample_id, part in list_parts(self.path, table).items():
                if table != "samples" and sample_id not in committed:
                    part.unlink()

    def _remove_damaged(self) -> dict[str, str]:
        """Un-commit samples with a part that cannot be read (a truncated copy, a full disk), so that the
        resumed run writes them again instead of reporting them done; sample id -> the problem found."""
        from traces.reader import part_problem

        damaged = {}
        for sample_id in sorted(list_parts(self.path, "samples")):
            for table in ("samples", *(t for t in self._tables() if t != "samples")):
                problem = part_problem(part_path(self.path, table, sample_id))
                if problem is not None:
                    damaged[sample_id] = problem
                    break
        for sample_id in damaged:  # the samples part first: without it the sample is no longer committed
            for table in ("samples", *TABLES):
                part_path(self.path, table, sample_id).unlink(missing_ok=True)
        if damaged:
            first = next(iter(damaged.values()))
            print(f"note: {self.path}: {len(damaged)} committed sample(s) had a damaged part ({first}); "
                  "removed them so that this run writes them again", file=sys.stderr)
        return damaged

    # -- sessions ----------------------------------------------------------------------------------------

    def begin_session(self, info: Mapping) -> None:
        """Record one invocation of the writing command in run.json `sessions` (e.g. threads, load average):
        a resumed run is several sessions, and each one's conditions explain its samples' timings."""
        session = {"started": datetime.now(UTC).isoformat(timespec="seconds"), **dict(info)}
        self.manifest.setdefault("sessions", []).append(session)
        write_manifest(self.path, self.manifest)

    def end_session(self, info: Mapping) -> None:
        """Complete the session `begin_session` opened (an interrupted run keeps it without an end)."""
        sessions = self.manifest.get("sessions") or []
        if not sessions:
            raise TraceFormatError(f"{self.path}: end_session without begin_session")
        sessions[-1].update({"ended": datetime.now(UTC).isoformat(timespec="seconds"), **dict(info)})
        write_manifest(self.path, self.manifest)

    # -- writing -------------------------------------------------------------------------------------------

    def done_sample_ids(self) -> set[str]:
        return set(self._done)

    def write_sample(
        self,
        sample: Mapping,
        steps: Mapping | pd.DataFrame,
        tokens: Mapping | pd.DataFrame,
        access: Mapping | pd.DataFrame | None = None,
    ) -> None:
        """Write one sample's rows; it becomes visible to readers only when all its parts are on disk."""
        self.commit_sample(self.prepare_sample(sample, steps, tokens, access))

    def prepare_sample(
        self,
        sample: Mapping,
        steps: Mapping | pd.DataFrame,
        tokens: Mapping | pd.DataFrame,
        access: Mapping | pd.DataFrame | None = None,
    ) -> tuple[str, dict[str, pa.Table | Callable[[], pa.Table]]]:
        """Check and convert one sample's rows into its tables, nothing written yet: (sample_id, tables) for
        `commit_sample`. What holds the GIL (Python objects into Arrow columns) happens here; the access table's
        masses, NumPy work on millions of values per long sample (tests/bench/write_behind.py times it), are
        encoded by `commit_sample` (its table is a function until then)."""
        sample_id = sample.get("sample_id")
        if not isinstance(sample_id, str) or not sample_id:
            raise TraceFormatError("samples: `sample_id` must be a non-empty string")
        self._refuse_committed(sample_id)
        row = dict(sample)
        row.setdefault("sample_index", self._next_index(sample_id))
        tables = {
            "samples": to_table("samples", {k: [v] for k, v in row.items()}, TABLE_SCHEMAS["samples"], sample_id=sample_id),
            "steps": to_table("steps", steps, TABLE_SCHEMAS["steps"], sample_id=sample_id),
            "tokens": to_table("tokens", tokens, TABLE_SCHEMAS["tokens"], sample_id=sample_id),
        }
        if self.manifest["access"]["enabled"]:
            if access is None:
                raise TraceFormatError("access: this run records access (access.enabled) but no access rows were given")
            tables["access"] = functools.partial(_access_table, access, sample_id)
        elif access is not None:
            raise TraceFormatError("access: rows given but this run was created with access disabled")
        return sample_id, tables

    def commit_sample(self, prepared: tuple[str, dict[str, pa.Table | Callable[[], pa.Table]]]) -> None:
        """Write a prepared sample's parts (Parquet, zstd, fsync, rename; mostly outside the GIL), samples last:
        that part commits the sample."""
        sample_id, tables = prepared
        self._refuse_committed(sample_id)
        # (every table built, the access one encoded, before any part is written: a bad one leaves nothing)
        tables = {name: data() if callable(data) else data for name, data in tables.items()}
        for table in ("steps", "tokens", "access", "samples"):  # samples last: it commits the sample
            if table in tables:
                self._write_part(table, sample_id, tables[table])
        self._done.add(sample_id)

    def _refuse_committed(self, sample_id: str) -> None:
        if sample_id in self._done:
            raise TraceFormatError(f"samples: sample {sample_id!r} is already in {self.path}; skip done_sample_ids()")

    def _next_index(self, sample_id: str) -> int:
        ids = self.manifest["task"]["sample_ids"]
        return ids.index(sample_id) if sample_id in ids else len(self._done)

    def _write_part(self, table: str, sample_id: str, data: pa.Table) -> None:
        final = part_path(self.path, table, sample_id)
        temp = temp_path_for(final)
        pq.write_table(data, temp, compression=COMPRESSION, compression_level=COMPRESSION_LEVEL)
        commit_file(temp, final)

    def close(self) -> None:
        """Nothing is buffered (each sample is on disk when write_sample returns); kept for `with`."""

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class WriteBehind:
    """A `TraceWriter` that commits samples on one background thread, so that a decode loop does not wait while a
    finished sample's parts are compressed (zstd level 9), written, fsynced and renamed: tens to hundreds of ms
    per sample of thousands of steps, which inline would leave a GPU idle, and which run mostly outside the GIL.
    `submit` prepares the sample's tables on the calling thread (`TraceWriter.prepare_sample`: the Python-heavy
    part, which would hold the GIL, so it stays between decode steps, outside any step's measured time) and
    queues their commit (the access masses' encoding, NumPy, with it). At most `depth` samples wait (submit
    blocks beyond that): memory stays bounded, and a crash loses at most `depth` decoded samples, which a resumed
    run decodes again (each still commits atomically, samples part last). The first failure on the thread stops the writing and is raised by the
    next `submit` or by `close`; `close` commits every sample already queued (after a Ctrl-C too: the samples
    decoded are committed before the process ends), then raises that failure, if any.

    `background=False` commits in `submit`, as `write_sample` does: `thoughtkv trace` writes behind on a GPU,
    inline on a CPU, where the decode is the host's own work and a writer thread beside it slowed the measured
    steps (micro, B = 16, on a 2-core box: measured_step_us +0.7%, +5.3% and +5.9% in three runs of
    tests/bench/write_behind.py, for whole runs 0.94x, 0.99x and 0.99x as long)."""

    def __init__(self, writer: TraceWriter, depth: int = 2, background: bool = True):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._queued: set[str] = set()  # submitted, not yet committed
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True) if background else None
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        while (prepared := self._queue.get()) is not None:
            try:
                if self._failure is None:  # (after a failure the rest is dropped: a resumed run decodes it again)
                    self.writer.commit_sample(prepared)
            except BaseException as exc:  # noqa: BLE001  (raised on the submitting thread)
                self._failure = exc
            finally:
                self._queued.discard(prepared[0])

    def submit(self, sample: Mapping, steps, tokens, access=None) -> None:
        """`TraceWriter.write_sample`, its commit behind (the tables are checked here: bad rows raise here)."""
        self._raise_failure()
        if self._thread is None:
            self.writer.write_sample(sample, steps, tokens, access)
            return
        if not self._thread.is_alive():
            raise RuntimeError("WriteBehind: submit after close")
        prepared = self.writer.prepare_sample(sample, steps, tokens, access)
        if prepared[0] in self._queued:
            raise TraceFormatError(f"samples: sample {prepared[0]!r} is already queued for {self.writer.path}")
        self._queued.add(prepared[0])
        self._queue.put(prepared)

    def close(self) -> None:
        """Commit what is queued, stop the thread, raise the thread's failure if there was one."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:  # also when unwinding (an error, a Ctrl-C): commit what was decoded, keeping the original exception
            self.close()
        except BaseException:
            if exc_type is None:
                raise


def _access_table(access: Mapping | pd.DataFrame, sample_id: str) -> pa.Table:
    return to_table("access", _encode_access(access), TABLE_SCHEMAS["access"], sample_id=sample_id)


def _encode_access(access: Mapping | pd.DataFrame) -> dict:
    """Columns with float `block_mass` arrays -> the stored `block_mass_q` list<uint8> column."""
    columns = {str(k): (v.to_numpy() if isinstance(v, pd.Series) else v) for k, v in dict(access).items()}
    if "block_mass" not in columns:
        return columns
    if "block_mass_q" in columns:
        raise TraceFormatError("access: give either block_mass (floats) or block_mass_q (codes), not both")
    masses = columns.pop("block_mass")
    if not all(isinstance(m, np.ndarray) and m.ndim == 1 for m in masses):  # (the tracer's: 1-D float32 arrays)
        masses = [np.asarray(m, dtype=np.float64).ravel() for m in masses]
    # One concatenation of the rows as they are (not a float64 copy of each first: 70,000 rows of an R1 sample)
    lengths = np.fromiter(map(len, masses), dtype=np.int64, count=len(masses))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(masses) if len(masses) else np.zeros(0)
    codes = pa.array(encode_block_mass(flat), type=pa.uint8())
    columns["block_mass_q"] = pa.ListArray.from_arrays(pa.array(offsets), codes)
    return columns
