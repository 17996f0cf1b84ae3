"""Document streams (plain strings) for every `training.dataset` kind; same arguments -> same sequence."""

import functools
import glob
import json
import os
import random
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

SPLITS = ("train", "validation")
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# Hub shortcuts: name -> (hub id, config).
HUB_ALIASES = {"c4": ("allenai/c4", "en")}
# Test suites, GUI demos and third-party packages are not "the standard library" we want to train on.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"}
_STDLIB_HOLDOUT_MOD = 50  # 1 file in 50 is validation
_FILES_HOLDOUT_MOD = 100  # 1 document in 100 is validation
_HUB_SHUFFLE_BUFFER = 10_000


def documents(dataset: str, path: str, text_field: str, split: str, seed: int, epoch: int) -> Iterator[str]:
    """The documents of `split` for one epoch. Errors in the configuration surface here, not on first use."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if dataset == "stdlib":
        return _stdlib_documents(split, seed, epoch)
    if dataset == "files":
        return _file_documents(_resolve_files(path), text_field, split)
    if dataset in HUB_ALIASES or "/" in dataset:
        return _hub_documents(dataset, path, text_field, split, seed, epoch)
    raise ValueError(f"unknown training.dataset {dataset!r}: use stdlib, files, c4 or a hub id ORG/NAME")


# --- stdlib: the running interpreter's own source files, always available offline -------------------------

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


# --- files: local .txt / .jsonl / .json / .parquet ----------------------------------------------------------

def _resolve_files(path: str) -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the supported data files, sorted."""
    if not path:
        raise ValueError("training.dataset = 'files' needs training.dataset_path (a file, folder or glob)")
    matches = [Path(path)] if Path(path).exists() else [Path(p) for p in sorted(glob.glob(path, recursive=True))]
    files = []
    for match in matches:
        if match.is_dir():
            files += sorted(p for p in match.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        elif match.suffix in FILE_SUFFIXES:
            files.append(match)
    if not files:
        raise FileNotFoundError(f"no {'/'.join(FILE_SUFFIXES)} files found at training.dataset_path={path!r}")
    return files


def _file_documents(files: list[Path], text_field: str, split: str) -> Iterator[str]:
    # Documents are counted across all files so a single-file dataset still gets a held-out split.
    want_val = split == "validation"
    k = 0
    for file in files:
        for text in _file_texts(file, text_field):
            if (k % _FILES_HOLDOUT_MOD == _FILES_HOLDOUT_MOD - 1) == want_val and text is not None:
                yield text
            k += 1


def _file_texts(file: Path, text_field: str) -> Iterator[str | None]:
    if file.suffix == ".txt":
        yield file.read_text(encoding="utf-8", errors="replace")
    elif file.suffix == ".parquet":
        yield from _parquet_texts(file, text_field)
    else:  # .jsonl / .json: one JSON object per line
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    if text_field not in row:
                        raise _missing_field(file, text_field, list(row))
                    yield row[text_field]


def _parquet_texts(file: Path, text_field: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq  # deferred: pyarrow is only needed for parquet inputs

    parquet = pq.ParquetFile(file)
    if text_field not in parquet.schema_arrow.names:
        raise _missing_field(file, text_field, parquet.schema_arrow.names)
    # Batches keep memory bounded for files much larger than RAM.
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        yield from batch.column(0).to_pylist()


def _missing_field(file: Path | str, text_field: str, present: list[str]) -> ValueError:
    return ValueError(f"{file}: no field {text_field!r} (training.dataset_text_field); fields present: {present}")


# --- hub datasets via `datasets` streaming ------------------------------------------------------------------

def _hub_documents(dataset: str, path: str, text_field: str, split: str, seed: int, epoch: int) -> Iterator[str]:
    import datasets  # deferred: importing `datasets` takes seconds and most runs never need it

    name, config = HUB_ALIASES.get(dataset, (dataset, None))
    source = path or name
    try:
        if path and config not in datasets.get_dataset_config_names(path):
            config = None  # a plain folder of data files has no named configs, only "default"
        ds = datasets.load_dataset(source, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - network, auth and cache failures all arrive as different types
        raise _hub_error(dataset, source, not path, e) from e
    if split == "train":
        ds = ds.shuffle(seed=seed * 1000 + epoch, buffer_size=_HUB_SHUFFLE_BUFFER)
    return _hub_texts(ds, text_field, source)


def _hub_texts(rows, text_field: str, source: str) -> Iterator[str]:
    for row in rows:
        if text_field not in row:
            raise _missing_field(source, text_field, list(row))
        yield row[text_field]


def _hub_error(dataset: str, source: str, from_hub: bool, error: Exception) -> RuntimeError:
    offline_env = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    if from_hub and (offline_env or isinstance(error, (ConnectionError, TimeoutError))):
        return RuntimeError(f"could not load dataset {source!r} (training.dataset={dataset!r}): the machine seems "
                            f"offline ({detail}); use training.dataset='stdlib', or a local copy via "
                            f"training.dataset_path (dataset='files' for plain .txt/.jsonl/.parquet)")
    return RuntimeError(f"could not load dataset {source!r} (training.dataset={dataset!r}): {detail}")
