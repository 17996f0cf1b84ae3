"""Reading local data files record by record. A bad record (not UTF-8, not valid JSON, not an object, a text
that is not a string) is skipped and counted with its file and line, never replaced or guessed at.

The forms read: .txt (the file is one document), .jsonl (one JSON object per line), .json (one JSON array of
objects, when its first byte after whitespace is '[', else JSON Lines as .jsonl), .parquet (a string column). Text is
UTF-8, a byte-order mark at the start of a file allowed (as editors on Windows save it) and not part of the text."""

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from tessera.config.manager import ConfigError
from tessera.data import json_array

log = logging.getLogger(__name__)
_JSON_TYPES = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}
_EXAMPLES = 3  # bad records named by a message


class DataError(ConfigError):
    """Bad data: one line naming the file (and line) at fault and what to do."""


class BadRecords:
    """The bad records skipped so far, each counted once however often an epoch or a resume replay reads it.
    Beyond `limit` (-1: none) the next one stops the run. Every rank reads every record, so all count alike."""

    def __init__(self, limit: int, quiet: bool = False, option: str = "training.max_bad_records"):
        self.limit, self.quiet, self.option = limit, quiet, option
        self.examples: list[str] = []  # "file:line: reason" of the first few
        self.reasons: list[str] = []  # and their reasons
        self._seen: set[str] = set()
        self._files: set[str] = set()

    @property
    def count(self) -> int:
        return len(self._seen)

    @property
    def first(self) -> str | None:
        return self.examples[0] if self.examples else None

    def skip(self, file: Path, where: str, reason: str) -> None:
        """`where`: 'line N', 'line N (element K)', 'row N' or 'byte N' of `file`. Returns None, the text of a
        skipped record."""
        key = f"{file}:{where.removeprefix('line ')}"
        if key in self._seen:
            return
        self._seen.add(key)
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{key}: {reason}")
            self.reasons.append(reason)
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
    is then named by its byte offset, unless the piece starts the file), the row groups [start, end) of a .parquet.
    A .json array is read whole (it has no pieces)."""
    if file.suffix == ".txt":
        yield _txt(file, bad)
    elif file.suffix == ".parquet":
        yield from _parquet_texts(file, text_field, bad, range(start, end) if end is not None else None)
    else:
        yield from (text for text, _ in json_texts(file, text_field, bad, start, end))


def json_texts(file: Path, text_field: str, bad: BadRecords, start: int = 0,
               end: int | None = None) -> Iterator[tuple[str | None, int]]:
    """(text or None, file offset after the record) of each record of a .jsonl / .json; see file_texts."""
    with open(file, "rb") as f:
        for where, raw, offset, problem in json_records(f, file, start, end):
            if problem is not None:
                yield bad.skip(file, where, problem), offset
            else:  # the first record: a missing text field is the setting's fault, most likely, not the record's
                first = where == "line 1" or where.endswith("(element 1)")
                yield _json_text(raw, file, where, text_field, bad, first), offset


def _txt(file: Path, bad: BadRecords) -> str | None:
    raw = file.read_bytes().removeprefix(json_array.BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        return bad.skip(file, f"line {line}", f"bytes that are not UTF-8 ({e.reason})")
    return text if text.strip() else None


def is_json_array(file: Path) -> bool:
    """A .json file that holds one JSON array (a record per element), not JSON Lines."""
    if file.suffix != ".json":
        return False
    with open(file, "rb") as f:
        return json_array.is_array(f)


def json_records(f, file: Path, start: int = 0, end: int | None = None) -> Iterator[tuple[str, bytes | None, int,
                                                                                     str | None]]:
    """(where, raw bytes, file offset after it, problem) of each record of an open .jsonl / .json; see file_texts."""
    if file.suffix == ".json" and json_array.is_array(f):
        yield from json_array.elements(f)
        return
    if start:
        f.seek(start - 1)
        f.readline()  # the line holding byte start - 1 belongs to the piece before
    elif f.read(len(json_array.BOM)) != json_array.BOM:
        f.seek(0)
    n, pos = 0, f.tell()
    while (end is None or pos < end) and (raw := f.readline()):
        n += 1
        pos += len(raw)
        if raw.strip():
            yield f"byte {pos - len(raw)}" if start else f"line {n}", raw, pos, None


def json_object(raw: bytes, file: Path, where: str, bad: BadRecords, wants: str) -> dict | None:
    """The JSON object of a record, or None when it is not one (counted in `bad`; `wants` says what it should
    hold, e.g. "a 'text' field")."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return bad.skip(file, where, f"bytes that are not UTF-8 ({e.reason} at column {e.start + 1})")
    except json.JSONDecodeError as e:
        return bad.skip(file, where, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
    if not isinstance(row, dict):
        return bad.skip(file, where, f"{_type(row)} (JSON), not an object with {wants}")
    return row


def _json_text(raw: bytes, file: Path, where: str, text_field: str, bad: BadRecords, first: bool) -> str | None:
    row = json_object(raw, file, where, bad, f"a {text_field!r} field")
    if row is None:
        return None
    if text_field not in row:
        if first:
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


def how_to_fix(reason: str, text_field: str) -> str:
    """What to do about records skipped for `reason` (a reason BadRecords names)."""
    if reason.startswith("bytes that are not UTF-8"):
        return "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    if "not an object" in reason:
        return f"make each record a JSON object with its text in the string field {text_field!r}"
    if "not a string" in reason or reason.startswith("no field"):
        return (f"set training.dataset_text_field to the field that holds each document's text (now "
                f"{text_field!r}), or fix those records")
    return ("write one JSON object per line (.jsonl), or one JSON array of objects (.json), each with its text in "
            f"the string field {text_field!r}")
