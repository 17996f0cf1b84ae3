"""Cross-field checks, run before any process group or file exists. Each failure is one ConfigError line."""

import glob
import os

from tessera.config.manager import ConfigError
from tessera.config.sections import LOADABLE_PARTS, JobConfig
from tessera.models import FAMILIES, flavors, takes_tokenizer_vocab
from tessera.parallel.dims import ParallelDims

# Accepted by the config so shipped configs can name them, refused until implemented.
_NOT_YET = {
    "parallelism.pipeline_parallel_degree": lambda c: c.parallelism.pipeline_parallel_degree > 1,
    "parallelism.context_parallel_degree": lambda c: c.parallelism.context_parallel_degree > 1,
    "parallelism.expert_parallel_degree": lambda c: c.parallelism.expert_parallel_degree > 1,
    "model.converters": lambda c: bool(c.model.converters),
    "training.enable_cpu_offload": lambda c: c.training.enable_cpu_offload,
}


def validate(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Check everything that can be checked without torch; returns the resolved parallel degrees."""
    for key, enabled in _NOT_YET.items():
        if enabled(cfg):
            raise ConfigError(f"{key}: not supported yet in this version of Tessera; remove it or use the default")
    m, t = cfg.model, cfg.training
    if m.name not in FAMILIES:
        raise ConfigError(f"model.name: unknown family '{m.name}'; choose one of {', '.join(FAMILIES)}")
    if m.flavor not in flavors(m.name):
        raise ConfigError(f"model.flavor: '{m.flavor}' is not a {m.name} flavor; choose one of "
                          f"{', '.join(flavors(m.name))}")
    if m.hf_assets_path and not os.path.isfile(os.path.join(m.hf_assets_path, "tokenizer.json")):
        raise ConfigError(f"model.hf_assets_path: no tokenizer.json in '{m.hf_assets_path}'; download it with "
                          f"scripts/download_hf_assets.py or leave the path empty for the byte tokenizer")
    if t.dataset == "files" and not t.dataset_path:
        raise ConfigError("training.dataset_path: empty, but training.dataset = 'files' needs a file, folder or glob")
    if t.dataset_path and not (os.path.exists(t.dataset_path) or glob.glob(t.dataset_path)):
        raise ConfigError(f"training.dataset_path: nothing matches '{t.dataset_path}'")
    try:
        dims = ParallelDims.from_config(cfg.parallelism, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per_step = t.local_batch_size * dims.dp
    if t.global_batch_size != -1 and (t.global_batch_size < per_step or t.global_batch_size % per_step):
        raise ConfigError(f"training.global_batch_size: {t.global_batch_size} is not a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {dims.dp} = {per_step}")
    if dims.tp > 1:
        _check_tp(cfg, dims.tp)
    _check_checkpoint(cfg, world_size)
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op" and not ac.selective_ac_option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option: '{ac.selective_ac_option}' is neither 'op' "
                          f"nor a positive integer")
    if cfg.compile.enable and set(cfg.compile.components) - {"model", "loss"}:
        raise ConfigError(f"compile.components: {cfg.compile.components} may only hold 'model' and 'loss'")
    return dims


def _check_tp(cfg: JobConfig, tp: int) -> None:
    args, p = flavors(cfg.model.name)[cfg.model.flavor], cfg.parallelism
    for what, size in (("attention heads", args.n_heads), ("KV heads", args.n_kv_heads),
                       ("FFN hidden size", args.ffn_hidden), ("vocab size", args.vocab_size)):
        if what == "vocab size" and cfg.model.flavor in takes_tokenizer_vocab(cfg.model.name):
            continue  # known once the tokenizer is loaded; checked then (check_vocab)
        if size % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {what} ({size}) of "
                              f"{cfg.model.name} {cfg.model.flavor}; pick a divisor")
    if args.tie_embeddings:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {cfg.model.flavor} ties its embeddings, which tensor "
                          f"parallelism does not support yet; use FSDP (data_parallel_shard_degree) instead")
    if p.enable_async_tensor_parallel and not (_has_cuda() and cfg.compile.enable):
        raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA and compile.enable = true "
                          "(it is an inductor pass over NCCL symmetric memory); turn it off here")


def check_vocab(cfg: JobConfig, vocab_size: int, tp: int) -> None:
    if tp > 1 and vocab_size % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the tokenizer's vocab size "
                          f"({vocab_size}) for {cfg.model.flavor}; pick a divisor")


def _has_cuda() -> bool:
    import shutil
    return shutil.which("nvidia-smi") is not None


def _check_checkpoint(cfg: JobConfig, world_size: int) -> None:
    c = cfg.checkpoint
    if c.create_seed_checkpoint and (world_size != 1 or not c.enable):
        raise ConfigError("checkpoint.create_seed_checkpoint: run it on one process (NGPU=1) with "
                          "checkpoint.enable = true; every layout can then load its step 0")
    if c.async_mode == "async_with_pinned_mem" and not _has_cuda():
        raise ConfigError("checkpoint.async_mode: async_with_pinned_mem needs a CUDA device to pin memory for; "
                          "use 'async' here")
    if c.initial_load_path and not os.path.exists(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: no such folder '{c.initial_load_path}'")
    bad = set(c.exclude_from_loading) - set(LOADABLE_PARTS)
    if bad:
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown part(s) {sorted(bad)}; choose from "
                          f"{', '.join(LOADABLE_PARTS)}")
