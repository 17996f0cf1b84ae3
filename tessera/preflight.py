"""The whole config: tessera.config's schema with each family's options mounted as its own section (`[flux]`,
`[deepseek_v3]`), and the cross-field checks that need the rest of Tessera, run before any process group or file
exists (each failure is one ConfigError line). The launcher (`python -m tessera.config`, which run_train.sh runs
before starting ranks), tessera.train, estimate, plan and generate parse and check configs here."""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import math
import os
import tempfile
from typing import TYPE_CHECKING

from tessera import architecture, config, models
from tessera.checkpoint.folder import read_saved_config
from tessera.checkpoint.launch_check import check_initial_load, launch_resume_point
from tessera.checkpoint.space import checkpoint_bytes, room_problem
from tessera.config import ConfigError
from tessera.config.sections import (
    FLOAT8_CONVERTER as FLOAT8,
    LOADABLE_PARTS,
    MX_CONVERTER as MX,
    MX_RECIPES,
    STOP_SIGNALS,
    mount,
)
from tessera.data.tokenizer import ByteTokenizer
from tessera.ft import check as ft_check
from tessera.models import family
from tessera.parallel import pp_layout
from tessera.parallel.dims import ParallelDims
from tessera.run_plan import DataPlan, ResolvedRun, ResumePoint, batch_of

if TYPE_CHECKING:  # the base class; the whole schema, families' sections included, is schema()
    from tessera.config import JobConfig

log = logging.getLogger("tessera")


def schema() -> type:
    """The whole config class: JobConfig with the registered families' sections, built on first use (for the
    registry as it is then: a test that registers a family gets a schema with it)."""
    return _schema(models.FAMILIES)


# One class per set of families (pickle finds it by name). Memoized safely: a pure function of the family names.
@functools.cache
def _schema(names: tuple[str, ...]) -> type:
    return mount({name: family(name).options for name in names if family(name).options is not None}, names,
                 __name__)


def __getattr__(name: str) -> type:
    """`JobConfig` (the whole schema) and `Model` (its section in which model.name chooses among the families):
    pickle finds the classes the schema made by these names."""
    if name == "JobConfig":
        return schema()
    if name == "Model":
        return schema().__dataclass_fields__["model"].type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moved() -> dict[str, str]:
    """Options a family took over from the shared sections: {old key: new key}, read where they are now, with a
    warning."""
    return {old: f"{name}.{new}" for name in models.FAMILIES for old, new in family(name).moved_options.items()}


def parse_args(argv: list[str]) -> JobConfig:
    """defaults < --job.config_file TOML < CLI flags, the families' sections included."""
    return config.parse_args(argv, schema(), moved())


def help_text() -> str:
    return config.help_text(schema())


def markdown_reference() -> str:
    """docs/config-reference.md: every section, the families' included."""
    return config.markdown_reference(schema())


