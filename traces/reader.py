"""open_run / TraceRun: read a run directory as pandas DataFrames, and check it deeply (`validate`).

Only committed samples (those with a samples part) are visible. Every failure, whatever pyarrow raised,
comes out as one TraceFormatError naming the file and the problem.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from traces.encoding import decode_block_mass
from traces.errors import TraceFormatError
from traces.layout import list_parts, part_path, table_dir
from traces.manifest import load_manifest
from traces.schema import LATER_COLUMNS, TABLE_SCHEMAS, TABLES
from traces.tables import check_schema

BYTE_COLUMNS = ("bytes_h2d", "bytes_d2h", "hbm_kv_bytes", "ddr_kv_bytes")
TOKEN_COLUMNS = ("hbm_tokens", "ddr_tokens", "evicted_tokens", "recalled_tokens", "query_tokens")
BLOCK_ID_COLUMNS = ("recalled_block_ids", "promoted_block_ids", "offloaded_block_ids", "evicted_block_ids")


def open_run(run_dir: str | Path) -> TraceRun:
    """Open a run: checks run.json (present, JSON, schema version, required keys); parts are read lazily."""
    return TraceRun(Path(run_dir))


class TraceRun:
    def __init__(self, path: Path):
        self.path = path
        self.manifest = load_manifest(path)
        self._samples: pd.DataFrame | None = None

    @property
    def has_access(self) -> bool:
        return bool(self.manifest["access"]["enabled"])

    @property
    def n_layers(self) -> int:
        return self.manifest["model"]["n_layers"]

    @property
    def block_size(self) -> int:
        return self.manifest["policy"]["block_size"]

    # -- tables --------------------------------------------------------------------------------------------

    def samples(self) -> pd.DataFrame:
        """One row per committed sample, in sample_index order."""
        if self._samples is None:
            if not table_dir(self.path, "samples").is_dir():
                others = [t for t in TABLES if t != "samples" and list_parts(self.path, t)]
                if others:  # the writer makes every table's folder first: a missing one was deleted or not copied
                    raise TraceFormatError(self.missing_table_text("samples", others))
            parts = list_parts(self.path, "samples")
            tables = []
            for sample_id, part in parts.items():
                table = read_part(part, "samples")
                if table.num_rows != 1 or table.column("sample_id")[0].as_py() != sample_id:
                    raise TraceFormatError(f"{part}: expected one row for sample {sample_id!r}, found {table.num_rows}")
                tables.append(table)
            frame = _to_pandas(tables, "samples")
            self._samples = frame.sort_values(["sample_index", "sample_id"], kind="stable").reset_index(drop=True)
        return self._samples.copy()

    def sample_ids(self) -> list[str]:
        return self.samples()["sample_id"].tolist()

    def steps(self, sample_id: str | None = None, columns: list[str] | None = None) -> pd.DataFrame:
        unknown = [c for c in columns or [] if c not in TABLE_SCHEMAS["steps"].names]
        if unknown:
            raise TraceFormatError(f"steps: unknown column(s) {', '.join(unknown)}; see traces/README.md")
        return _to_pandas(self._read_table("steps", sample_id, columns), "steps", columns)

    def tokens(self, sample_id: str | None = None) -> pd.DataFrame:
        return _to_pandas(self._read_table("tokens", sample_id), "tokens")

    def access(self, sample_id: str | None = None) -> pd.DataFrame:
        """Rows (sample_id, step, layer, block_mass) with block_mass decoded to float32 arrays."""
        if not self.has_access:
            raise TraceFormatError(f"{self.path}: this run was recorded without access (access.enabled is false)")
        frames = []
        for table in self._read_table("access", sample_id):
            codes = table.column("block_mass_q").combine_chunks()
            masses = decode_block_mass(codes.flatten().to_numpy(zero_copy_only=False), **self._encoding())
            offsets = codes.offsets.to_numpy()
            frame = table.drop_columns(["block_mass_q"]).to_pandas()
            frame["block_mass"] = np.split(masses, offsets[1:-1]) if len(frame) else []
            frames.append(frame)
        if not frames:
            return pd.DataFrame({"sample_id": [], "step": [], "layer": [], "block_mass": []})
        return pd.concat(frames, ignore_index=True)

    def _encoding(self) -> dict:
        access = self.manifest["access"]
        if access.get("encoding") != "log2-u8":
            raise TraceFormatError(f"{self.path / 'run.json'}: unknown access encoding {access.get('encoding')!r}")
        return {k: access[k] for k in ("floor_log2", "levels_per_octave") if k in access}

    def _read_table(self, table: str, sample_id: str | None, columns: list[str] | None = None) -> list[pa.Table]:
        ids = self.sample_ids() if sample_id is None else [sample_id]
        if sample_id is not None and sample_id not in set(self.sample_ids()):
            raise TraceFormatError(f"{self.path}: no committed sample {sample_id!r}")
        tables = []
        for sid in ids:
            path = part_path(self.path, table, sid)
            if not path.is_file():
                raise TraceFormatError(f"{path}: missing; sample {sid!r} is committed but has no {table} part")
            tables.append(read_part(path, table, columns))
        return tables

    # -- deep check ----------------------------------------------------------------------------------------

    def validate(self, *, progress: bool = False) -> None:
        """Read every part of every committed sample and check it against the manifest; first problem raises."""
        from tqdm import tqdm

        samples = self.samples()
        rows = samples.itertuples(index=False)
        for sample in tqdm(rows, total=len(samples), desc="validate", unit="sample", disable=not progress):
            steps = self._read_table("steps", sample.sample_id)[0]
            n_blocks = self._check_steps(sample, steps)
            self._check_tokens(sample, self._read_table("tokens", sample.sample_id)[0])
            if self.has_access:
                self._check_access(sample, self._read_table("access", sample.sample_id)[0], n_blocks)

    def missing_table_text(self, table: str, present: list[str]) -> str:
        held = f" while {', '.join(f'{t}.parquet' for t in present)} hold parts" if present else ""
        return (f"{table_dir(self.path, table)}: missing{held}; the run's {table} table was deleted or not copied: "
                "restore it from the original run, or trace again")

    def _check_steps(self, sample, table: pa.Table) -> pd.Series:
        where = part_path(self.path, "steps", sample.sample_id)
        frame = table.to_pandas()
        if frame.empty:
            raise TraceFormatError(f"{where}: no rows; every sample has at least the prefill step")
        n_steps = int(frame["step"].max()) + 1
        keys = frame[["step", "layer"]]
        if frame["step"].min() < 0 or keys.duplicated().any() or len(frame) != n_steps * self.n_layers \
                or not frame["layer"].between(0, self.n_layers - 1).all():
            raise TraceFormatError(
                f"{where}: rows must cover steps 0..{n_steps - 1} x layers 0..{self.n_layers - 1} once each, "
                f"found {len(frame)} rows"
            )
        for column in BYTE_COLUMNS + TOKEN_COLUMNS + ("logical_len",):
            if (frame[column] < 0).any():
                raise TraceFormatError(f"{where}: column {column!r} has negative values")
        n_blocks = -(-frame["logical_len"] // self.block_size)
        for column in BLOCK_ID_COLUMNS:
            ids = table.column(column).combine_chunks()
            flat = ids.flatten().to_numpy(zero_copy_only=False)
            row_of = np.repeat(np.arange(len(frame)), np.diff(ids.offsets.to_numpy()))
            if flat.size and ((flat < 0) | (flat >= n_blocks.to_numpy()[row_of])).any():
                raise TraceFormatError(f"{where}: column {column!r} has block ids outside 0..ceil(logical_len/block_size)-1")
        return -(-frame.set_index(["step", "layer"])["logical_len"] // self.block_size)

    def _check_tokens(self, sample, table: pa.Table) -> None:
        where = part_path(self.path, "tokens", sample.sample_id)
        positions = table.column("position").to_numpy()
        if len(np.unique(positions)) != len(positions):
            raise TraceFormatError(f"{where}: a position appears twice")
        n_prompt = int(pc.sum(table.column("is_prompt").cast(pa.int64())).as_py() or 0)
        if n_prompt != sample.prompt_tokens:
            raise TraceFormatError(f"{where}: {n_prompt} prompt tokens but samples says prompt_tokens={sample.prompt_tokens}")
        for column in ("importance_by_layer", "final_tier_by_layer"):
            lengths = pc.list_value_length(table.column(column)).to_numpy()
            if (lengths != self.n_layers).any():
                raise TraceFormatError(f"{where}: column {column!r} must hold {self.n_layers} values (one per layer)")

    def _check_access(self, sample, table: pa.Table, n_blocks: pd.Series) -> None:
        where = part_path(self.path, "access", sample.sample_id)
        keys = pd.MultiIndex.from_arrays([table.column("step").to_numpy(), table.column("layer").to_numpy()])
        if keys.has_duplicates or len(keys) != len(n_blocks) or not keys.isin(n_blocks.index).all():
            raise TraceFormatError(f"{where}: rows must cover the same (step, layer) pairs as steps, once each")
        lengths = pc.list_value_length(table.column("block_mass_q")).to_numpy()
        if (lengths != n_blocks.reindex(keys).to_numpy()).any():
            raise TraceFormatError(f"{where}: block_mass_q must hold ceil(logical_len / block_size) values per row")


def part_problem(path: Path) -> str | None:
    """Why a part cannot be read, from its footer alone (cheap: no column data is read), else None. A
    truncated or half-copied file loses its footer, so this catches what an interrupted copy leaves; a file
    of another schema is `read_part`'s to refuse (it is not damage that rewriting fixes)."""
    if not path.is_file():
        return f"{path}: missing"
    try:
        with pq.ParquetFile(path) as parquet:
            if parquet.metadata.num_rows < 1:
                return f"{path}: no rows"
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a damaged file; all mean "corrupt"
        return f"{path}: unreadable Parquet ({_first_line(exc)})"
    return None


