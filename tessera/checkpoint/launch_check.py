"""What the launch pre-check reads of the checkpoints a run starts from, before any rank starts (torch-free).

The launcher's pre-check (no LOCAL_RANK: `python -m tessera.config`, or a one-process run) reads the checkpoint
it would resume from whole, against its checksums, so that a damaged one named by `checkpoint.load_step`, or a
folder whose every checkpoint is damaged, is refused before ranks start; each rank's own pre-check reads sizes
only (the ranks then check the content, each a share)."""

import os

from tessera.checkpoint.folder import all_damaged, resume_point
from tessera.config import ConfigError


def launch_resume_point(cfg, launcher: bool) -> tuple[int, str, dict] | None:
    """(step, path, marker) the run would resume from, quietly (the ranks say what they skip); ConfigError for a
    `load_step` missing or damaged, or every checkpoint damaged (unless checkpoint.start_fresh_if_all_damaged).
    `launcher`: check the files' checksums, not only their sizes."""
    root, damaged = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder), []
    try:
        found = resume_point(root, cfg.checkpoint.load_step, content=launcher, report=False, damaged=damaged)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (refusal := all_damaged(root, found, damaged)) and not cfg.checkpoint.start_fresh_if_all_damaged:
        raise ConfigError(refusal)
    return found
