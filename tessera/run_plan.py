"""What `tessera.preflight.validate` resolved of a config, once, as one immutable record (`ResolvedRun`): the
family, the architecture, the parallel degrees, the batch arithmetic, the checkpoint it resumes and what it found
of the data. The trainer, the estimate and the planner read it instead of resolving the same things again.
Torch-free and low in the import graph: the schema, the model contract and the parallel degrees are all it needs."""

from dataclasses import dataclass

from tessera.config.sections import JobConfig
from tessera.models.contract import Family
from tessera.parallel.dims import ParallelDims


def accumulation_steps(global_batch_size: int, local_batch_size: int, data_parallel: int) -> int:
    """Gradient-accumulation steps of an optimizer step: `global_batch_size` sequences over `data_parallel` ranks
    (replica groups included) of `local_batch_size` each; -1 (the global batch follows the layout) is one.
    validate checks that it divides."""
    return 1 if global_batch_size == -1 else global_batch_size // (local_batch_size * data_parallel)


@dataclass(frozen=True)
class Batch:
    """The batch arithmetic of one optimizer step."""
    local: int  # sequences a rank takes per forward-backward (training.local_batch_size)
    data_parallel: int  # ranks that take different sequences: the data-parallel degree x replica groups
    accumulation: int  # forward-backwards of `local` sequences per optimizer step (gradient accumulation)
    micro_batches: int  # forward passes per optimizer step (under PP each `local` is cut into micro-batches): each
    # one's share of the step's mean loss is 1 / this
    global_sequences: int  # sequences per optimizer step over the whole job
    global_tokens: int  # global_sequences x training.seq_len


def forward_passes(cfg: JobConfig, pp: int, accumulation: int) -> int:
    """Forward passes per optimizer step of `accumulation` steps under a pipeline degree `pp` (each local batch cut
    into pipeline micro-batches)."""
    per_pass = cfg.parallelism.pipeline_parallel_microbatch_size if pp > 1 else cfg.training.local_batch_size
    return accumulation * (cfg.training.local_batch_size // per_pass)


def batch_of(cfg: JobConfig, dims: ParallelDims, groups: int) -> Batch:
    """The batch arithmetic of `cfg` laid out as `dims` over `groups` replica groups (1 without fault tolerance)."""
    t, dp = cfg.training, dims.dp * groups
    accumulation = accumulation_steps(t.global_batch_size, t.local_batch_size, dp)
    sequences = t.local_batch_size * dp * accumulation
    return Batch(local=t.local_batch_size, data_parallel=dp, accumulation=accumulation,
                 micro_batches=forward_passes(cfg, dims.pp, accumulation), global_sequences=sequences,
                 global_tokens=sequences * t.seq_len)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, as the pre-check found it (the ranks check its content, unless
    `content_checked`, and skip it for an older one if it is damaged: tessera.checkpoint.resume.confirm_resume)."""
    step: int
    path: str
    kind: str | None  # the marker's: "full" (model, optimizer, data position...) or "model" (weights only)
    content_checked: bool = False  # its files read against their checksums by this process's pre-check (the
    # launch check of a one-process run); the ranks' own pre-checks read sizes only


@dataclass(frozen=True)
class DataPlan:
    """What validation found of the data."""
    own: bool  # the family brings its own data (OwnTraining.data), checked by its own check
    prepared: bool  # pre-tokenized folders, memory-mapped (training.dataset tokenized, or files on a prepared folder)
    resumes_position: bool  # the run resumes a checkpoint's data position (a full checkpoint, dataloader loaded)


@dataclass(frozen=True)
class ResolvedRun:
    """One validated run. `cfg` is the config as it runs: under fault tolerance with this replica group's folders
    (tessera.ft.check.place_group); the config given to validate is left as it was."""
    cfg: JobConfig
    family: Family  # the contract of cfg.model.name
    args: object  # the architecture to build: the flavor's, config.json's or the resumed checkpoint's; a flavor
    # whose vocabulary is the tokenizer's keeps its table's (or the checkpoint's) until the tokenizer is loaded
    dims: ParallelDims
    batch: Batch
    resume: ResumePoint | None
    damaged: tuple  # the complete checkpoints the pre-check skipped as damaged (tessera.checkpoint.folder.Damaged
    # each), which the ranks set aside
    data: DataPlan