def validate(cfg: JobConfig, world_size: int, launch: bool = False, training: bool = False) -> ResolvedRun:
    """Check everything that can be checked without torch; returns what it resolved (`cfg` is left as given: the
    record's config is the one the run runs). `launch`: the check before ranks start, which also reads the
    checkpoint a run starts from against its checksums. `training`: for a run that will save (its launch check and
    its ranks), not a plan or an estimate of it."""
    cfg = ft_check.place_group(cfg)  # fault tolerance: this replica group's own folder, the checkpoints shared
    m, t = cfg.model, cfg.training
    architecture.check_model(cfg)
    fam = family(m.name)
    _check_folders(cfg)
    if cfg.checkpoint.initial_load_path and not os.path.exists(cfg.checkpoint.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: no such folder '{cfg.checkpoint.initial_load_path}'")
    args, resume = _check_resume(cfg, launch)
    if training:
        _check_room(cfg, fam, args)
    if m.hf_assets_path and not os.path.isfile(os.path.join(m.hf_assets_path, "tokenizer.json")):
        raise ConfigError(f"model.hf_assets_path: no tokenizer.json in '{m.hf_assets_path}'; download it with "
                          f"scripts/download_hf_assets.py or leave the path empty for the byte tokenizer")
    data = _data_plan(cfg, fam, resume)
    if not data.own:  # a family with its own data checks it in its check
        _check_data(cfg)
        _check_tokenizer_vocab(cfg, fam, args, resume)
        if resume:  # the tokenizer is the one the model learned; the files its data position counts in, the same
            from tessera.data import fingerprint
            fingerprint.check_resume(cfg, resume.path, data="dataloader" not in cfg.checkpoint.exclude_from_loading)
    _check_experts(cfg, args)
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per_step, groups = t.local_batch_size * dims.dp * ft_check.groups(cfg), ft_check.groups(cfg)
    if t.global_batch_size != -1 and (t.global_batch_size < per_step or t.global_batch_size % per_step):
        raise ConfigError(f"training.global_batch_size: {t.global_batch_size} is not a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {dims.dp}"
                          f"{f' x replica groups {groups}' if groups > 1 else ''} = {per_step}")
    ft_check.check_config(cfg, args, data.own)
    if "LOCAL_RANK" not in os.environ:  # the launcher's pre-check (a running group's rank 0 checks again, holding)
        ft_check.check_live(cfg, world_size)
    _check_family(cfg, fam, args, dims)
    _check_layout(cfg, fam, args, dims)
    _check_data_files(cfg, data, dims)
    if dims.pp > 1:
        _check_pp(cfg, args, dims.pp)
    if dims.cp > 1 and t.seq_len % (2 * dims.cp):
        raise ConfigError(f"parallelism.context_parallel_degree: training.seq_len {t.seq_len} must be divisible by "
                          f"2 x context_parallel_degree = {2 * dims.cp} (each rank holds two equal chunks)")
    if dims.cp > 1 and cfg.parallelism.context_parallel_method == "ulysses":
        _check_ulysses(cfg, args, dims)
    _check_checkpoint(cfg, world_size)
    _check_speed(cfg, dims)
    ac = cfg.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(f"activation_checkpoint.selective_ac_option: '{ac.selective_ac_option}' is neither 'op' "
                          f"nor a positive integer")
    if cfg.compile.enable and not cfg.compile.components:
        raise ConfigError("compile.components: empty while compile.enable = true; name model and/or loss, or turn "
                          "compile off")
    if cfg.compile.enable and set(cfg.compile.components) - {"model", "loss"}:
        raise ConfigError(f"compile.components: {cfg.compile.components} may only hold 'model' and 'loss'")
    _check_muon(cfg)
    if cfg.metrics.live_memory and cfg.compile.enable:
        raise ConfigError("metrics.live_memory: counts every op with a dispatch mode, which torch.compile does not "
                          "trace; measure with compile.enable = false (tessera.estimate traces compiled blocks "
                          "eagerly too)")
    return ResolvedRun(cfg=cfg, family=fam, args=args, dims=dims, batch=batch_of(cfg, dims, groups), resume=resume,
                       data=data)


def _data_plan(cfg: JobConfig, fam, resume: ResumePoint | None) -> DataPlan:
    from tessera.data import tokens

    return DataPlan(own=fam.own_data, prepared=not fam.own_data and tokens.wanted(cfg.training),
                    resumes_position=resume is not None and resume.kind == "full"
                    and "dataloader" not in cfg.checkpoint.exclude_from_loading)


def _check_muon(cfg: JobConfig) -> None:
    coefficients = cfg.optimizer.muon_ns_coefficients.split(",")
    try:
        ok = len(coefficients) == 3 and all(math.isfinite(float(c)) for c in coefficients)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"optimizer.muon_ns_coefficients: '{cfg.optimizer.muon_ns_coefficients}' is not three "
                          f"finite numbers a,b,c; e.g. 3.4445,-4.7750,2.0315")
    if cfg.optimizer.name == "Muon" and cfg.training.enable_cpu_offload:
        raise ConfigError("optimizer.name: Muon sends matrix shards between ranks' devices at each step, and "
                          "training.enable_cpu_offload keeps them in host memory; use AdamW with CPU offload")


