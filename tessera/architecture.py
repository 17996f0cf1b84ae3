"""Which architecture a run trains, torch-free: the flavor asked for, the Hugging Face `config.json` imported,
or the one its resumed checkpoint holds. A mismatch between what is asked and what is loaded is refused,
naming the fields, so no run ever loads weights into a model that computes something else.

The config is read once, into a `Request` (`request(family, cfg)`, the family resolved by `check_model`); the
functions below take that, not the config."""

import dataclasses
import os

from tessera import models
from tessera.checkpoint.folder import read_model_record, read_saved_config
from tessera.config.manager import ConfigError
from tessera.config.sections import JobConfig
from tessera.models.contract import Family

DEFAULT_FLAVOR = "debugmodel"


@dataclasses.dataclass(frozen=True)
class Request:
    """What a config asks of the architecture."""
    family: Family
    flavor: str  # model.flavor; empty: config.json's or the resumed checkpoint's architecture
    seq_len: int  # training.seq_len: every architecture built is for it
    hf_folder: str | None  # checkpoint.initial_load_path when it is loaded as a Hugging Face folder
    trains_absent_parts: bool  # Family.trains_absent_parts of the config


def check_model(cfg: JobConfig) -> Family:
    """The family model.name names, model.flavor (when given) one of its flavors."""
    m = cfg.model
    if m.name not in models.FAMILIES:
        raise ConfigError(f"model.name: unknown family '{m.name}'; choose one of {', '.join(models.FAMILIES)}")
    fam = models.family(m.name)
    if m.flavor and m.flavor not in fam.flavors:
        raise ConfigError(f"model.flavor: '{m.flavor}' is not a {m.name} flavor; choose one of "
                          f"{', '.join(fam.flavors)}")
    return fam


def request(fam: Family, cfg: JobConfig) -> Request:
    c = cfg.checkpoint
    return Request(family=fam, flavor=cfg.model.flavor, seq_len=cfg.training.seq_len,
                   hf_folder=c.initial_load_path if c.initial_load_in_hf and c.initial_load_path else None,
                   trains_absent_parts=fam.trains_absent_parts is not None and fam.trains_absent_parts(cfg))


def asked_args(req: Request, vocab_size: int | None):
    """The args of the flavor asked for (None when it is left empty), with the run's sequence length and, for
    the flavors that take it, the tokenizer's vocabulary (kept as the table's when not known yet)."""
    if not req.flavor:
        return None
    args = dataclasses.replace(req.family.flavors[req.flavor], max_seq_len=req.seq_len)
    if vocab_size is not None and req.flavor in req.family.takes_tokenizer_vocab:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def hf_args(req: Request):
    """The architecture `<hf_folder>/config.json` describes (parts the folder lacks kept, freshly initialized, when
    the run trains them: Family.trains_absent_parts)."""
    try:
        return models.hf_args(req.family.name, req.hf_folder, train=req.trains_absent_parts)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def saved_args(req: Request, path: str):
    """The architecture the checkpoint at `path` holds (None when it predates model.json records)."""
    try:
        record = read_model_record(path)
        if record is None:
            return None
        family, args = models.args_from_json(record)
    except (ValueError, KeyError, TypeError, ModuleNotFoundError) as e:
        raise ConfigError(f"job.dump_folder: {os.path.join(path, 'model.json')} is not a model record Tessera "
                          f"reads ({type(e).__name__}: {e}); pick another job.dump_folder") from None
    if family != req.family.name:
        raise ConfigError(f"job.dump_folder: the checkpoint at {path} holds a {family} model, not "
                          f"{req.family.name}; set model.name = '{family}' or pick another job.dump_folder")
    return args


def _refuse(where: str, diffs: list[str], fix: str) -> ConfigError:
    return ConfigError(f"{where} differs in {len(diffs)} field(s): {'; '.join(diffs)}; {fix}")


def _vocab_of(req: Request, asked, vocab_size: int | None, loaded):
    """`asked`, with `loaded`'s vocabulary while the tokenizer's is unknown for a flavor that takes it (the
    comparison is made again once the tokenizer is loaded)."""
    if vocab_size is None and req.flavor in req.family.takes_tokenizer_vocab:
        return dataclasses.replace(asked, vocab_size=loaded.vocab_size)
    return asked


def resolve(req: Request, vocab_size: int | None, resume_path: str | None):
    """The args to build. `vocab_size`: the tokenizer's, or None before it is loaded (the pre-check);
    `resume_path`: the checkpoint the run resumes from, if any (it wins over an initial load)."""
    asked = asked_args(req, vocab_size)
    if resume_path is not None:
        return _resumed(req, asked, vocab_size, resume_path)
    if req.hf_folder:
        hf = dataclasses.replace(hf_args(req), max_seq_len=req.seq_len)
        diffs = models.arch_differences(hf, _vocab_of(req, asked, vocab_size, hf), ("config.json", "flavor")) \
            if asked is not None else []
        if diffs:
            raise _refuse(f"model.flavor: '{req.flavor}' and the Hugging Face config.json in {req.hf_folder}",
                          diffs, "leave model.flavor empty to build config.json's architecture")
        return hf
    return asked if asked is not None else asked_args(dataclasses.replace(req, flavor=DEFAULT_FLAVOR), vocab_size)


def _resumed(req: Request, asked, vocab_size: int | None, path: str):
    saved = saved_args(req, path)
    if saved is None:  # an older checkpoint: its config names the flavor; the load still checks every shape
        flavor = read_saved_config(path).get("model", {}).get("flavor") or DEFAULT_FLAVOR
        if asked is None:
            return asked_args(dataclasses.replace(req, flavor=flavor), vocab_size)
        if flavor != req.flavor:
            raise ConfigError(f"job.dump_folder: the checkpoint at {path} was written by flavor '{flavor}', not "
                              f"'{req.flavor}'; set model.flavor = '{flavor}' or pick another job.dump_folder")
        return asked
    if asked is not None:
        diffs = models.arch_differences(saved, _vocab_of(req, asked, vocab_size, saved))
        if diffs:
            raise _refuse(f"job.dump_folder: the checkpoint at {path} holds a model that", diffs,
                          "resume it with the same model.flavor (or leave model.flavor empty), or pick another "
                          "job.dump_folder for the new model")
    return dataclasses.replace(saved, max_seq_len=req.seq_len)
