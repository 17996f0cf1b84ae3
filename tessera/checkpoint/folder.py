"""The checkpoint folder on disk, torch-free so the launch pre-check can read it before any rank starts.

`<dump_folder>/<checkpoint.folder>/step-N/` holds one checkpoint: DCP files, `config.toml` (the run's config),
`model.json` (the architecture it holds: family and args) and `.complete`, written last: a JSON record of every
file's size and its xxh3_64 digest, computed as the bytes were written (checkpoints written before digests existed
record sizes only, and are checked by size). Its kind is "full" (model, optimizer and training state: a resume
point) or "model" (weights only: a seed or a converted checkpoint, a starting point). Exports (model-only, a dtype,
Hugging Face) live under `exports/step-N/` and are never resumed from; they have markers too.
"""

import json
import logging
import mmap
import os
import re
import tomllib
from collections.abc import Collection
from typing import NamedTuple

import xxhash

log = logging.getLogger("tessera")
MARKER = ".complete"
DIGEST = "xxh3_64"  # the marker's key for {file name: hex digest}
MODEL_RECORD = "model.json"
EXPORTS = "exports"
_STEP = re.compile(r"step-(\d+)$")


class CorruptCheckpoint(RuntimeError):
    pass


def step_folders(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step-N folder, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _STEP.match(name))]
    return sorted(found, reverse=True)


def read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as fh:
            marker = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


class HashingFile:
    """A file opened for writing whose bytes are hashed as they go through `write`, in order: its digest equals
    the finished file's without reading it back. A `seek` (which no writer here makes) voids the digest."""

    def __init__(self, raw):
        self.raw, self.hash, self.in_order = raw, xxhash.xxh3_64(), True

    def write(self, data) -> int:
        written = self.raw.write(data)  # a buffered file: all of it, or an exception
        self.hash.update(data)
        return written

    def seek(self, *args) -> int:
        self.in_order = False
        return self.raw.seek(*args)

    def digest(self) -> str | None:
        return self.hash.hexdigest() if self.in_order else None

    def __getattr__(self, name):  # tell, flush, fileno, close, ...: the file's own
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()


def digest_file(file: str) -> str:
    """The xxh3_64 digest of a file's content (mapped, not copied: about twice as fast as reading it in blocks)."""
    with open(file, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return xxhash.xxh3_64().hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as content:
            return xxhash.xxh3_64(content).hexdigest()


def write_hashed(file: str, text: str) -> str:
    """Write `text` to `file`; its digest, from the bytes written."""
    with open(file, "wb") as raw:
        out = HashingFile(raw)
        out.write(text.encode())
    return out.digest()


def verify(path: str, marker: dict, content: bool = True, names: Collection[str] | None = None) -> None:
    """Every file the marker lists (or those of them in `names`) exists with its recorded size and, when
    `content` and the marker has digests, its recorded digest; raises CorruptCheckpoint naming the file."""
    digests = marker.get(DIGEST) or {}
    for name, size in marker["files"].items():
        if names is not None and name not in names:
            continue
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpoint(f"{file} is missing")
        if os.path.getsize(file) != size:
            raise CorruptCheckpoint(f"{file} has {os.path.getsize(file)} bytes, {size} were written")
        if content and name in digests and (found := digest_file(file)) != digests[name]:
            raise CorruptCheckpoint(f"{file} changed after it was written (its {DIGEST} is {found}, "
                                    f"{digests[name]} was written)")


def write_marker(path: str, step: int, kind: str, digests: dict[str, str | None] | None = None) -> None:
    """The marker for the files in `path`: their sizes and digests. `digests`: those computed as the files were
    written ({name: digest}); a file without one is read back and hashed here."""
    names = [n for n in sorted(os.listdir(path)) if not n.startswith(MARKER)]
    files = {n: os.path.getsize(os.path.join(path, n)) for n in names}
    known = digests or {}
    record = {n: known.get(n) or digest_file(os.path.join(path, n)) for n in names}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"step": step, "kind": kind, "files": files, DIGEST: record}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MARKER))  # atomic: the checkpoint exists from here on


def warn_once(message: str, warned: set[str]) -> None:
    """A warning logged once per `warned` (what this run's look-up has already said: a look-up repeated within a
    run says it once, the next run again), by rank 0 alone (each rank runs the pre-check; rank 0 then loads)."""
    if message not in warned and os.environ.get("RANK", "0") == "0":
        warned.add(message)
        log.warning(message)


def skip_message(step: int, problem) -> str:
    return f"skipping checkpoint step {step} ({problem}); falling back to an earlier one"


def _usable(step: int, path: str, exact: bool, content: bool, report: bool, warned: set[str],
            damaged: list | None = None) -> dict | None:
    """The marker of a complete, intact checkpoint; None (logged when `report`; a complete one, damaged, added
    to `damaged` as a Damaged) or, when `exact`, ValueError otherwise."""
    marker = read_marker(path)
    try:
        if marker is None:
            raise CorruptCheckpoint(no_marker(path))
        verify(path, marker, content)
    except CorruptCheckpoint as e:
        if exact:
            raise ValueError(f"checkpoint.load_step: step {step} at {path} is not usable: {e}") from None
        if report:
            warn_once(skip_message(step, e), warned)
        if marker is not None and damaged is not None:
            damaged.append(Damaged(step, path, marker.get("kind"), str(e)))
        return None
    return marker


