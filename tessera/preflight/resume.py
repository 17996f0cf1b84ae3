"""The checkpoint a run resumes from (or starts from), and that it agrees with what is asked: the model, the
optimizer state, the data position, the tokenizer."""

from __future__ import annotations

import dataclasses
import logging
import os

from tessera import architecture
from tessera.checkpoint.folder import read_saved_config
from tessera.checkpoint.launch_check import check_initial_load, launch_resume_point
from tessera.config import ConfigError
from tessera.preflight.draft import Draft
from tessera.run_plan import ResumePoint

log = logging.getLogger("tessera")


def resume_point(d: Draft) -> None:
    """Resolves the checkpoint the run would resume from, checked against what is asked (data order, optimizer,
    steps), and the architecture the run will build (its vocabulary may still follow the tokenizer: `vocabulary`)."""
    cfg, found = d.cfg, None
    if cfg.checkpoint.enable:
        found, damaged = launch_resume_point(cfg, d.launch)
        d.damaged = tuple(damaged)
    if found is not None and found[2].get("kind") == "full":
        step, path, _ = found
        d.resumed_config = read_saved_config(path)
        if "dataloader" not in cfg.checkpoint.exclude_from_loading:
            check_resumed_data(cfg, path, d.resumed_config.get("training", {}))
        if "optimizer" not in cfg.checkpoint.exclude_from_loading:
            _check_resumed_optimizer(cfg, path, d.resumed_config.get("optimizer", {}))
        _check_resumed_family_options(cfg, path, d.resumed_config, d.family)
        if cfg.training.steps < step:
            raise ConfigError(f"training.steps: {cfg.training.steps} is below step {step}, which the checkpoint at "
                              f"{path} reached; raise training.steps to extend the run, or pick another "
                              f"job.dump_folder")
    if found is None:  # then the run starts from initial_load_path, if given
        check_initial_load(cfg, d.launch)
    d.resume = ResumePoint(step=found[0], path=found[1], kind=found[2].get("kind"), content_checked=d.launch) \
        if found else None
    d.args = architecture.resolve(architecture.request(d.family, cfg), None, d.resume.path if d.resume else None)


def tokenizer(d: Draft) -> None:
    """Resolves draft.tokenizer_vocab: the vocabulary of the tokenizer the ranks load (model.hf_assets_path's, else
    the built-in one), read once for the checks after it."""
    from tessera.data.tokenizer import build_tokenizer

    d.tokenizer_vocab = build_tokenizer(d.cfg.model.hf_assets_path).vocab_size


def tokenizer_vocab(d: Draft) -> None:
    """Resuming: the tokenizer's vocabulary fits the checkpoint's model, and is the one it was trained with where
    the flavor takes the tokenizer's; refused here rather than by the ranks once they have loaded it."""
    cfg, resume, vocab = d.cfg, d.resume, d.tokenizer_vocab
    if d.data.own or not cfg.model.hf_assets_path or resume is None:
        return
    path = os.path.join(cfg.model.hf_assets_path, "tokenizer.json")
    takes = cfg.model.flavor in d.family.takes_tokenizer_vocab
    if vocab > d.args.vocab_size or (takes and vocab != d.args.vocab_size):
        raise ConfigError(f"model.hf_assets_path: the tokenizer {path} has {vocab} tokens, but the model of the "
                          f"checkpoint at {resume.path} has a vocabulary of {d.args.vocab_size}: it was trained with "
                          f"another tokenizer; resume with that one, or pick another job.dump_folder")


def vocabulary(d: Draft) -> None:
    """Resolves the architecture the ranks build, final: for a flavor that takes it, with the vocabulary of the
    tokenizer they load, checked against the flavor's, config.json's or the resumed checkpoint's (the checks before
    it name a changed tokenizer more plainly)."""
    d.args = architecture.resolve(architecture.request(d.family, d.cfg), d.tokenizer_vocab,
                                  d.resume.path if d.resume else None)


def data_fingerprint(d: Draft) -> None:
    """Resuming: the tokenizer is the one the model learned; the files its data position counts in, the same."""
    if d.data.own or d.resume is None:  # a family with its own data checks it in its check
        return
    from tessera.data import fingerprint

    fingerprint.check_resume(d.cfg, d.resume.path, data="dataloader" not in d.cfg.checkpoint.exclude_from_loading)


# [optimizer] settings that decide the optimizer's state (Muon's momentum or Adam's moments per matrix) and its
# parameter groups (their lr and weight decay are saved with them): a checkpoint's state loads only into the same.
OPTIMIZER_STATE = ("weight_decay_exclude", "embedding_lr_multiplier", "output_lr_multiplier")


_STATE_KIND = {"Adam": "moments", "AdamW": "moments"}  # optimizers whose saved state the other can load


def lora(d: Draft) -> None:
    """The adapters the resumed checkpoint holds (after options.lora, which names the targets as the model does)."""
    if d.resumed_config is not None:
        _check_resumed_lora(d.cfg, d.resume.path, d.resumed_config.get("lora", {}))


