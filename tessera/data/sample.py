"""The launcher's look at raw data files before any rank starts: the first records of each file the run reads, and
from them whether this run would pass training.max_bad_records.

How many records the run reads is estimated from below, so that a run the data allows is never refused: the loader
deals documents round-robin to `data_streams` streams and each stream packs its own documents into windows of
seq_len + 1 tokens, so handing out steps x global batch windows takes, in each stream, documents enough for its
windows, and the documents of the other streams up to them, a chunk of 64 at a time; a document gives at most its
UTF-8 bytes + 2 tokens (no tokenizer makes more than one token per byte, the byte tokenizer exactly one); the sample
gives each file's bytes per document and its share of records that are documents. Validation (when on) replays
validation.steps x local batch x DP windows of the held-out split, 1 record in 100. Records are read file after file
in order; a record is counted once however often epochs repeat it. The expected bad records of a file are those
the sample found among the records of it the run reads, and beyond the sample, its rate times the records of it the
run reads; the run is refused when they pass the limit."""

import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from tessera.data.records import BadRecords, DataError, file_texts, how_to_fix, json_texts

SAMPLE_RECORDS = 1000  # read from the start of each file
SAMPLE_FILES = 64  # at most, from the first file on: the records of later files are not estimated
_HOLDOUT = 100  # 1 record in this many is held out for validation (sources._FILES_HOLDOUT_MOD)
_CHUNK = 64  # the loader reads documents this many at a time, at least (loader._ENCODE_CHUNK)


@dataclass(frozen=True)
class RunReads:
    """What a run takes from its data: windows of `window` tokens, over `streams` streams."""
    train_samples: int  # training.steps x global batch
    validation_samples: int  # validation.steps x local batch x DP; 0 when validation is off
    window: int  # seq_len + 1
    streams: int  # training.data_streams


@dataclass
class FileSample:
    file: Path
    records: int  # read
    documents: int  # of them, good and not empty
    document_bytes: int  # their UTF-8 bytes
    bad: BadRecords  # the bad ones among them
    total: int  # the file's records: counted when the sample read them all (or parquet's metadata), else estimated
    bad_so_far: list[int]  # bad ones among the first 1, 2, ... records read

    def bad_in_first(self, n: float) -> float:
        """The bad records among the first `n` of the file: counted within the sample, at its rate beyond."""
        n = round(n)
        if not self.records or n <= 0:
            return 0.0
        counted = self.bad_so_far[min(n, self.records) - 1]
        return counted + self.bad.count / self.records * max(0, n - self.records)


def sample_file(file: Path, text_field: str, n: int = SAMPLE_RECORDS) -> FileSample:
    """The first `n` records of `file`; read once per version of the file (tessera.plan validates many layouts)."""
    stat = file.stat()
    return _sample(file, text_field, n, stat.st_size, stat.st_mtime_ns)


# Memoized safely: keyed by all it reads (the file by path, size and mtime; the field; the count).
@functools.lru_cache(maxsize=SAMPLE_FILES)
def _sample(file: Path, text_field: str, n: int, size: int, mtime_ns: int) -> FileSample:
    bad, texts, bad_so_far, offset = BadRecords(-1, quiet=True), [], [], 0
    is_json = file.suffix in (".jsonl", ".json")
    read = json_texts(file, text_field, bad) if is_json else ((text, 0) for text in file_texts(file, text_field, bad))
    for text, end in itertools.islice(read, n):
        texts.append(text)
        bad_so_far.append(bad.count)
        offset = end  # where the sample ends in the file
    total = len(texts)
    if is_json and len(texts) == n and offset:
        total = max(len(texts), round(len(texts) * size / offset))
    elif file.suffix == ".parquet":
        import pyarrow.parquet as pq  # deferred: pyarrow is only needed for parquet inputs

        total = pq.ParquetFile(file).metadata.num_rows
    docs = [text for text in texts if text is not None]
    return FileSample(file, len(texts), len(docs), sum(len(d.encode("utf-8")) for d in docs), bad, total, bad_so_far)


def documents_read(samples: int, window: int, streams: int, document_tokens: float) -> int:
    """At least how many documents the loader reads to hand out `samples` windows: stream s of `streams` takes
    windows s, s + streams, ... and packs documents s, s + streams, ... of at most `document_tokens` tokens each; the
    documents are read in order, so the stream that needs most has the others' documents read up to its own."""
    if not samples:
        return 0
    per, extra = divmod(samples, streams)
    most = math.ceil((per + (extra > 0)) * window / document_tokens)
    each = extra * most + (streams - extra) * math.ceil(per * window / document_tokens)
    return math.ceil(max(each, streams * (most - 1) + 1) / _CHUNK) * _CHUNK


def records_read(sampled: list[FileSample], reads: RunReads) -> float:
    """At least how many records (from the first file on) the run reads; inf when the sample holds no document."""
    records, docs = sum(s.records for s in sampled), sum(s.documents for s in sampled)
    if not docs:
        return math.inf
    tokens = sum(s.document_bytes for s in sampled) / docs + 2  # [bos] + text + [eos]
    per_document = records / docs  # records read for each document: bad and empty ones are read too
    train = documents_read(reads.train_samples, reads.window, reads.streams, tokens) * per_document \
        * _HOLDOUT / (_HOLDOUT - 1)
    held_out = documents_read(reads.validation_samples, reads.window, reads.streams, tokens) * per_document * _HOLDOUT
    return max(train, held_out)


def check_bad_rate(files: list[Path], text_field: str, limit: int, reads: RunReads) -> None:
    """Refuse, before launch, data whose sampled rate of bad records would pass `limit` over the records this run
    reads (see the module's docstring); names the file with the most and the first few bad records."""
    over_limit(files, lambda file: sample_file(file, text_field), limit, reads,
               lambda worst: how_to_fix(worst.bad.reasons[0], text_field))


def over_limit(files: list[Path], sample, limit: int, reads: RunReads, fix) -> None:
    """The refusal of check_bad_rate for records of any kind: `sample(file)` gives a file's FileSample (its
    documents: the records that give something to train on), `fix(worst sample)` what to do about them."""
    if limit == -1:
        return
    sampled: list[FileSample] = []
    for file in files[:SAMPLE_FILES]:
        sampled.append(sample(file))
        if sum(s.total for s in sampled) >= records_read(sampled, reads):
            break
    left = read = min(records_read(sampled, reads), sum(s.total for s in sampled))
    expected = {}
    for s in sampled:
        take, left = min(s.total, left), left - min(s.total, left)
        expected[s.file] = s.bad_in_first(take)
    if sum(expected.values()) <= limit:
        return
    worst = max(sampled, key=lambda s: expected[s.file])
    examples = [e for s in sampled for e in s.bad.examples][:3]
    raise DataError(f"training.max_bad_records: {worst.bad.count} of the first {worst.records} records of "
                    f"{worst.file} are bad; at that rate about {math.ceil(sum(expected.values()))} of the ~{read:.0f} "
                    f"records this run reads would be, more than {limit}; the first: {'; '.join(examples)}; "
                    f"{fix(worst)}, or raise training.max_bad_records (-1: no limit)")
