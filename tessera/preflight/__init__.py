"""The checks run before any process group or file exists, each failure one ConfigError line: the launcher
(`python -m tessera.config`, which run_train.sh runs before starting ranks), tessera.train, estimate, plan and
loss_compare call `validate`. The schema they check is tessera.schema's.

`validate` runs CHECKS in order over a `Draft` of the run: a few of them resolve something (the family, the
architecture and the checkpoint it resumes, the data plan, the parallel degrees) that the checks after them read;
the others only refuse. The order is the order of the questions a user would ask: which model, where it writes,
what it resumes, what it reads, how it is laid out, then the options of its features."""

from __future__ import annotations

from tessera.ft import check as ft_check
from tessera.preflight import data, layout, options, resume
from tessera.preflight.draft import Draft
from tessera.run_plan import ResolvedRun, batch_of

CHECKS = (
    options.replica_group,  # resolves draft.cfg: under fault tolerance, this replica group's folders
    options.model,  # resolves draft.family
    options.folders,
    options.initial_load_path,
    resume.resume_point,  # resolves draft.resume and draft.args (the tokenizer's vocabulary not yet in)
    options.tokenizer_file,
    data.plan,  # resolves draft.data
    data.attention_mask,  # resolves draft.cfg's model.attn_mask_type (auto)
    data.dataset,
    resume.tokenizer,  # resolves draft.tokenizer_vocab
    resume.tokenizer_vocab,
    resume.data_fingerprint,
    resume.vocabulary,  # resolves draft.args, final
    options.room,
    layout.experts,
    layout.dims,  # resolves draft.dims
    layout.global_batch,
    options.fault_tolerance,
    options.live_groups,
    layout.family_check,
    layout.family_layout,
    data.files,
    layout.pipeline,
    layout.context_parallel,
    options.checkpoint,
    options.converters,
    options.activation_checkpoint,
    options.compile,
    options.muon,
    options.lora,  # resolves draft.cfg's lora.target_modules (Hugging Face names as the model's own)
    resume.lora,
    options.evaluation,
    options.live_memory,
    layout.vocabulary,
)


def validate(cfg, world_size: int, launch: bool = False, training: bool = False) -> ResolvedRun:
    """Check everything that can be checked without torch; returns what it resolved (`cfg` is left as given: the
    record's config is the one the run runs: under fault tolerance, this replica group's). `launch`: the check
    before ranks start, which also reads the checkpoint a run starts from against its checksums and asks the
    lighthouse about the live groups. `training`: for a run that will save (its launch check and its ranks), not a
    plan or an estimate of it."""
    draft = Draft(cfg=cfg, world_size=world_size, launch=launch, training=training)
    for check in CHECKS:
        check(draft)
    return ResolvedRun(cfg=draft.cfg, family=draft.family, args=draft.args, dims=draft.dims, resume=draft.resume,
                       damaged=draft.damaged,
                       batch=batch_of(draft.cfg, draft.dims, ft_check.groups(draft.cfg)), data=draft.data)