def _writable_folder(key: str, path: str) -> None:
    """`path` is a folder this process can write, or can create: refused now, not at the first save."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}: '{probe}' is a file, so the folder '{path}' cannot be made; pick another path")
    try:  # by creating a file: permission bits say yes to root everywhere, /proc and read-only mounts included
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".tessera-write-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: '{probe}' is not writable ({e.strerror or e}), so '{path}' cannot be written; "
                          f"pick a writable path") from None


def _check_folders(cfg: JobConfig) -> None:
    if not cfg.job.dump_folder.strip():
        raise ConfigError("job.dump_folder: empty; name the folder for this run's logs and checkpoints")
    _writable_folder("job.dump_folder", cfg.job.dump_folder)
    if cfg.checkpoint.enable:
        if not cfg.checkpoint.folder.strip():
            raise ConfigError("checkpoint.folder: empty; name a folder inside job.dump_folder, e.g. 'checkpoint'")
        folder = cfg.checkpoint.folder
        if not os.path.isabs(folder) and os.path.normpath(folder).split(os.sep)[0] == os.pardir:
            raise ConfigError(f"checkpoint.folder: '{folder}' leads out of job.dump_folder; name a folder inside it, "
                              f"or an absolute path for checkpoints kept elsewhere")
        _writable_folder("checkpoint.folder", os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))


def _check_resume(cfg: JobConfig, launch: bool):
    """The checkpoint the run would resume from agrees with what is asked (model, data order, steps); returns
    the architecture the run will build (its vocabulary may still follow the tokenizer) and that checkpoint, if
    any."""
    resume = None
    if cfg.checkpoint.enable:
        resume = launch_resume_point(cfg, launch)
    if resume is not None and resume[2].get("kind") == "full":
        step, path, _ = resume
        if "dataloader" not in cfg.checkpoint.exclude_from_loading:
            _check_resumed_data(cfg, path, read_saved_config(path).get("training", {}))
        if "optimizer" not in cfg.checkpoint.exclude_from_loading:
            _check_resumed_optimizer(cfg, path, read_saved_config(path).get("optimizer", {}))
        if cfg.training.steps < step:
            raise ConfigError(f"training.steps: {cfg.training.steps} is below step {step}, which the checkpoint at "
                              f"{path} reached; raise training.steps to extend the run, or pick another "
                              f"job.dump_folder")
    if resume is None:  # then the run starts from initial_load_path, if given
        check_initial_load(cfg, launch)
    point = ResumePoint(step=resume[0], path=resume[1], kind=resume[2].get("kind")) if resume else None
    return architecture.resolve(cfg, None, point.path if point else None), point


def _check_tokenizer_vocab(cfg: JobConfig, fam, args, resume: ResumePoint | None) -> None:
    """Resuming: the tokenizer's vocabulary fits the checkpoint's model, and is the one it was trained with where
    the flavor takes the tokenizer's; refused here rather than by the ranks once they have loaded it."""
    if not cfg.model.hf_assets_path or resume is None:
        return
    from tessera.data.tokenizer import HFTokenizer

    vocab, path = HFTokenizer(cfg.model.hf_assets_path).vocab_size, os.path.join(cfg.model.hf_assets_path,
                                                                                 "tokenizer.json")
    takes = cfg.model.flavor in fam.takes_tokenizer_vocab
    if vocab > args.vocab_size or (takes and vocab != args.vocab_size):
        raise ConfigError(f"model.hf_assets_path: the tokenizer {path} has {vocab} tokens, but the model of the "
                          f"checkpoint at {resume.path} has a vocabulary of {args.vocab_size}: it was trained with "
                          f"another tokenizer; resume with that one, or pick another job.dump_folder")


# [optimizer] settings that decide the optimizer's state (Muon's momentum or Adam's moments per matrix) and its
# parameter groups (their lr and weight decay are saved with them): a checkpoint's state loads only into the same.
OPTIMIZER_STATE = ("weight_decay_exclude", "embedding_lr_multiplier", "output_lr_multiplier")


_STATE_KIND = {"Adam": "moments", "AdamW": "moments"}  # optimizers whose saved state the other can load


