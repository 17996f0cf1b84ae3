"""Document streams (plain strings) for every `training.dataset` kind; same arguments -> same sequence."""

import functools
import glob
import os
import random
import sysconfig
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

from tessera.data.records import BadRecords, DataError, file_texts, how_to_fix, missing_field
from tessera.data.sample import RunReads, check_bad_rate

SPLITS = ("train", "validation")
WHOLE = "whole"  # files read whole, no record held out: a held-out file of its own (validation.dataset_path)
LOCAL = ("stdlib", "files", "tokenized")  # the datasets that need no Hub (tokenized: tessera/data/prepared.py)
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# Hub shortcuts: name -> (hub id, config).
HUB_ALIASES = {"c4": ("allenai/c4", "en")}
# Test suites, GUI demos and third-party packages are not "the standard library" we want to train on.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"}
_STDLIB_HOLDOUT_MOD = 50  # 1 file in 50 is validation
_FILES_HOLDOUT_MOD = 100  # 1 document in 100 is validation
_HUB_SHUFFLE_BUFFER = 10_000


def documents(dataset: str, path: str, text_field: str, split: str, seed: int, epoch: int,
              bad: BadRecords | None = None) -> Iterator[str]:
    """The non-empty documents of `split` for one epoch; bad records are counted in `bad` (None: the first one
    raises DataError). Errors in the configuration surface here, not on first use."""
    check_split(dataset, split)
    check_dataset(dataset, path)
    if dataset == "stdlib":
        return _stdlib_documents(split, seed, epoch)
    if dataset == "files":
        return _file_documents(_resolve_files(path), text_field, split, BadRecords(0) if bad is None else bad)
    return _hub_documents(dataset, path, text_field, split, seed, epoch)


def check_split(dataset: str, split: str) -> None:
    if split not in SPLITS and not (split == WHOLE and dataset == "files"):
        raise ValueError(f"split must be one of {SPLITS} (or {WHOLE!r} for files), got {split!r}")


def check_dataset(dataset: str, path: str) -> None:
    """The dataset name and whether it takes training.dataset_path."""
    if dataset not in LOCAL and dataset not in HUB_ALIASES and "/" not in dataset:
        raise DataError(f"training.dataset: unknown dataset {dataset!r}; use stdlib, files (with "
                        f"training.dataset_path), tokenized (a prepared folder), c4, or a hub id ORG/NAME (e.g. "
                        f"Salesforce/{dataset})")
    if dataset == "stdlib" and path:
        raise DataError(f"training.dataset_path: {path!r} is given, but training.dataset = 'stdlib' reads the "
                        f"built-in corpus; set training.dataset = 'files' to train on it, or leave the path empty")
    if dataset == "files" and not path:
        raise DataError("training.dataset_path: empty, but training.dataset = 'files' needs a file, folder or glob")


# --- stdlib: the running interpreter's own source files, always available offline -------------------------