def _check_resumed_lora(cfg, path: str, saved: dict) -> None:
    """The adapters a checkpoint holds are those of its rank and targets (and none without LoRA); alpha and dropout
    change with a line."""
    ours, defaults = dataclasses.asdict(cfg.lora), dataclasses.asdict(type(cfg.lora)())
    theirs = {key: saved.get(key, defaults[key]) for key in ours}
    for key in ("rank", "target_modules"):
        if ours[key] != theirs[key] and (ours["rank"] or theirs["rank"]):
            raise ConfigError(f"lora.{key}: {ours[key]!r}, but the checkpoint at {path} holds adapters of "
                              f"lora.{key} = {theirs[key]!r}; set it back to resume, or start in another "
                              f"job.dump_folder from checkpoint.initial_load_path")
    for key in ("alpha", "dropout"):
        if ours["rank"] and ours[key] != theirs[key]:
            log.warning(f"lora.{key}: {theirs[key]} in the checkpoint at {path}, {ours[key]} from here on")


def _check_resumed_family_options(cfg, path: str, saved: dict, family) -> None:
    """The family's own options (its config section) apply as this run sets them; each one changed since the
    checkpoint is said in one line."""
    if family.options is None:
        return
    ours, defaults = dataclasses.asdict(getattr(cfg, family.name)), dataclasses.asdict(family.options())
    theirs = saved.get(family.name, {})
    for key, value in ours.items():
        before = theirs.get(key, defaults[key])  # an older config without the option: its default
        if value != before:
            log.warning(f"{family.name}.{key}: {before!r} in the checkpoint at {path}, {value!r} from here on")


def _check_resumed_optimizer(cfg, path: str, saved: dict) -> None:
    ours, defaults = dataclasses.asdict(cfg.optimizer), dataclasses.asdict(type(cfg.optimizer)())
    theirs = {key: saved.get(key, defaults[key]) for key in ("name", *OPTIMIZER_STATE)}  # older configs: defaults
    changed = [key for key in OPTIMIZER_STATE if ours[key] != theirs[key]]
    if _STATE_KIND.get(ours["name"], ours["name"]) != _STATE_KIND.get(theirs["name"], theirs["name"]):
        changed.insert(0, "name")  # Adam <-> AdamW keep their moments; Muon's momentum or SGD's nothing do not fit
    for key in changed[:1]:
        raise ConfigError(f"optimizer.{key}: {ours[key]!r}, but the optimizer state of the checkpoint at {path} is "
                          f"{theirs['name']}'s with {key} = {theirs[key]!r}; set it back to resume, or add optimizer "
                          f"and lr_scheduler to checkpoint.exclude_from_loading to start the optimizer afresh")
    clip = saved.get("qk_clip_threshold", defaults["qk_clip_threshold"])
    if ours["qk_clip_threshold"] != clip:
        log.warning(f"optimizer.qk_clip_threshold: {clip} in the checkpoint at {path}, {ours['qk_clip_threshold']} "
                    f"from here on")


# What a checkpoint's data position (a count of global samples) is a position in: other values of these settings
# deal other documents, or the same ones in another order or other windows. (Prepared data also records its content,
# checked as it loads; streamed data read from another path may be the same documents moved, and is only named.)
DATA_ORDER = {"dataset": "samples of the dataset {}", "seed": "samples in the order of seed {}",
              "seq_len": "windows of seq_len {}", "dataset_text_field": "documents of the text field {}",
              "dataset_format": "examples of {} data",
              "data_streams": "documents dealt to {} streams"}


# Settings a dataset kind does not read: prepared data is not dealt to streams, the built-in corpus has no fields.
_UNREAD = {"tokenized": ("data_streams", "dataset_text_field"), "stdlib": ("dataset_text_field",)}


def data_differences(ours: dict, theirs: dict) -> list[tuple[str, object, object]]:
    """(key, ours, theirs) for each setting of DATA_ORDER that two runs' [training] tables set differently: their
    sample i is not the same sample. Settings one of them lacks (an older config) are skipped, and so are those
    its dataset does not read ('files' on a prepared folder reads it as 'tokenized')."""
    from tessera.data import tokens

    def kind(table: dict) -> str | None:
        prepared = table.get("dataset") == "files" and tokens.is_prepared(table.get("dataset_path", ""))
        return "tokenized" if prepared else table.get("dataset")

    kinds = {kind(ours), kind(theirs)}
    if kinds == {"tokenized"}:  # the same prepared data, whichever way it is named: its fingerprint decides
        ours, theirs = {**ours, "dataset": "tokenized"}, {**theirs, "dataset": "tokenized"}
    unread = {key for k in kinds for key in _UNREAD.get(k, ())}
    return [(key, ours[key], theirs[key]) for key in DATA_ORDER
            if key in ours and key in theirs and ours[key] != theirs[key] and key not in unread]


def check_resumed_data(cfg, path: str, saved: dict) -> None:
    """The data position the run would restore counts samples of the data asked for."""
    from tessera.data import tokens

    ours = dataclasses.asdict(cfg.training)
    for key, new, old in data_differences(ours, saved):
        raise ConfigError(f"training.{key}: {new!r}, but the checkpoint at {path} counted its data position in "
                          f"{DATA_ORDER[key].format(repr(old))}; set --training.{key} {old} to resume it, add "
                          f"dataloader to checkpoint.exclude_from_loading to start this data at its first sample, or "
                          f"pick another job.dump_folder")
    if not tokens.wanted(cfg.training) and saved.get("dataset_path", ours["dataset_path"]) != ours["dataset_path"]:
        log.warning(f"training.dataset_path: {ours['dataset_path']!r}, but the checkpoint at {path} read "
                    f"{saved['dataset_path']!r}; its data position is resumed as a position in the same documents "
                    f"(add dataloader to checkpoint.exclude_from_loading to start this data at its first sample)")