def _check_resumed_optimizer(cfg: JobConfig, path: str, saved: dict) -> None:
    ours, defaults = dataclasses.asdict(cfg.optimizer), dataclasses.asdict(type(cfg.optimizer)())
    theirs = {key: saved.get(key, defaults[key]) for key in ("name", *OPTIMIZER_STATE)}  # older configs: defaults
    changed = [key for key in OPTIMIZER_STATE if ours[key] != theirs[key]]
    if _STATE_KIND.get(ours["name"], ours["name"]) != _STATE_KIND.get(theirs["name"], theirs["name"]):
        changed.insert(0, "name")  # Adam <-> AdamW keep their moments; Muon's momentum or SGD's nothing do not fit
    for key in changed[:1]:
        raise ConfigError(f"optimizer.{key}: {ours[key]!r}, but the optimizer state of the checkpoint at {path} is "
                          f"{theirs['name']}'s with {key} = {theirs[key]!r}; set it back to resume, or add optimizer "
                          f"and lr_scheduler to checkpoint.exclude_from_loading to start the optimizer afresh")


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


def _check_resumed_data(cfg: JobConfig, path: str, saved: dict) -> None:
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


def _check_data(cfg: JobConfig) -> None:
    """The dataset, its first documents, and that tokenizer.json is whole: what would otherwise fail once ranks
    run. (Whether the Hub answers is asked by each rank, when it opens the stream: a config can be checked offline.)"""
    from tessera.data import sources, tokens

    t = cfg.training
    sources.check_dataset(t.dataset, t.dataset_path)
    if t.dataset_mix or t.dataset == "tokenized":
        tokens.check(cfg)  # each prepared folder whole, made by this run's tokenizer, big enough
    elif t.dataset_path and not (os.path.exists(t.dataset_path) or glob.glob(t.dataset_path)):
        raise ConfigError(f"training.dataset_path: nothing matches '{t.dataset_path}'")
    elif tokens.wanted(t):
        tokens.check(cfg)
    sources.check_validation_path(cfg)
    if cfg.model.hf_assets_path:
        path = os.path.join(cfg.model.hf_assets_path, "tokenizer.json")
        try:
            with open(path, encoding="utf-8") as fh:
                json.load(fh)
        except ValueError as e:  # a download cut short, or not JSON at all
            raise ConfigError(f"model.hf_assets_path: {path} is not valid JSON ({e}); download it again") from None


def _check_data_files(cfg: JobConfig, data: DataPlan, dims: ParallelDims) -> None:
    """Raw files (training.dataset = files, not prepared): a document to train on (and one held out, with
    validation), and a sample of their records whose rate of bad ones would not pass training.max_bad_records over
    the records this run reads (tessera/data/sample.py says how that is estimated)."""
    from tessera.data import sources
    from tessera.data.sample import RunReads

    t = cfg.training
    if t.dataset_format != "text" and not data.own:
        from tessera.data.examples import check_examples

        return check_examples(cfg)
    if t.dataset != "files" or data.prepared or data.own:
        return
    per_step = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    held_out = cfg.validation.enable and not cfg.validation.dataset_path  # record 100, 200, ... of the files
    reads = RunReads(train_samples=t.steps * per_step, window=t.seq_len + 1, streams=t.data_streams,
                     validation_samples=cfg.validation.steps * t.local_batch_size * dims.dp if held_out else 0)
    sources.check_files(t.dataset_path, t.dataset_text_field, held_out, t.max_bad_records, reads)


def _check_family(cfg: JobConfig, fam, args, dims: ParallelDims) -> None:
    """The family's own check of its section and of what it needs of the rest (`Family.check`)."""
    check = fam.check
    try:
        if check is not None:
            check(cfg, args, dims)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_ulysses(cfg: JobConfig, args, dims: ParallelDims) -> None:
    """Ulysses CP hands each CP rank whole sequences of heads / (TP x CP) query heads (key/value heads that do
    not divide are repeated, see tessera.parallel.ulysses)."""
    heads = getattr(args, "n_heads", 0)
    if heads % (dims.tp * dims.cp):
        raise ConfigError(f"parallelism.context_parallel_method: ulysses splits {cfg.model.name}'s {heads} attention "
                          f"heads over TP {dims.tp} x CP {dims.cp} = {dims.tp * dims.cp} ranks, which do not divide "
                          f"them; use a CP degree dividing the {heads // dims.tp} heads per TP rank, or "
                          f"context_parallel_method = allgather")


