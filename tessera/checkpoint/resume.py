"""Which checkpoint a run resumes: the one validate planned, its content checked by the ranks (each a share), or,
found damaged, the newest intact one before it; every rank the same."""

import logging
import os
from collections.abc import Collection

import torch.distributed as dist

from tessera.checkpoint.folder import (
    DIGEST,
    CorruptCheckpoint,
    Damaged,
    all_damaged,
    no_marker,
    read_marker,
    resume_point,
    skip_message,
    verify,
    warn_once,
)
from tessera.config import ConfigError, JobConfig
from tessera.distributed import on_rank0
from tessera.run_plan import ResumePoint

log = logging.getLogger("tessera")


def verify_shared(path: str, marker: dict) -> str | None:
    """The content check of a checkpoint (every file against its digest), its files dealt out among the ranks so
    each is read once; the first problem found, the same on every rank, or None."""
    names = sorted(marker["files"], key=lambda n: (-marker["files"][n], n))  # the big ones first, round-robin
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        verify(path, marker, names=set(names[rank::world]))
        problem = None
    except CorruptCheckpoint as e:
        problem = str(e)
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    return problem


def confirm_resume(cfg: JobConfig, planned: ResumePoint | None, known: Collection[Damaged],
                   damaged: set[str]) -> tuple[int, str, dict] | None:
    """The checkpoint the pre-check planned to resume (validate's `resume`), as (step, path, marker), its content
    checked: by the ranks, each a share, unless this process's pre-check has just read it whole (a one-process run).
    Found damaged (a bare torchrun's pre-check reads sizes only, or it was damaged since), it is skipped for an older
    one as `find_resume` finds it, or refused when checkpoint.load_step names it. `known`: the ones the pre-check
    skipped as damaged (and said so; not looked at again); `damaged` gets every damaged path (set aside later)."""
    damaged.update(d.path for d in known)
    if planned is None:
        return None
    if dist.is_initialized():  # each rank planned on its own: they load one checkpoint or none
        planned_by = [None] * dist.get_world_size()
        dist.all_gather_object(planned_by, planned.path)
        if len(set(planned_by)) > 1:
            raise ConfigError(f"job.dump_folder: the ranks found different checkpoints to resume ("
                              f"{', '.join(sorted(set(planned_by)))}): is another job saving into it? Relaunch "
                              f"once it has stopped, or pick another job.dump_folder")
    marker = read_marker(planned.path)
    if marker is None:
        problem = no_marker(planned.path)
    else:
        problem = None if planned.content_checked else verify_shared(planned.path, marker)
    if problem is None:
        if DIGEST not in marker and (not dist.is_initialized() or dist.get_rank() == 0):
            log.info(f"checkpoint step {planned.step} records no checksums (written before they existed): its files "
                     f"were checked by size only")
        return planned.step, planned.path, marker
    if cfg.checkpoint.load_step >= 0:
        raise ConfigError(f"checkpoint.load_step: step {planned.step} at {planned.path} is not usable: {problem}")
    warn_once(skip_message(planned.step, problem), set())
    damaged.add(planned.path)
    return find_resume(cfg, damaged, known=[*known, Damaged(planned.step, planned.path, planned.kind, problem)])


def find_resume(cfg: JobConfig, damaged: set[str] | None = None, content: bool = True,
                known: Collection[Damaged] = ()) -> tuple[int, str, dict] | None:
    """The checkpoint this run starts from, as rank 0 finds it (every rank gets the same answer), its content
    checked (unless not `content`: its sizes only, for a look at its architecture): a damaged one is skipped with
    one warning naming the file (an explicit load_step is refused), and its path added to `damaged`. `known`: the
    complete checkpoints already found damaged (not looked at again; the refusal of a folder with none intact
    counts them)."""
    if not cfg.checkpoint.enable:
        return None
    root, load_step = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder), cfg.checkpoint.load_step
    skipped = [d.step for d in known]
    warned: set[str] = set()  # this run's: each look-up below re-reads the folders, each skip is said once
    broken: dict[int, Damaged] = {d.step: d for d in known}  # the complete checkpoints found damaged, by step

    def look():
        found_damaged: list[Damaged] = []
        return resume_point(root, load_step, content=False, skip=skipped, warned=warned,
                            damaged=found_damaged), found_damaged

    while True:
        try:
            found, by_size = on_rank0(look)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        broken.update({d.step: d for d in by_size})
        if damaged is not None:
            damaged.update(d.path for d in by_size)
        if found is None or found[2].get("kind") != "full":
            if (refusal := all_damaged(root, found, broken.values())) and not cfg.checkpoint.start_fresh_if_all_damaged:
                raise ConfigError(refusal)
        if found is None:
            return None
        step, path, marker = found
        problem = verify_shared(path, marker) if content else None
        if problem is None:
            if content and DIGEST not in marker and (not dist.is_initialized() or dist.get_rank() == 0):
                log.info(f"checkpoint step {step} records no checksums (written before they existed): its files "
                         f"were checked by size only")
            return found
        if load_step >= 0:
            raise ConfigError(f"checkpoint.load_step: step {step} at {path} is not usable: {problem}")
        warn_once(skip_message(step, problem), warned)
        skipped.append(step)
        broken[step] = Damaged(step, path, marker.get("kind"), problem)
        if damaged is not None:
            damaged.add(path)
