"""How a run is laid out: the parallel degrees, the batch arithmetic, and what the family accepts of EP, TP, CP and
PP."""

from __future__ import annotations

import dataclasses
import os

from tessera.config import ConfigError
from tessera.ft import check as ft_check
from tessera.parallel import pp_layout
from tessera.parallel.dims import ParallelDims
from tessera.preflight.draft import Draft


def experts(d: Draft) -> None:
    cfg = d.cfg
    moe, ep = getattr(d.args, "moe", None), cfg.parallelism.expert_parallel_degree
    if ep > 1 and (moe is None or moe.n_experts % ep):
        why = "has no experts" if moe is None else f"has {moe.n_experts} experts per layer, which EP must divide"
        raise ConfigError(f"parallelism.expert_parallel_degree: {cfg.model.name} {cfg.model.flavor or 'model'} "
                          f"{why}; set it to 1{'' if moe is None else ' or a divisor'}")


def dims(d: Draft) -> None:
    """Resolves the parallel degrees of the world size."""
    try:
        d.dims = ParallelDims.from_config(d.cfg.parallelism, d.world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def global_batch(d: Draft) -> None:
    t, groups = d.cfg.training, ft_check.groups(d.cfg)
    per_step = t.local_batch_size * d.dims.dp * groups
    if t.global_batch_size != -1 and (t.global_batch_size < per_step or t.global_batch_size % per_step):
        raise ConfigError(f"training.global_batch_size: {t.global_batch_size} is not a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {d.dims.dp}"
                          f"{f' x replica groups {groups}' if groups > 1 else ''} = {per_step}")


def family_check(d: Draft) -> None:
    """The family's own check of its section and of what it needs of the rest (`Family.check`)."""
    try:
        if d.family.check is not None:
            d.family.check(d.cfg, d.args, d.dims)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def family_layout(d: Draft) -> None:
    """What the family accepts of TP, CP and PP (its vocabulary, when the tokenizer's, is checked once known)."""
    cfg, fam, args, dims_ = d.cfg, d.family, d.args, d.dims
    if cfg.model.flavor in fam.takes_tokenizer_vocab:
        args = dataclasses.replace(args, vocab_size=0)
    try:
        fam.check_layout(args, dims_.tp, dims_.cp, dims_.pp, f"{cfg.model.name} {cfg.model.flavor or 'model'}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if getattr(args, "moe", None) is not None and cfg.moe.aux_loss_coef and (dims_.tp > 1 or dims_.cp > 1):
        raise ConfigError("moe.aux_loss_coef: the sequence-wise balancing loss needs each rank to hold whole "
                          "sequences, which TP and CP ranks do not; use moe.load_balance_rate (aux-loss-free) there")
    if dims_.tp > 1 and cfg.parallelism.enable_async_tensor_parallel:
        from tessera.preflight.options import has_cuda

        if not (has_cuda() and cfg.compile.enable):
            raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA and compile.enable = true "
                              "(it is an inductor pass over NCCL symmetric memory); turn it off here")


def pipeline(d: Draft) -> None:
    p, pp = d.cfg.parallelism, d.dims.pp
    if pp == 1:
        return
    if p.pipeline_parallel_schedule_csv and not os.path.isfile(p.pipeline_parallel_schedule_csv):
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv: no such file "
                          f"'{p.pipeline_parallel_schedule_csv}'")
    problem = pp_layout.check(d.args.n_layers, pp, p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv,
                              d.cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size,
                              p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_split_points,
                              p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers)
    if problem:
        raise ConfigError(f"parallelism.pipeline_parallel_degree {pp}: {problem}")


def context_parallel(d: Draft) -> None:
    """Each CP rank holds two equal chunks of a sequence; Ulysses CP hands each CP rank whole sequences of heads /
    (TP x CP) query heads (key/value heads that do not divide are repeated, see tessera.parallel.ulysses)."""
    cfg, dims_ = d.cfg, d.dims
    if dims_.cp == 1:
        return
    if cfg.training.seq_len % (2 * dims_.cp):
        raise ConfigError(f"parallelism.context_parallel_degree: training.seq_len {cfg.training.seq_len} must be "
                          f"divisible by 2 x context_parallel_degree = {2 * dims_.cp} (each rank holds two equal "
                          f"chunks)")
    heads = getattr(d.args, "n_heads", 0)
    if cfg.parallelism.context_parallel_method == "ulysses" and heads % (dims_.tp * dims_.cp):
        raise ConfigError(f"parallelism.context_parallel_method: ulysses splits {cfg.model.name}'s {heads} attention "
                          f"heads over TP {dims_.tp} x CP {dims_.cp} = {dims_.tp * dims_.cp} ranks, which do not "
                          f"divide them; use a CP degree dividing the {heads // dims_.tp} heads per TP rank, or "
                          f"context_parallel_method = allgather")


def vocabulary(d: Draft) -> None:
    """The model's vocabulary holds every id of the tokenizer, and TP divides it (a family with its own data has
    no token ids)."""
    if not d.family.own_data:
        check_vocab(d.cfg, d.args.vocab_size, d.tokenizer_vocab, d.dims.tp)


def check_vocab(cfg, vocab_size: int, tokenizer_vocab: int, tp: int) -> None:
    if tokenizer_vocab > vocab_size:
        raise ConfigError(f"model.hf_assets_path: the tokenizer has {tokenizer_vocab} tokens, more than the model's "
                          f"vocabulary ({vocab_size}); use the model's own tokenizer")
    if tp > 1 and vocab_size % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the vocab size "
                          f"({vocab_size}) of {cfg.model.flavor or 'the model'}; pick a divisor")