def read_part(path: Path, table: str, columns: list[str] | None = None) -> pa.Table:
    """One Parquet part, schema-checked. Any failure to read it is the file's fault: TraceFormatError."""
    try:
        with pq.ParquetFile(path) as parquet:
            expected = TABLE_SCHEMAS[table]
            check_schema(path, parquet.schema_arrow, expected, LATER_COLUMNS.get(table, ()))
            present = parquet.schema_arrow.names
            data = parquet.read(columns=None if columns is None else [c for c in columns if c in present])
    except TraceFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a damaged file; all mean "corrupt"
        raise TraceFormatError(f"{path}: unreadable Parquet ({_first_line(exc)}); the file is corrupt or truncated") from None
    # A part written before a later column existed: that column reads as null, in schema order.
    wanted = expected.names if columns is None else columns
    return pa.table({name: data.column(name) if name in data.column_names
                     else pa.nulls(data.num_rows, expected.field(name).type) for name in wanted},
                    schema=pa.schema([expected.field(name) for name in wanted]))


def _to_pandas(tables: list[pa.Table], table: str, columns: list[str] | None = None) -> pd.DataFrame:
    if not tables:
        schema = TABLE_SCHEMAS[table]
        if columns is not None:
            schema = pa.schema([schema.field(c) for c in columns])
        return schema.empty_table().to_pandas()
    return pa.concat_tables(tables).to_pandas()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
