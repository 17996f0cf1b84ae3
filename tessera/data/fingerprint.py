"""Cheap fingerprints of a run's input files, recorded in each checkpoint (`inputs.json`) and compared when it is
resumed: a data file rewritten in place, or a tokenizer replaced under the same path, would otherwise resume at
the saved sample position in other data, or train on other ids, without a word.

A data file (training.dataset = files, not prepared: prepared folders record their own content) is fingerprinted
by its size and the xxh3_64 of a few blocks sampled over it (the whole file when small), so that even a large
corpus costs a few reads per file; the tokenizer's `tokenizer.json` is hashed whole. Modification times are
recorded for the message, not compared: a copy of the same files (a new node, a restored backup) resumes.
Files are compared in the order the loader reads them, whatever their path: data moved elsewhere, unchanged,
resumes too (preflight names the new path).
"""

import json
import os

import xxhash

from tessera.config.manager import ConfigError

RECORD = "inputs.json"  # in each full checkpoint
DIGEST = "xxh3_64"
SAMPLES, BLOCK = 8, 4096  # blocks hashed per data file, evenly spaced from its first to its last byte


def file_print(path: str, whole: bool = False) -> dict:
    """{file, size, mtime_ns, xxh3_64} of `path`: its digest over SAMPLES blocks, or its whole content when
    `whole` or small."""
    digest, stat = xxhash.xxh3_64(), os.stat(path)
    with open(path, "rb") as fh:
        if whole or stat.st_size <= SAMPLES * BLOCK:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
        else:
            for k in range(SAMPLES):
                fh.seek((stat.st_size - BLOCK) * k // (SAMPLES - 1))
                digest.update(fh.read(BLOCK))
    return {"file": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, DIGEST: digest.hexdigest()}


def inputs_print(cfg) -> dict:
    """The fingerprints of what this run reads that a checkpoint's position depends on: {"data": [file prints,
    in reading order]} for raw data files, {"tokenizer": file print} for a tokenizer.json; either left out when
    the run has none."""
    from tessera.data import sources, tokens
    from tessera.data.records import DataError

    t, record = cfg.training, {}
    if t.dataset == "files" and t.dataset_path and not t.dataset_mix and not tokens.wanted(t):
        try:
            record["data"] = [file_print(str(f)) for f in sources._resolve_files(t.dataset_path)]
        except (DataError, OSError):  # nothing to read: the data check says so
            pass
    tokenizer = os.path.join(cfg.model.hf_assets_path, "tokenizer.json") if cfg.model.hf_assets_path else ""
    if tokenizer and os.path.isfile(tokenizer):
        record["tokenizer"] = file_print(tokenizer, whole=True)
    return record


def _changed(old: dict, new: dict) -> str | None:
    if old["size"] != new["size"]:
        return f"{old['size']} bytes then, {new['size']} now"
    if old[DIGEST] != new[DIGEST]:
        return f"the same size, other content (its sampled {DIGEST} was {old[DIGEST]}, is {new[DIGEST]})"
    return None


def differences(saved: dict, now: dict) -> list[tuple[str, str]]:
    """(config key, what differs) for each input recorded in `saved` (a checkpoint's record) that `now` (this
    run's) does not match; inputs one of them lacks are not compared."""
    found = []
    if "tokenizer" in saved and "tokenizer" in now and (why := _changed(saved["tokenizer"], now["tokenizer"])):
        found.append(("model.hf_assets_path", f"{now['tokenizer']['file']} has changed ({why})"))
    old, new = saved.get("data"), now.get("data")
    if old is not None and new is not None:
        if len(old) != len(new):
            gone = sorted({f["file"] for f in old} - {f["file"] for f in new})
            added = sorted({f["file"] for f in new} - {f["file"] for f in old})
            found.append(("training.dataset_path", f"{len(new)} data files match, {len(old)} did"
                          + (f" (no longer: {gone[0]}{' ...' if len(gone) > 1 else ''})" if gone else "")
                          + (f" (new: {added[0]}{' ...' if len(added) > 1 else ''})" if added else "")))
        else:
            for before, after in zip(old, new, strict=True):
                if why := _changed(before, after):
                    found.append(("training.dataset_path", f"{after['file']} has changed ({why})"))
                    break
    return found


def check_resume(cfg, path: str, data: bool = True) -> None:
    """Resuming the checkpoint at `path`: the tokenizer is the one it read, and with `data` (its data position is
    loaded) so are the data files (its RECORD; older checkpoints have none, and resume). Read by the launcher and
    each node's first rank (a few blocks per file)."""
    if cfg.checkpoint.accept_changed_data or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        with open(os.path.join(path, RECORD)) as fh:
            saved = json.load(fh)
    except (OSError, ValueError):  # none (an older checkpoint); a damaged one is the marker's to find
        return
    for key, what in differences(saved, inputs_print(cfg)):
        if key == "model.hf_assets_path":  # the model's weights are those of the ids it read
            raise ConfigError(f"{key}: {what} since the checkpoint at {path}, whose model learned that tokenizer's "
                              f"ids; resume with that tokenizer, or set --checkpoint.accept_changed_data to go on "
                              f"with this one on purpose")
        if data:
            raise ConfigError(f"{key}: {what} since the checkpoint at {path}, whose data position counts samples of "
                              f"what it read; resume with those files, add dataloader to "
                              f"checkpoint.exclude_from_loading to start this data at its first sample, or set "
                              f"--checkpoint.accept_changed_data to resume the position in the changed files on "
                              f"purpose (e.g. documents appended)")