def _check_layout(cfg: JobConfig, fam, args, dims: ParallelDims) -> None:
    """What the family accepts of TP, CP and PP (its vocabulary, when the tokenizer's, is checked once known)."""
    if cfg.model.flavor in fam.takes_tokenizer_vocab:
        args = dataclasses.replace(args, vocab_size=0)
    try:
        fam.check_layout(args, dims.tp, dims.cp, dims.pp, f"{cfg.model.name} {cfg.model.flavor or 'model'}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    moe = getattr(args, "moe", None)
    if moe is not None and cfg.moe.aux_loss_coef and (dims.tp > 1 or dims.cp > 1):
        raise ConfigError("moe.aux_loss_coef: the sequence-wise balancing loss needs each rank to hold whole "
                          "sequences, which TP and CP ranks do not; use moe.load_balance_rate (aux-loss-free) there")
    if dims.tp > 1 and cfg.parallelism.enable_async_tensor_parallel and not (_has_cuda() and cfg.compile.enable):
        raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA and compile.enable = true "
                          "(it is an inductor pass over NCCL symmetric memory); turn it off here")


def _check_experts(cfg: JobConfig, args) -> None:
    moe, ep = getattr(args, "moe", None), cfg.parallelism.expert_parallel_degree
    if ep > 1 and (moe is None or moe.n_experts % ep):
        why = "has no experts" if moe is None else f"has {moe.n_experts} experts per layer, which EP must divide"
        raise ConfigError(f"parallelism.expert_parallel_degree: {cfg.model.name} {cfg.model.flavor or 'model'} "
                          f"{why}; set it to 1{'' if moe is None else ' or a divisor'}")


def check_vocab(cfg: JobConfig, vocab_size: int, tokenizer_vocab: int, tp: int) -> None:
    """Once the tokenizer is loaded: the model's vocabulary holds every token id, and TP divides it."""
    if tokenizer_vocab > vocab_size:
        raise ConfigError(f"model.hf_assets_path: the tokenizer has {tokenizer_vocab} tokens, more than the model's "
                          f"vocabulary ({vocab_size}); use the model's own tokenizer")
    if tp > 1 and vocab_size % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the vocab size "
                          f"({vocab_size}) of {cfg.model.flavor or 'the model'}; pick a divisor")


def _has_cuda() -> bool:
    """Asked of torch (imported only for the options that need a GPU): a driver and a device it can use, not a
    tool on PATH."""
    import torch

    return torch.cuda.is_available()


def _check_checkpoint(cfg: JobConfig, world_size: int) -> None:
    c = cfg.checkpoint
    if c.create_seed_checkpoint and (world_size != 1 or not c.enable):
        raise ConfigError("checkpoint.create_seed_checkpoint: run it on one process (NGPU=1) with "
                          "checkpoint.enable = true; every layout can then load its step 0")
    if c.async_mode == "async_with_pinned_mem" and not _has_cuda():
        raise ConfigError("checkpoint.async_mode: async_with_pinned_mem needs a CUDA device to pin memory for; "
                          "use 'async' here")
    if c.initial_load_path and not c.enable:
        raise ConfigError("checkpoint.initial_load_path: set, but checkpoint.enable = false, so nothing would load "
                          "it; set checkpoint.enable = true")
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf: set without checkpoint.initial_load_path; name the Hugging "
                          "Face folder to start from")
    bad = set(c.exclude_from_loading) - set(LOADABLE_PARTS)
    if bad:
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown part(s) {sorted(bad)}; choose from "
                          f"{', '.join(LOADABLE_PARTS)}")
    if bad := set(c.save_on_signal) - set(STOP_SIGNALS):
        raise ConfigError(f"checkpoint.save_on_signal: unknown signal(s) {sorted(bad)}; choose from "
                          f"{', '.join(STOP_SIGNALS)}, or none")


def _check_room(cfg: JobConfig, fam, args) -> None:
    """The checkpoint folder has room for one more checkpoint (the newest one's size, or weights and two Adam
    moments in fp32): refused before any rank starts, not at the first save."""
    if cfg.checkpoint.enable and not cfg.checkpoint.create_seed_checkpoint:
        root = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        if not cfg.model.hf_assets_path and cfg.model.flavor in fam.takes_tokenizer_vocab:
            args = dataclasses.replace(args, vocab_size=ByteTokenizer.vocab_size)  # the built-in one's, known now
        estimate = fam.counts(args, cfg.training.seq_len).params * 4 * 3
        if problem := room_problem(root, checkpoint_bytes(root, estimate)):
            raise ConfigError(f"checkpoint.folder: {problem}; free some space or pick another job.dump_folder or "
                              f"checkpoint.folder")


