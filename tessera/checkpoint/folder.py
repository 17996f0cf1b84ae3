"""The checkpoint folder on disk, torch-free so the launch pre-check can read it before any rank starts.

`<dump_folder>/<checkpoint.folder>/step-N/` holds one checkpoint: DCP files, `config.toml` (the run's config),
`model.json` (the architecture it holds: family and args) and `.complete`, a JSON record of the files and their
sizes written last. Its kind is "full" (model, optimizer and training state: a resume point) or "model" (weights
only: a seed or a converted checkpoint, a starting point). Exports (model-only, a dtype, Hugging Face) live under
`exports/step-N/` and are never resumed from.
"""

import json
import logging
import os
import re
import tomllib

log = logging.getLogger("tessera")
MARKER = ".complete"
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
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def verify(path: str, marker: dict) -> None:
    """Every file the marker lists exists with its recorded size; raises CorruptCheckpoint naming the file."""
    for name, size in marker["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpoint(f"{file} is missing")
        if os.path.getsize(file) != size:
            raise CorruptCheckpoint(f"{file} has {os.path.getsize(file)} bytes, {size} were written")


def write_marker(path: str, step: int, kind: str) -> None:
    files = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path)) if not n.startswith(MARKER)}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"step": step, "kind": kind, "files": files}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MARKER))  # atomic: the checkpoint exists from here on


def _usable(step: int, path: str, exact: bool) -> dict | None:
    """The marker of a complete, intact checkpoint; None (logged) or, when `exact`, ValueError otherwise."""
    marker = read_marker(path)
    try:
        if marker is None:
            raise CorruptCheckpoint(f"no {MARKER} marker: its save was interrupted")
        verify(path, marker)
    except CorruptCheckpoint as e:
        if exact:
            raise ValueError(f"checkpoint.load_step: step {step} at {path} is not usable: {e}") from None
        log.warning(f"skipping checkpoint step {step} ({e}); falling back to an earlier one")
        return None
    return marker


def resume_point(root: str, load_step: int = -1) -> tuple[int, str, dict] | None:
    """(step, path, marker) to start from: exactly `load_step` when >= 0, else the newest complete full
    checkpoint, else the newest complete weights-only one (a seed or a conversion). Raises ValueError for a
    `load_step` that is missing or unusable."""
    folders = step_folders(root)
    if load_step >= 0:
        path = dict(folders).get(load_step)
        if path is None:
            have = ", ".join(str(s) for s, _ in folders) or "none"
            raise ValueError(f"checkpoint.load_step: no checkpoint for step {load_step} under {root} (steps: {have})")
        marker = _usable(load_step, path, exact=True)
        if marker.get("kind") not in ("full", "model"):
            raise ValueError(f"checkpoint.load_step: step {load_step} at {path} is a '{marker.get('kind')}' export, "
                             f"not a checkpoint")
        return load_step, path, marker
    weights_only = None
    for step, path in folders:
        marker = _usable(step, path, exact=False)
        if marker is None:
            continue
        if marker.get("kind") == "full":
            return step, path, marker
        if marker.get("kind") == "model" and weights_only is None:
            weights_only = step, path, marker
    return weights_only


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
