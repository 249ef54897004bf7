"""Where the files of a run live, and how one is written atomically (temp name, fsync, rename).

    RUN/run.json
    RUN/<table>.parquet/part-<quoted sample id>.parquet

Sample ids are percent-quoted (`urllib.parse.quote`, nothing kept unquoted but letters, digits and `_.-~`)
so that "gsm8k/test/0012" becomes one file name, and the id can be read back from the name without opening
the file. Temp files start with "." so that pandas/pyarrow datasets and `*.parquet` globs skip them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote

MANIFEST_NAME = "run.json"
# Samples in one run, for every writer (trace, traces synth): far beyond any dataset here (GSM8K test: 1,319),
# and a bound for generated tasks, whose loaders have no count of their own (10**13 looped or ran out of memory).
MAX_SAMPLES = 1_000_000
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
TEMP_PREFIX = "."


def table_dir(run_dir: Path, table: str) -> Path:
    return run_dir / f"{table}.parquet"


def part_name(sample_id: str) -> str:
    return f"{PART_PREFIX}{quote(sample_id, safe='')}{PART_SUFFIX}"


def part_path(run_dir: Path, table: str, sample_id: str) -> Path:
    return table_dir(run_dir, table) / part_name(sample_id)


def sample_id_of_part(name: str) -> str | None:
    """The sample id a part file name encodes, or None for anything that is not a part file."""
    if not (name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX)):
        return None
    return unquote(name[len(PART_PREFIX) : -len(PART_SUFFIX)])


def list_parts(run_dir: Path, table: str) -> dict[str, Path]:
    """sample id -> part file, for the part files present in one table directory."""
    directory = table_dir(run_dir, table)
    if not directory.is_dir():
        return {}
    parts = {}
    for entry in directory.iterdir():
        sample_id = sample_id_of_part(entry.name)
        if sample_id is not None and entry.is_file():
            parts[sample_id] = entry
    return parts


def temp_path_for(path: Path) -> Path:
    return path.with_name(f"{TEMP_PREFIX}{path.name}.tmp-{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_file(temp: Path, final: Path) -> None:
    """fsync the finished temp file, then rename it over `final`: readers see all of it or none of it."""
    with open(temp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temp, final)
    fsync_dir(final.parent)


def write_atomic(path: Path, write: Callable[[Path], object], check: Callable[[Path], object] | None = None) -> None:
    """The project's one atomic writer: `write(temp)` fills a dot-named temp file next to `path` (globs skip
    it), `check(temp)` may refuse it by raising, then fsync + rename. On any error the temp file is removed and
    `path` keeps its old content (or stays absent)."""
    path = Path(path)
    temp = temp_path_for(path)
    try:
        write(temp)
        if check is not None:
            check(temp)
        commit_file(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_csv_atomic(path: Path, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys, the first row's order) as a CSV file, atomically (`write_atomic`); no
    rows, an empty file."""
    import csv
    import io

    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_atomic(path, lambda temp: temp.write_text(buffer.getvalue()))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda temp: temp.write_bytes(data))
