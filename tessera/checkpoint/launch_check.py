"""What the launch pre-check reads of the checkpoints a run starts from, before any rank starts (torch-free).

The launch check (`python -m tessera.config`, which run_train.sh runs, or a one-process run) reads the checkpoint
it would resume from whole, against its checksums, so that a damaged one named by `checkpoint.load_step`, or a
folder whose every checkpoint is damaged, is refused before ranks start; each rank's own pre-check reads sizes
only (the ranks then check the content, each a share). The same holds for the folder `initial_load_path` names
when it has a `.complete` marker (a Tessera checkpoint or export); a Hugging Face folder without one (from a hub)
has its safetensors files' headers checked against their sizes, and a quantized one each weight's scales (present,
of the shape its blocks need: tessera.checkpoint.quantization), on every pre-check (it reads a few bytes)."""

import glob
import json
import os

from tessera.checkpoint import quantization
from tessera.checkpoint.folder import Damaged, all_damaged, damage, resume_point
from tessera.config import ConfigError


def launch_resume_point(cfg, launch: bool) -> tuple[tuple[int, str, dict] | None, list[Damaged]]:
    """(step, path, marker) the run would resume from, and the complete checkpoints skipped as damaged (each skip
    said by rank 0; run_train.sh's launch check shows errors only); ConfigError for a `load_step` missing or
    damaged, or every checkpoint damaged (unless checkpoint.start_fresh_if_all_damaged). `launch`: check the files'
    checksums, not only their sizes."""
    root, damaged = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder), []
    try:
        found = resume_point(root, cfg.checkpoint.load_step, content=launch, damaged=damaged)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if (refusal := all_damaged(root, found, damaged)) and not cfg.checkpoint.start_fresh_if_all_damaged:
        raise ConfigError(refusal)
    return found, damaged


def check_initial_load(cfg, launch: bool) -> None:
    """The folder checkpoint.initial_load_path names (read when the run resumes nothing): with a marker, its
    files against their checksums (`launch`); Hugging Face safetensors, whole by their headers."""
    c = cfg.checkpoint
    if not (c.enable and c.initial_load_path and os.path.exists(c.initial_load_path)):
        return
    folder = c.initial_load_path if os.path.isdir(c.initial_load_path) else os.path.dirname(c.initial_load_path)
    if launch and (problem := damage(folder)):
        raise ConfigError(f"checkpoint.initial_load_path: {problem}")
    if not c.initial_load_in_hf:
        return
    for file in sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors"))):
        if problem := safetensors_problem(file):
            raise ConfigError(f"checkpoint.initial_load_path: {file} {problem}; download or export it again")
    try:
        quantization.describe(folder)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def safetensors_problem(file: str) -> str | None:
    """What makes `file` no whole safetensors file, by its header (8 bytes of length, a JSON table of tensors
    and their byte ranges) against its size; None when it is whole."""
    size = os.path.getsize(file)
    with open(file, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            return f"is truncated or not a safetensors file ({size} bytes, too few for the header it starts with)"
        try:
            header = json.loads(fh.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is not a safetensors file (its header is not a table of tensors)"
    if size != 8 + length + end:
        return f"has {size} bytes, but its header describes {8 + length + end}: it was cut short or altered"
    return None
