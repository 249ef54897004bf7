"""`thoughtkv traces regrade RUN`: re-score a finished run's stored texts with the current grader.

Torch-free (the grader is tracer/tasks/grading.py). For every committed sample the stored `generated_text` is
graded again by the run's task; when no verdict changes (`predicted`, `correct`, `answered_after_think`), nothing
is written. Otherwise the whole `samples` table is rewritten so that every row carries the current grader, and
the columns it replaces are appended to run.json `grading_history` (one entry per regrade: when, the graders
before and after, and every sample's old predicted / correct / grader / answered_after_think).

**Atomic.** The new table is written in full to a hidden directory next to it (`.samples.parquet.regrade-<pid>`,
each part fsync'ed, with a `.staged` marker), then swapped with `samples.parquet` in one
`renameat2(RENAME_EXCHANGE)` (Linux; elsewhere two renames, a window of microseconds with no table), so
readers see the old table or the new one, never a mix. The hidden directory then holds the old table until
run.json has its history entry, and is deleted last. A kill at any point leaves a readable run; the next
regrade finishes what a killed one left: a staged directory that was never swapped is deleted, an old table
whose history entry was not written yet is recorded (`"recovered": true`) and deleted.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from thoughtkv_base.options import PATH, SHARED, Flag, add_flags

GRADING_COLUMNS = ("predicted", "correct", "grader", "answered_after_think")
VERDICT_COLUMNS = ("predicted", "correct", "answered_after_think")
STAGED_MARKER = ".staged"  # inside a hidden table directory: it holds the new table, not yet swapped in
HIDDEN_PREFIX = ".samples.parquet.regrade-"


@dataclass
class RegradeSummary:
    n_samples: int
    n_changed: int  # samples whose verdict (predicted, correct, answered_after_think) changed
    grader: str | None
    written: bool
    correct_before: int
    correct_after: int
    recovered: int = 0  # leftovers of a killed regrade that this one finished
    reason: str = ""  # why nothing was graded (random weights, no texts)


OWN = (Flag("run_dir", "a finished trace run directory", PATH, metavar="RUN"),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, *OWN, SHARED["dry_run"].use(help="grade and report, write nothing"))


def run(args: argparse.Namespace) -> int:
    summary = regrade_run(args.run_dir, dry_run=args.dry_run)
    print(summary_line(args.run_dir, summary))
    return 0


def summary_line(run_dir: Path, s: RegradeSummary) -> str:
    if s.reason:
        return f"{run_dir}: nothing to regrade ({s.reason})"
    action = "rewritten" if s.written else ("dry run, nothing written" if s.n_changed else "no change, nothing written")
    recovered = f"; finished {s.recovered} interrupted regrade step(s)" if s.recovered else ""
    return (f"{run_dir}: {s.n_changed} of {s.n_samples} verdicts changed under {s.grader}; correct "
            f"{s.correct_before} -> {s.correct_after} ({action}){recovered}")


def regrade_run(run_dir: str | Path, *, dry_run: bool = False, fail_at: str | None = None) -> RegradeSummary:
    """Regrade a run in place. `fail_at` ("staged" | "swapped") raises between two writes: the tests' way of
    killing it where a crash would hurt most."""
    from tracer.tasks import get_task, grading_columns
    from traces import open_run

    run_dir = Path(run_dir)
    trace = open_run(run_dir)
    recovered = 0 if dry_run else _finish_interrupted(run_dir)
    if recovered:
        trace = open_run(run_dir)
    samples = trace.samples()
    correct_before = int(samples["correct"].fillna(False).astype(bool).sum()) if len(samples) else 0
    if trace.manifest["model"].get("random_weights"):
        return RegradeSummary(len(samples), 0, None, False, correct_before, correct_before, recovered,
                              "random weights: the run has no accuracy")
    if len(samples) == 0 or samples["generated_text"].isna().all():
        return RegradeSummary(len(samples), 0, None, False, correct_before, correct_before, recovered,
                              "no stored generated_text")
    task = get_task(trace.manifest["task"]["name"])
    rows = samples.to_dict("records")
    new_columns = [grading_columns(task, row["generated_text"], row["gold"]) if row["generated_text"] is not None
                   else {c: row[c] for c in GRADING_COLUMNS} for row in rows]
    changed = [row["sample_id"] for row, new in zip(rows, new_columns) if _verdict_changed(row, new)]
    grader = next((new["grader"] for new in new_columns if new["grader"]), None)
    correct_after = sum(bool(new["correct"]) for new in new_columns)
    summary = RegradeSummary(len(rows), len(changed), grader, False, correct_before, correct_after, recovered)
    if not changed or dry_run:
        return summary
    _swap_in(run_dir, trace, rows, new_columns, fail_at)
    summary.written = True
    return summary


def _verdict_changed(old: dict, new: dict) -> bool:
    for column in VERDICT_COLUMNS:
        before = old[column]
        if column == "answered_after_think" and _is_null(before):
            continue  # not recorded before this column existed: filling it in is no change of verdict
        if (None if _is_null(before) else before) != new[column]:
            return True
    return False


def _is_null(value) -> bool:
    return value is None or (isinstance(value, float) and value != value)


# --- the atomic rewrite -----------------------------------------------------------------------------------


def _swap_in(run_dir: Path, trace, rows: list[dict], new_columns: list[dict], fail_at: str | None) -> None:
    from traces.layout import fsync_dir, part_name, table_dir
    from traces.manifest import write_manifest
    from traces.schema import TABLE_SCHEMAS
    from traces.tables import to_table
    from traces.writer import COMPRESSION, COMPRESSION_LEVEL

    hidden = run_dir / f"{HIDDEN_PREFIX}{os.getpid()}"
    shutil.rmtree(hidden, ignore_errors=True)
    hidden.mkdir()
    (hidden / STAGED_MARKER).touch()
    for row, new in zip(rows, new_columns):
        sample_id = row["sample_id"]
        columns = {key: [None if _is_null(value) else value] for key, value in {**row, **new}.items()}
        table = to_table("samples", columns, TABLE_SCHEMAS["samples"], sample_id=sample_id)
        path = hidden / part_name(sample_id)
        pq.write_table(table, path, compression=COMPRESSION, compression_level=COMPRESSION_LEVEL)
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
    fsync_dir(hidden)
    if fail_at == "staged":
        raise RuntimeError("injected failure: new table staged, not swapped in")
    live = table_dir(run_dir, "samples")
    _exchange(hidden, live)  # readers now see the new table; `hidden` holds the old one
    (live / STAGED_MARKER).unlink()
    fsync_dir(run_dir)
    if fail_at == "swapped":
        raise RuntimeError("injected failure: new table swapped in, history not yet written")
    manifest = dict(trace.manifest)
    manifest.setdefault("grading_history", []).append(_history_entry(rows, new_columns[0]["grader"]))
    write_manifest(run_dir, manifest)
    shutil.rmtree(hidden)


def _history_entry(rows: list[dict], grader_after: str | None, recovered: bool = False) -> dict:
    before = {row["sample_id"]: {c: (None if _is_null(row[c]) else _plain(row[c])) for c in GRADING_COLUMNS}
              for row in rows}
    entry = {
        "regraded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "grader_before": sorted({v["grader"] or "unrecorded" for v in before.values()}),
        "grader_after": grader_after,
        "correct_before": sum(bool(v["correct"]) for v in before.values()),
        "columns_before": before,
    }
    if recovered:
        entry["recovered"] = True  # written by a later regrade: the one that swapped the table was killed
    return entry


def _plain(value):
    """numpy scalars (from pandas) -> JSON-serialisable Python values."""
    return value.item() if hasattr(value, "item") else value


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); two renames where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, rename_exchange = -100, 2
        if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
    except (AttributeError, OSError):
        pass
    aside = a.with_name(a.name + ".swap")
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def _finish_interrupted(run_dir: Path) -> int:
    """Complete what a killed regrade left: delete never-swapped staged tables, record swapped-out old ones."""
    from traces.manifest import load_manifest, write_manifest

    finished = 0
    live = run_dir / "samples.parquet"
    (live / STAGED_MARKER).unlink(missing_ok=True)
    for hidden in sorted(run_dir.glob(f"{HIDDEN_PREFIX}*")):
        if not hidden.is_dir() or hidden.name.endswith(".swap"):
            continue
        if (hidden / STAGED_MARKER).exists():  # the new table never went live: the old one is still in place
            shutil.rmtree(hidden)
            finished += 1
            continue
        old_rows = pa.concat_tables([_read_old_part(p) for p in sorted(hidden.glob("part-*.parquet"))]).to_pylist() \
            if any(hidden.glob("part-*.parquet")) else []
        manifest = load_manifest(run_dir)
        graders = {row.get("grader") for row in _live_rows(run_dir)}
        manifest.setdefault("grading_history", []).append(
            _history_entry(old_rows, next(iter(sorted(g for g in graders if g)), None), recovered=True))
        write_manifest(run_dir, manifest)
        shutil.rmtree(hidden)
        finished += 1
    return finished


def _read_old_part(path: Path) -> pa.Table:
    from traces.reader import read_part

    return read_part(path, "samples", list(("sample_id", *GRADING_COLUMNS)))


def _live_rows(run_dir: Path) -> list[dict]:
    from traces import open_run

    return open_run(run_dir).samples()[["sample_id", "grader"]].to_dict("records")