def _check_pp(cfg: JobConfig, args, pp: int) -> None:
    p = cfg.parallelism
    if p.pipeline_parallel_schedule_csv and not os.path.isfile(p.pipeline_parallel_schedule_csv):
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv: no such file "
                          f"'{p.pipeline_parallel_schedule_csv}'")
    problem = pp_layout.check(args.n_layers, pp, p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv,
                              cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size,
                              p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_split_points,
                              p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers)
    if problem:
        raise ConfigError(f"parallelism.pipeline_parallel_degree {pp}: {problem}")


def _check_speed(cfg: JobConfig, dims: ParallelDims) -> None:
    """Converters (Float8 / MX) and FSDP CPU offload. The exact GPU capability is checked at model build."""
    conv, f8, mx = cfg.model.converters, cfg.quantize.linear.float8, cfg.quantize.linear.mx
    unknown = [c for c in conv if c not in (FLOAT8, MX)]
    if unknown:
        raise ConfigError(f"model.converters: unknown converter(s) {unknown}; choose from {FLOAT8}, {MX}")
    if FLOAT8 in conv and MX in conv:
        raise ConfigError(f"model.converters: {FLOAT8} and {MX} would convert the same linears; pick one")
    if MX in conv and dims.tp > 1:
        raise ConfigError(f"model.converters: {MX} with tensor parallelism is not supported yet; use FSDP "
                          f"(data_parallel_shard_degree) instead, or {FLOAT8} with recipe_name = 'rowwise'")
    if FLOAT8 in conv and dims.tp > 1 and f8.recipe_name == "tensorwise":
        # Checked on gloo: step-1 gradients of TP 2 with tensorwise float8 differ from the unsharded run by ~8%
        # (rowwise: 1e-7), and torchao's float8 TP styles need float8 collectives, which gloo lacks.
        raise ConfigError(f"{FLOAT8}.recipe_name: 'tensorwise' with tensor parallelism is not supported: its "
                          f"per-tensor scales of sharded activations and gradients do not match the unsharded "
                          f"run; use recipe_name = 'rowwise' (or 'rowwise_with_gw_hp') with TP")
    for name, section in ((FLOAT8, f8), (MX, mx)):
        if name in conv and not section.emulate and not _has_cuda():
            raise ConfigError(f"{name}: needs a CUDA GPU (compute capability >= {'8.9' if name == FLOAT8 else '10.0'})"
                              f" and none was found; set {name}.emulate = true to emulate it (slow; for tests) or "
                              f"remove it from model.converters")
    if FLOAT8 in conv:
        if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
            raise ConfigError(f"{FLOAT8}.enable_fsdp_float8_all_gather: needs recipe_name = 'tensorwise' (one "
                              f"scale per weight), not '{f8.recipe_name}'")
        if f8.precompute_float8_dynamic_scale_for_fsdp and not (f8.enable_fsdp_float8_all_gather
                                                                and f8.recipe_name == "tensorwise"):
            raise ConfigError(f"{FLOAT8}.precompute_float8_dynamic_scale_for_fsdp: only works with recipe_name = "
                              f"'tensorwise' and enable_fsdp_float8_all_gather = true")
        if "auto_filter_small_kn" in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
            raise ConfigError(f"{FLOAT8}.filter_fqns: auto_filter_small_kn has no size thresholds for "
                              f"rowwise_with_gw_hp; name the layers to skip instead")
    if MX in conv and mx.recipe_name not in MX_RECIPES:
        raise ConfigError(f"{MX}.recipe_name: '{mx.recipe_name}' is not one of {', '.join(MX_RECIPES)}")
    if cfg.training.enable_cpu_offload and dims.dp == 1:
        raise ConfigError("training.enable_cpu_offload: offloads FSDP's shards, so it needs a data-parallel degree "
                          "> 1 (data_parallel_shard_degree or replicate)")