class Damaged(NamedTuple):
    """A complete checkpoint (it has its marker) whose files do not match it."""
    step: int
    path: str
    kind: str | None  # "full" or "model"
    problem: str


DAMAGED = "damaged"  # checkpoint.folder/damaged/step-N: damaged checkpoints set aside, kept for the user


def all_damaged(root: str, found: tuple[int, str, dict] | None, damaged: Collection[Damaged]) -> str | None:
    """The refusal of a resume whose every checkpoint is damaged (`found`: what is intact, if anything; a
    weights-only one does not stand in for damaged full ones): it would start over from step 0. None otherwise."""
    if not damaged or (found is not None and (found[2].get("kind") == "full"
                                              or all(d.kind != "full" for d in damaged))):
        return None
    listed = "; ".join(f"step {d.step}: {d.problem}" for d in sorted(damaged, reverse=True))
    over = f" from the weights-only step {found[0]}" if found is not None else " from step 0"
    return (f"job.dump_folder: every checkpoint under {root} is damaged ({listed}), so the run would start over"
            f"{over}; repair them, move them out of {root}, or set --checkpoint.start_fresh_if_all_damaged to "
            f"train from step 0 (they are then moved to {os.path.join(root, DAMAGED)} and kept)")


def resume_point(root: str, load_step: int = -1, content: bool = True, report: bool = True,
                 skip: Collection[int] = (), warned: set[str] | None = None,
                 damaged: list[Damaged] | None = None) -> tuple[int, str, dict] | None:
    """(step, path, marker) to start from: exactly `load_step` when >= 0, else the newest complete full
    checkpoint, else the newest complete weights-only one (a seed or a conversion). Raises ValueError for a
    `load_step` that is missing or unusable. `content`: check the files' digests too, not only their sizes
    (this reads the whole checkpoint); `report`: log the checkpoints skipped; `skip`: steps known damaged;
    `warned`: what the run's earlier look-ups logged (not said again); `damaged`: gets the complete
    checkpoints looked at and found damaged."""
    warned = set() if warned is None else warned
    folders = [(step, path) for step, path in step_folders(root) if step not in skip]
    if load_step >= 0:
        path = dict(folders).get(load_step)
        if path is None:
            have = ", ".join(str(s) for s, _ in folders) or "none"
            raise ValueError(f"checkpoint.load_step: no checkpoint for step {load_step} under {root} (steps: {have})")
        marker = _usable(load_step, path, exact=True, content=content, report=report, warned=warned)
        if marker.get("kind") not in ("full", "model"):
            raise ValueError(f"checkpoint.load_step: step {load_step} at {path} is a '{marker.get('kind')}' export, "
                             f"not a checkpoint")
        return load_step, path, marker
    weights_only = None
    for step, path in folders:
        marker = _usable(step, path, exact=False, content=content, report=report, warned=warned, damaged=damaged)
        if marker is None:
            continue
        if marker.get("kind") == "full":
            return step, path, marker
        if marker.get("kind") == "model" and weights_only is None:
            weights_only = step, path, marker
    return weights_only


def no_marker(path: str) -> str:
    """Why `path` has no marker to check it against: none was written, or it is corrupt."""
    if os.path.exists(os.path.join(path, MARKER)):
        return f"its {MARKER} marker is corrupt (not the JSON record Tessera writes), so its files cannot be checked"
    return f"no {MARKER} marker: its save was interrupted"


def damage(path: str) -> str | None:
    """What is wrong with a folder Tessera wrote (a checkpoint or an export), its content included: a line naming
    the file, or the marker a DCP checkpoint with Tessera's records lacks (a save that did not finish, as resume
    skips it); None when it is intact or not Tessera's (a Hugging Face download, another tool's DCP folder)."""
    marker = read_marker(path)
    try:
        if marker is None and (os.path.exists(os.path.join(path, MARKER)) or _unfinished_save(path)):
            raise CorruptCheckpoint(no_marker(path))
        if marker is not None:
            verify(path, marker)
    except CorruptCheckpoint as e:
        state = "damaged" if os.path.exists(os.path.join(path, MARKER)) else "unfinished"
        return f"'{path}' is {state}: {e}; pick another checkpoint"
    return None


def _unfinished_save(path: str) -> bool:
    """A DCP checkpoint that holds the records a Tessera save writes before its marker (config.toml, model.json)."""
    return os.path.isfile(os.path.join(path, ".metadata")) and any(
        os.path.isfile(os.path.join(path, name)) for name in (MODEL_RECORD, "config.toml"))


def read_model_record(path: str) -> dict | None:
    """The checkpoint's `model.json` ({"family", "args"}), or None for checkpoints written before it existed."""
    try:
        with open(os.path.join(path, MODEL_RECORD)) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{os.path.join(path, MODEL_RECORD)} is unreadable ({e}); pick another job.dump_folder "
                         f"or checkpoint.load_step") from None


def read_saved_config(path: str) -> dict:
    """The config.toml a checkpoint was written with, as a nested dict ({} when it has none)."""
    try:
        with open(os.path.join(path, "config.toml"), "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return {}
