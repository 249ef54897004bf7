"""Rows in, Arrow tables out: cast what a writer hands over to the v1 schema, and check what a reader finds.

Both directions raise TraceFormatError with one line naming the table/file and the column.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from traces.errors import TraceFormatError


def to_table(name: str, data: Mapping | pd.DataFrame, schema: pa.Schema, *, sample_id: str) -> pa.Table:
    """Columns (dict of lists/arrays, or a DataFrame) -> a table of exactly `schema`.

    `sample_id` is filled in when absent and must equal the sample's everywhere. Nullable columns may be
    left out (stored as null); required ones may not; unknown columns are refused (they are typos).
    """
    columns = _columns(name, data)
    n_rows = _n_rows(name, columns)
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise TraceFormatError(f"{name}: unknown column(s) {', '.join(unknown)}; the v1 columns are in traces/schema.py")
    if "sample_id" not in columns:
        columns["sample_id"] = [sample_id] * n_rows
    arrays = []
    for field in schema:
        if field.name not in columns:
            if not field.nullable:
                raise TraceFormatError(f"{name}: missing required column {field.name!r} ({field.type})")
            arrays.append(pa.nulls(n_rows, type=field.type))
            continue
        arrays.append(_to_array(name, field, columns[field.name]))
    table = pa.Table.from_arrays(arrays, schema=schema)
    ids = table.column("sample_id").unique().to_pylist()
    if any(i != sample_id for i in ids):
        other = next(i for i in ids if i != sample_id)
        raise TraceFormatError(f"{name}: a row has sample_id {other!r} but the sample written is {sample_id!r}")
    return table


def _columns(name: str, data) -> dict:
    if isinstance(data, pd.DataFrame):
        return {str(c): data[c].to_numpy() for c in data.columns}
    if isinstance(data, Mapping):
        return dict(data)
    raise TraceFormatError(f"{name}: expected a dict of columns or a DataFrame, got {type(data).__name__}")


def _n_rows(name: str, columns: dict) -> int:
    lengths = {key: len(value) for key, value in columns.items()}
    if len(set(lengths.values())) > 1:
        raise TraceFormatError(f"{name}: columns have different lengths {lengths}")
    return next(iter(lengths.values()), 0)


def _to_array(name: str, field: pa.Field, values) -> pa.Array:
    try:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if isinstance(values, pa.Array):
            return _check_nulls(name, field, values.cast(field.type))
        if isinstance(values, np.ndarray) and values.dtype == object and pa.types.is_list(field.type):
            values = [None if v is None else np.asarray(v).tolist() for v in values]
        array = pa.array(values, type=field.type, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise TraceFormatError(f"{name}: column {field.name!r} cannot be stored as {field.type}: {_first_line(exc)}") from None
    return _check_nulls(name, field, array)


def _check_nulls(name: str, field: pa.Field, array: pa.Array) -> pa.Array:
    if not field.nullable and array.null_count:
        raise TraceFormatError(f"{name}: column {field.name!r} has {array.null_count} null value(s) but is required")
    if pa.types.is_list(field.type) and array.flatten().null_count:
        raise TraceFormatError(f"{name}: column {field.name!r} has null items inside its lists")
    return array


def check_schema(path, found: pa.Schema, expected: pa.Schema, may_lack: tuple[str, ...] = ()) -> None:
    """A part file's columns and types must be exactly the v1 ones (extra columns are refused too); only the
    nullable columns added later (`may_lack`, traces.schema.LATER_COLUMNS) may be missing."""
    for field in expected:
        index = found.get_field_index(field.name)
        if index < 0 and field.name in may_lack:
            continue
        if index < 0:
            raise TraceFormatError(f"{path}: missing column {field.name!r}; the file was not written by trace format v1")
        found_type = found.field(index).type
        if found_type != field.type:
            raise TraceFormatError(f"{path}: column {field.name!r} has type {found_type}, expected {field.type}")
    extra = [n for n in found.names if n not in expected.names]
    if extra:
        raise TraceFormatError(f"{path}: unexpected column(s) {', '.join(extra)}; not trace format v1")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