# Memoized safely: it reads only the running interpreter's stdlib folder, fixed for the process.
@functools.cache
def _stdlib_files() -> tuple[tuple[Path, str], ...]:
    """(absolute path, relative posix path) of every stdlib .py file, sorted; walked once per process."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                file = Path(dirpath, name)
                found.append((file, file.relative_to(root).as_posix()))
    if not found:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    return tuple(sorted(found, key=lambda item: item[1]))


def _stdlib_documents(split: str, seed: int, epoch: int) -> Iterator[str]:
    # Hashing the relative path (not the position) keeps the split stable when files are added or removed.
    want_val = split == "validation"
    files = [file for file, rel in _stdlib_files()
             if (zlib.crc32(rel.encode("utf-8")) % _STDLIB_HOLDOUT_MOD == 0) == want_val]
    if split == "train":
        random.Random(seed * 1000 + epoch).shuffle(files)
    return _read_nonempty(files)


def _read_nonempty(files: list[Path]) -> Iterator[str]:
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


# --- files: local .txt / .jsonl / .json (lines or an array) / .parquet ------------------------------------------------

def _resolve_files(path: str, key: str = "training.dataset_path") -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the supported data files, sorted."""
    matches = [Path(path)] if Path(path).exists() else [Path(p) for p in sorted(glob.glob(path, recursive=True))]
    files = []
    for match in matches:
        if match.is_dir():
            files += sorted(p for p in match.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        elif match.suffix in FILE_SUFFIXES:
            files.append(match)
    if not files:
        raise DataError(f"{key}: no {'/'.join(FILE_SUFFIXES)} files found at {path!r}")
    return files


def _file_documents(files: list[Path], text_field: str, split: str, bad: BadRecords) -> Iterator[str]:
    # Records are counted across all files so a single-file dataset still gets a held-out split; a skipped
    # record keeps its place, so the split of every other record stays where it was.
    want_val = split == "validation"
    k = 0
    for file in files:
        for text in file_texts(file, text_field, bad):
            if (split == WHOLE or (k % _FILES_HOLDOUT_MOD == _FILES_HOLDOUT_MOD - 1) == want_val) and text is not None:
                yield text
            k += 1


def check_files(path: str, text_field: str, validation: bool, max_bad_records: int = -1,
                reads: RunReads | None = None) -> None:
    """Before training: the files at `path` hold a document for training and, with `validation`, one held out
    (1 record in 100 is); with `reads`, their sampled rate of bad records would not pass `max_bad_records` over the
    records the run reads (tessera/data/sample.py). Reads up to the first document, and the first 1,000 records of
    each file the run reads (of 64 files at most)."""
    files, bad = _resolve_files(path), BadRecords(-1, quiet=True)
    if reads is not None:
        check_bad_rate(files, text_field, max_bad_records, reads)
    named = f"{files[0]}" if len(files) == 1 else f"{len(files)} files at {path!r}"
    if next(_file_documents(files, text_field, "train", bad), None) is None:
        if bad.count:
            raise DataError(f"training.dataset_path: no document in {named}: its records are all bad or empty "
                            f"({bad.count} bad; the first: {'; '.join(bad.examples)}); "
                            f"{how_to_fix(bad.reasons[0], text_field)}")
        raise DataError(f"training.dataset_path: no text in {named}: every document is empty")
    if validation and next(_file_documents(files, text_field, "validation", bad), None) is None:
        raise DataError(f"validation.enable: the validation split of {named} is empty: it holds out record 100, "
                        f"200, ... and the data has fewer; add data, or set validation.enable = false")


def check_validation_path(cfg) -> None:
    """validation.dataset_path: raw files beside raw training files, holding a document (text; chat and
    prompt-completion examples are checked by tessera.data.examples.check_examples)."""
    from tessera.data import tokens

    v, t = cfg.validation, cfg.training
    if not (v.enable and v.dataset_path):
        return
    if t.dataset != "files" or tokens.wanted(t):
        raise DataError(f"validation.dataset_path: a held-out file is read beside training.dataset = 'files' (raw "
                        f"files), not {t.dataset!r}{' (prepared)' if t.dataset == 'files' else ''}; leave it empty "
                        f"to validate on the held-out split")
    files = _resolve_files(v.dataset_path, key="validation.dataset_path")
    if t.dataset_format == "text" and next(_file_documents(files, t.dataset_text_field, WHOLE,
                                                           BadRecords(-1, quiet=True)), None) is None:
        raise DataError(f"validation.dataset_path: no document in {v.dataset_path!r}: its records are all bad or "
                        f"empty")


# --- hub datasets via `datasets` streaming ------------------------------------------------------------------

def check_hub(dataset: str, path: str, timeout_s: float = 3.0) -> None:
    """A dataset streamed from the Hugging Face Hub needs the Hub: refuse at once when offline mode is set or the
    endpoint does not answer within `timeout_s`, rather than retry for half a minute."""
    if path or dataset in LOCAL:
        return
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE",
                                                                                 "HF_DATASETS_OFFLINE")):
        why = "the machine is offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)"
    else:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except (OSError, ValueError) as e:
            why = f"the Hub at {endpoint} does not answer ({getattr(e, 'reason', e)}): offline?"
    source = HUB_ALIASES.get(dataset, (dataset,))[0]
    raise DataError(f"training.dataset: {dataset!r} streams {source!r} from the Hugging Face Hub, but {why}; use "
                    f"training.dataset = 'stdlib', or a local copy via training.dataset_path")


def _hub_documents(dataset: str, path: str, text_field: str, split: str, seed: int, epoch: int) -> Iterator[str]:
    ds, source = hub_rows(dataset, path, split, seed, epoch)
    return _hub_texts(ds, text_field, source)


def hub_rows(dataset: str, path: str, split: str, seed: int, epoch: int):
    """(the streamed rows of `split` of a hub dataset, shuffled for training; its name)."""
    check_hub(dataset, path)
    import datasets  # deferred: importing `datasets` takes seconds and most runs never need it

    name, config = HUB_ALIASES.get(dataset, (dataset, None))
    source = path or name
    try:
        if path and config not in datasets.get_dataset_config_names(path):
            config = None  # a plain folder of data files has no named configs, only "default"
        ds = datasets.load_dataset(source, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - network, auth and cache failures all arrive as different types
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"training.dataset: could not load {source!r} ({dataset!r}): {detail}") from e
    if split == "train":
        ds = ds.shuffle(seed=seed * 1000 + epoch, buffer_size=_HUB_SHUFFLE_BUFFER)
    return ds, source


def _hub_texts(rows, text_field: str, source: str) -> Iterator[str]:
    for n, row in enumerate(rows, 1):
        if text_field not in row:
            raise missing_field(source, text_field, list(row))
        if not isinstance(row[text_field], str):
            raise DataError(f"{source} row {n}: {text_field!r} (training.dataset_text_field) is a "
                            f"{type(row[text_field]).__name__}, not a string")
        if row[text_field].strip():
            yield row[text_field]
