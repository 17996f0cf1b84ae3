"""Which architecture a run trains, torch-free: the flavor asked for, the Hugging Face `config.json` imported,
or the one its resumed checkpoint holds. A mismatch between what is asked and what is loaded is refused,
naming the fields, so no run ever loads weights into a model that computes something else."""

import dataclasses
import os

from tessera import models
from tessera.checkpoint.folder import read_model_record, read_saved_config
from tessera.config.manager import ConfigError
from tessera.config.sections import JobConfig

DEFAULT_FLAVOR = "debugmodel"


def check_model(cfg: JobConfig) -> None:
    """model.name is a family and model.flavor (when given) one of its flavors."""
    m = cfg.model
    if m.name not in models.FAMILIES:
        raise ConfigError(f"model.name: unknown family '{m.name}'; choose one of {', '.join(models.FAMILIES)}")
    if m.flavor and m.flavor not in models.family(m.name).flavors:
        raise ConfigError(f"model.flavor: '{m.flavor}' is not a {m.name} flavor; choose one of "
                          f"{', '.join(models.family(m.name).flavors)}")


def asked_args(cfg: JobConfig, vocab_size: int | None):
    """The args of `model.flavor` (None when the flavor is left empty), with the run's sequence length and,
    for the flavors that take it, the tokenizer's vocabulary (kept as the table's when not known yet)."""
    if not cfg.model.flavor:
        return None
    fam = models.family(cfg.model.name)
    args = dataclasses.replace(fam.flavors[cfg.model.flavor], max_seq_len=cfg.training.seq_len)
    if vocab_size is not None and cfg.model.flavor in fam.takes_tokenizer_vocab:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def hf_args(cfg: JobConfig):
    """The architecture `<checkpoint.initial_load_path>/config.json` describes (parts the folder lacks kept,
    freshly initialized, when the run trains them: Family.trains_absent_parts)."""
    trains = models.family(cfg.model.name).trains_absent_parts
    try:
        return models.hf_args(cfg.model.name, cfg.checkpoint.initial_load_path,
                              train=trains is not None and trains(cfg))
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def saved_args(cfg: JobConfig, path: str):
    """The architecture the checkpoint at `path` holds (None when it predates model.json records)."""
    try:
        record = read_model_record(path)
        if record is None:
            return None
        family, args = models.args_from_json(record)
    except (ValueError, KeyError, TypeError, ModuleNotFoundError) as e:
        raise ConfigError(f"job.dump_folder: {os.path.join(path, 'model.json')} is not a model record Tessera "
                          f"reads ({type(e).__name__}: {e}); pick another job.dump_folder") from None
    if family != cfg.model.name:
        raise ConfigError(f"job.dump_folder: the checkpoint at {path} holds a {family} model, not "
                          f"{cfg.model.name}; set model.name = '{family}' or pick another job.dump_folder")
    return args


def _refuse(where: str, diffs: list[str], fix: str) -> ConfigError:
    return ConfigError(f"{where} differs in {len(diffs)} field(s): {'; '.join(diffs)}; {fix}")


def _vocab_of(cfg: JobConfig, asked, vocab_size: int | None, loaded):
    """`asked`, with `loaded`'s vocabulary while the tokenizer's is unknown for a flavor that takes it (the
    comparison is made again once the tokenizer is loaded)."""
    if vocab_size is None and cfg.model.flavor in models.family(cfg.model.name).takes_tokenizer_vocab:
        return dataclasses.replace(asked, vocab_size=loaded.vocab_size)
    return asked


def _with_flavor(cfg: JobConfig, flavor: str) -> JobConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, flavor=flavor))


def resolve(cfg: JobConfig, vocab_size: int | None, resume_path: str | None):
    """The args to build. `vocab_size`: the tokenizer's, or None before it is loaded (the pre-check);
    `resume_path`: the checkpoint the run resumes from, if any (it wins over an initial load)."""
    asked = asked_args(cfg, vocab_size)
    if resume_path is not None:
        return _resumed(cfg, asked, vocab_size, resume_path)
    if cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path:
        hf = dataclasses.replace(hf_args(cfg), max_seq_len=cfg.training.seq_len)
        diffs = models.arch_differences(hf, _vocab_of(cfg, asked, vocab_size, hf), ("config.json", "flavor")) \
            if asked is not None else []
        if diffs:
            raise _refuse(f"model.flavor: '{cfg.model.flavor}' and the Hugging Face config.json in "
                          f"{cfg.checkpoint.initial_load_path}", diffs,
                          "leave model.flavor empty to build config.json's architecture")
        return hf
    return asked if asked is not None else asked_args(_with_flavor(cfg, DEFAULT_FLAVOR), vocab_size)


def _resumed(cfg: JobConfig, asked, vocab_size: int | None, path: str):
    saved = saved_args(cfg, path)
    if saved is None:  # an older checkpoint: its config names the flavor; the load still checks every shape
        flavor = read_saved_config(path).get("model", {}).get("flavor") or DEFAULT_FLAVOR
        if asked is None:
            return asked_args(_with_flavor(cfg, flavor), vocab_size)
        if flavor != cfg.model.flavor:
            raise ConfigError(f"job.dump_folder: the checkpoint at {path} was written by flavor '{flavor}', not "
                              f"'{cfg.model.flavor}'; set model.flavor = '{flavor}' or pick another job.dump_folder")
        return asked
    if asked is not None:
        diffs = models.arch_differences(saved, _vocab_of(cfg, asked, vocab_size, saved))
        if diffs:
            raise _refuse(f"job.dump_folder: the checkpoint at {path} holds a model that", diffs,
                          "resume it with the same model.flavor (or leave model.flavor empty), or pick another "
                          "job.dump_folder for the new model")
    return dataclasses.replace(saved, max_seq_len=cfg.training.seq_len)
