"""Reading local data files record by record. A bad record (not UTF-8, not valid JSON, not an object, a text
that is not a string) is skipped and counted with its file and line, never replaced or guessed at."""

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from tessera.config.manager import ConfigError

log = logging.getLogger(__name__)
_JSON_TYPES = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


class DataError(ConfigError):
    """Bad data: one line naming the file (and line) at fault and what to do."""


class BadRecords:
    """The bad records skipped so far, each counted once however often an epoch or a resume replay reads it.
    Beyond `limit` (-1: none) the next one stops the run. Every rank reads every record, so all count alike."""

    def __init__(self, limit: int, quiet: bool = False, option: str = "training.max_bad_records"):
        self.limit, self.quiet, self.option = limit, quiet, option
        self.first: str | None = None  # "file:line: reason" of the first one
        self._seen: set[str] = set()
        self._files: set[str] = set()

    @property
    def count(self) -> int:
        return len(self._seen)

    def skip(self, file: Path, where: str, reason: str) -> None:
        """`where`: 'line N' or 'row N' of `file`. Returns None, the text of a skipped record."""
        key = f"{file}:{where.split()[-1]}"
        if key in self._seen:
            return
        self._seen.add(key)
        self.first = self.first or f"{key}: {reason}"
        if self.limit != -1 and self.count > self.limit:
            raise DataError(f"{self.option}: {self.count} bad data records, more than {self.limit}; the "
                            f"latest, {file} {where}: {reason}; fix the data, or raise {self.option} "
                            f"(-1: no limit)")
        if not self.quiet and str(file) not in self._files:
            self._files.add(str(file))
            log.warning(f"{file} {where}: {reason}; skipped ({self.option} = {self.limit}); later bad "
                        f"records of this file are counted, not logged")


def _type(value) -> str:
    return _JSON_TYPES.get(type(value), f"a {type(value).__name__}")


def file_texts(file: Path, text_field: str, bad: BadRecords, start: int = 0,
               end: int | None = None) -> Iterator[str | None]:
    """Each record's text in order; None for a record skipped (bad or empty), so positions stay fixed. A piece of
    the file only, when `start`/`end` are given: the lines that begin in bytes [start, end) of a .jsonl (a record
    is then named by its byte offset, unless the piece starts the file), the row groups [start, end) of a .parquet."""
    if file.suffix == ".txt":
        yield _txt(file, bad)
    elif file.suffix == ".parquet":
        yield from _parquet_texts(file, text_field, bad, range(start, end) if end is not None else None)
    else:  # .jsonl / .json: one JSON object per line
        yield from _json_texts(file, text_field, bad, start, end)


def _txt(file: Path, bad: BadRecords) -> str | None:
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        return bad.skip(file, f"line {line}", f"bytes that are not UTF-8 ({e.reason})")
    return text if text.strip() else None


def _json_texts(file: Path, text_field: str, bad: BadRecords, start: int = 0,
                end: int | None = None) -> Iterator[str | None]:
    with open(file, "rb") as f:
        if end is None:
            for n, raw in enumerate(f, 1):
                if raw.strip():
                    yield _json_text(raw, file, f"line {n}", text_field, bad)
            return
        if start:
            f.seek(start - 1)
            f.readline()  # the line holding byte start - 1 belongs to the piece before
        n, pos = 0, f.tell()
        while pos < end and (raw := f.readline()):
            n += 1
            if raw.strip():
                yield _json_text(raw, file, f"byte {pos}" if start else f"line {n}", text_field, bad)
            pos += len(raw)


def _json_text(raw: bytes, file: Path, where: str, text_field: str, bad: BadRecords) -> str | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return bad.skip(file, where, f"bytes that are not UTF-8 ({e.reason} at column {e.start + 1})")
    except json.JSONDecodeError as e:
        return bad.skip(file, where, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
    if not isinstance(row, dict):
        return bad.skip(file, where, f"{_type(row)} (JSON), not an object with a {text_field!r} field")
    if text_field not in row:
        if where == "line 1":  # the whole file lacks it, most likely: the setting is wrong, not the record
            raise missing_field(file, text_field, list(row))
        return bad.skip(file, where, f"no field {text_field!r}")
    return _text(row[text_field], file, where, text_field, bad)


def _text(value, file: Path, where: str, text_field: str, bad: BadRecords) -> str | None:
    if isinstance(value, str):
        return value if value.strip() else None  # an empty document: nothing to learn, nothing wrong
    return bad.skip(file, where, f"{text_field!r} is {_type(value)}, not a string")


def _parquet_texts(file: Path, text_field: str, bad: BadRecords,
                   row_groups: range | None = None) -> Iterator[str | None]:
    import pyarrow as pa  # deferred: pyarrow is only needed for parquet inputs
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise missing_field(file, text_field, schema.names)
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{file}: column {text_field!r} (training.dataset_text_field) holds {kind}, not strings")
    n = sum(parquet.metadata.row_group(g).num_rows for g in range(row_groups.start)) if row_groups else 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field], row_groups=row_groups):  # bounded memory
        for value in batch.column(0).to_pylist():
            n += 1
            yield _text(value, file, f"row {n}", text_field, bad)


def missing_field(file: Path | str, text_field: str, present: list[str]) -> DataError:
    return DataError(f"{file}: no field {text_field!r} (training.dataset_text_field); fields present: {present}")
