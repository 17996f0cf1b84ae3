"""What validate has resolved of a run so far: what each check reads (tessera/preflight/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.checkpoint.folder import Damaged
    from tessera.config import JobConfig
    from tessera.models.contract import Family
    from tessera.parallel.dims import ParallelDims
    from tessera.run_plan import DataPlan, ResumePoint


@dataclass
class Draft:
    cfg: JobConfig  # as given, then as the run runs it (replica_group: this group's folders under fault tolerance)
    world_size: int
    launch: bool  # the check before ranks start (see validate)
    training: bool  # a run that will save, not a plan or an estimate of it
    family: Family | None = None  # resolved by the checks, in CHECKS' order
    args: object = None  # the architecture; final (the tokenizer's vocabulary in) once `vocabulary` ran
    tokenizer_vocab: int | None = None  # the tokenizer's (the built-in one's without model.hf_assets_path)
    resume: ResumePoint | None = None
    damaged: tuple[Damaged, ...] = ()  # the complete checkpoints skipped as damaged on the way to `resume`
    resumed_config: dict | None = None  # the config.toml of the full checkpoint resumed, read once
    data: DataPlan | None = None
    dims: ParallelDims | None = None
