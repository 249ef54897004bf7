"""Where a dataset task's records come from: a local JSONL `--data-file`, or the Hugging Face Hub via `datasets`.

Both return plain dicts in the dataset's own field names, in file order, so the same sample index means the
same problem whichever source was used.
"""

from __future__ import annotations

import json
from pathlib import Path

from thoughtkv_base import UserError


class DataFileError(UserError):
    """A --data-file that is missing, unreadable or lacks the task's fields."""


class HubUnavailableError(UserError):
    """The dataset could not be fetched from the Hub (offline, or not cached)."""


def read_jsonl(path: str, required_fields: tuple[str, ...], n_records: int) -> list[dict]:
    """The first `n_records` records of a JSONL file, each checked for `required_fields`."""
    file = Path(path)
    if not file.is_file():
        raise DataFileError(f"data file {path} not found; pass an existing JSONL file to --data-file")
    records = []
    line_number = 0
    try:
        with file.open(encoding="utf-8") as lines:
            for line_number, line in enumerate(lines, start=1):
                if len(records) >= n_records:
                    break
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFileError(f"{path}:{line_number}: not valid JSON ({exc.msg}); fix the line") from None
                missing = [f for f in required_fields if not isinstance(record, dict) or f not in record]
                if missing:
                    raise DataFileError(
                        f"{path}:{line_number}: missing field(s) {', '.join(missing)}; each line needs "
                        f"{', '.join(required_fields)}"
                    )
                records.append(record)
    except UnicodeDecodeError:
        raise DataFileError(f"{path}:{line_number + 1}: not UTF-8 text; save the file as UTF-8 JSONL") from None
    if not records and n_records > 0:
        raise DataFileError(f"{path}: no records (the file is empty or blank); give one JSON object per line with "
                            f"{', '.join(required_fields)}")
    return records


def load_hub(
    dataset_id: str, config: str | None, split: str, required_fields: tuple[str, ...], n_records: int
) -> list[dict]:
    """The first `n_records` records of a Hub dataset split (the download is cached by `datasets`)."""
    try:
        import datasets

        from tracer.preflight import offline_if_unreachable

        with offline_if_unreachable():  # offline: the cache or a one-line refusal, not ~40 s of retries
            dataset = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as exc:  # offline, DNS, auth, missing cache: all mean "use a local file"
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise HubUnavailableError(
            f"cannot load {dataset_id} ({split}) from the Hugging Face Hub ({reason}); "
            f"pass --data-file PATH.jsonl with fields {', '.join(required_fields)}"
        ) from None
    missing = [f for f in required_fields if f not in dataset.column_names]
    if missing:
        raise HubUnavailableError(f"{dataset_id} lacks field(s) {', '.join(missing)}; pass --data-file instead")
    return [dataset[i] for i in range(min(n_records, len(dataset)))]


def load_records(
    data_file: str | None,
    dataset_id: str,
    config: str | None,
    split: str,
    required_fields: tuple[str, ...],
    n_records: int,
) -> list[dict]:
    if data_file is not None:
        return read_jsonl(data_file, required_fields, n_records)
    return load_hub(dataset_id, config, split, required_fields, n_records)
