"""The Trainer's parts and the named builders that make them, in order."""

import contextlib
import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tessera import experts, lora
from tessera.checkpoint.manager import Checkpointer, probe_writable, write_run_record
from tessera.checkpoint.peft import check_exportable
from tessera.checkpoint.resume import confirm_resume
from tessera.checkpoint.run_state import Progress, Saved
from tessera.config import JobConfig
from tessera.data import build_dataloader, build_tokenizer
from tessera.data.masks import IGNORE
from tessera.data.records import BadRecords
from tessera.distributed import World, on_rank0
from tessera.eval.loop import evaluator
from tessera.ft import check as ft_check
from tessera.ft.semisync import build_outer_state
from tessera.memory import LiveBytes
from tessera.metrics import MetricsLogger, Peak, peak_flops
from tessera.models.common.chunked_loss import summed_cross_entropy
from tessera.models.common.decoder import Decoder
from tessera.models.common.rope import document_positions
from tessera.models.common.side_loss import SideLoss
from tessera.models.contract import BatchView, RunView
from tessera.optim import build_lr_scheduler, build_optimizer, schedule_note
from tessera.parallel import cp, pp
from tessera.parallel.compile import compile_loss
from tessera.parallel.fsdp import mixed_precision
from tessera.parallel.init import materialize
from tessera.parallel.quantize import post_optimizer_hook
from tessera.param_groups import StepTrainable, param_role
from tessera.qk_clip import QKClip
from tessera.run_plan import Batch, ResolvedRun
from tessera.step import LossScale, Pipeline, StepParts

log = logging.getLogger("tessera")


@dataclass
class Trainer:
    cfg: JobConfig
    world: World
    step_parts: StepParts  # what a step runs: model (parts), loss, autocast, accumulation
    model_args: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: object
    val_loader: object | None
    metrics: MetricsLogger
    checkpointer: Checkpointer
    tokenizer: object
    flops_per_token: float
    peak: Peak  # the FLOP/s MFU divides by
    token_loss: bool  # loss_fn sums the token cross-entropy over trained tokens (else: the family's own mean)
    batch_fn: Callable  # (loader) -> this rank's (model inputs by keyword, labels) on its device: the family's
    # hook, or token_batch, given the run's BatchView
    after_optimizer_step: Callable[[], None] | None  # e.g. float8 scale precompute for FSDP
    bad_records: BadRecords  # data records skipped, both splits
    balancer: experts.Balancer | None  # MoE models: the expert-bias update and balance metrics
    progress: Progress  # step, tokens_seen, skipped_steps: what the checkpointer saves and restores of the loop
    evaluate: Callable | None = None  # after each step: the family's own evaluation (OwnTraining.evaluate), or
    # [eval]'s lm-eval tasks (tessera.eval.loop)
    first_nonfinite: torch.Tensor | None = None  # on device: the first step whose loss or grad norm was not finite
    history: list[dict] = field(default_factory=list)
    live_bytes: LiveBytes | None = None  # metrics.live_memory: what counts the live bytes while training
    replicas: object | None = None  # fault_tolerance.enable: this replica group (tessera.ft.replicas.ReplicaGroup)
    qk_clip: QKClip | None = None  # optimizer.qk_clip_threshold: MuonClip's QK-clip after each optimizer step
    trainable: StepTrainable | None = None  # a family that trains only some parameters in some steps (trains_only)
    begin_step: Callable[[int], None] | None = None  # (step from 0): what a step sets on the model before its
    # forwards (ModelSpec.begin_step, on each pipeline part)


def run_view(tr: Trainer) -> RunView:
    """What a family's evaluation gets of the run."""
    return RunView(cfg=tr.cfg, world=tr.world, model=tr.step_parts.model, loader=tr.loader,
                   autocast=tr.step_parts.autocast, step=tr.progress.step, image=tr.metrics.image)


def token_batch(run: BatchView, loader) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's model inputs and labels on its device (see token_inputs)."""
    tokens, labels = loader.next_batch()
    world = run.world
    return token_inputs(tokens, labels, run.document_bos, world.mesh["cp"] if world.dims.cp > 1 else None,
                        world.device, eos=run.document_eos)


def token_inputs(tokens: torch.Tensor, labels: torch.Tensor, bos: int | None, cp_mesh, device: torch.device,
                 eos: int | None = None):
    """Whole windows [batch, seq] -> the model's keyword inputs and the labels, this rank's chunks of each
    sequence under context parallelism: `tokens`; with `bos` (block-causal masking: a document starts at each
    BOS and at the window's start) each token's `documents` number and its place in it (`positions`, from 0 at
    each document's start), and a document's BOS is no label (IGNORE: the last token of one document does not
    predict the first of the next; with `eos`, only a BOS right after an EOS, so that a document's own EOS stays
    trained where the tokenizer's BOS and EOS are one token); under context parallelism the `positions` of its
    tokens in any case."""
    inputs = {"tokens": tokens}
    if bos is not None:  # the target that starts the next document is not predicted from the one before
        labels = labels.masked_fill((labels == bos) & (tokens == eos) if eos is not None else labels == bos, IGNORE)
        inputs["documents"] = (tokens == bos).cumsum(1)
        inputs["positions"] = document_positions(inputs["documents"])
    elif cp_mesh is not None:
        inputs["positions"] = torch.arange(tokens.shape[1]).expand(tokens.shape)
    if cp_mesh is not None:
        rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
        inputs, labels = {k: cp.shard_sequence(v, rank, size) for k, v in inputs.items()}, \
            cp.shard_sequence(labels, rank, size)
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}, labels.to(device, non_blocking=True)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token cross-entropy summed over the trained tokens (labels IGNORE are not); LossScale normalizes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def model_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of a model that computed it itself (given the labels, see labels_in_forward)."""
    return out


def labels_in_forward(cfg: JobConfig, spec) -> bool:
    """Whether the model computes its token loss itself, its head a chunk of tokens at a time (training.loss_chunks
    > 1): the decoder families, whose loss is the token cross-entropy, unless a family's own forward takes no
    labels (a subclass that needs the whole logits, e.g. for a side loss on them); also unchunked where a side
    loss reads the labels' masks (Decoder.side_loss_labels)."""
    takes_labels = "labels" in inspect.signature(spec.model.forward).parameters
    chunked = cfg.training.loss_chunks > 1 or spec.model.side_loss_labels
    return spec.training is None and issubclass(spec.model, Decoder) and takes_labels and chunked


def step_loss(cfg: JobConfig, world: World, spec) -> Callable:
    """(model output, labels) -> the micro-batch's loss: the family's (or the token cross-entropy), or the model's
    own output when it computes its loss itself."""
    own = spec.training.loss if spec.training is not None else loss_fn
    return model_loss if labels_in_forward(cfg, spec) else training_loss(cfg, world, own)


def set_token_loss(cfg: JobConfig, world: World, *parts: nn.Module) -> None:
    """The chunk count and the summed cross-entropy (compiled with the loss) of the decoder(s) in `parts`."""
    chunk_loss = training_loss(cfg, world, summed_cross_entropy)
    for module in (m for part in parts for m in part.modules()):
        if isinstance(module, Decoder):
            module.loss_chunks, module.chunk_loss = cfg.training.loss_chunks, chunk_loss


def build_step(cfg: JobConfig, world: World, spec, model: nn.Module, *, pipeline: Pipeline | None, loss: Callable,
               scale: LossScale, batch: Batch) -> StepParts:
    """What a step runs (the trainer's, and tessera.estimate's trace of it), the built model configured for it:
    its decoders' loss chunks, its MoE layers' settings and loss share, its side losses' weights. `loss` times
    `scale`: what the pipeline schedule's last stage applies too."""
    set_token_loss(cfg, world, *(pipeline.parts if pipeline is not None else [model]))
    experts.configure(experts.moe_layers(model), cfg.moe, batch.micro_batches)
    # Without FSDP (which casts parameters itself) bf16 compute comes from autocast.
    mixed = world.dp_mesh() is None and mixed_precision(cfg.training, world.device)[0] == torch.bfloat16
    return StepParts(model=model, pipeline=pipeline, loss_fn=loss, loss_scale=scale,
                     labels_in_forward=labels_in_forward(cfg, spec), loss_parallel=uses_loss_parallel(cfg, world),
                     side_losses=tuple(build_side_losses(cfg, model, batch.micro_batches, pipeline)),
                     autocast=torch.autocast(world.device.type, dtype=torch.bfloat16) if mixed
                     else contextlib.nullcontext(), grad_accum=batch.accumulation, micro_batches=batch.micro_batches,
                     device=world.device)


def build_model(cfg: JobConfig, world: World, spec, args, loss: Callable,
                scale: LossScale) -> tuple[nn.Module, Pipeline | None]:
    """Meta model -> (pipeline stages) -> the family's parallelism plan -> materialized weights. `loss` times
    `scale` is what the pipeline schedule's last stage applies."""
    with torch.device("meta"):
        model = spec.model(args)
    lora.check_targets(model, cfg.lora)
    check_exportable(model, cfg, cfg.model.name)
    if world.dims.pp == 1:
        model = spec.parallelize(model, world, cfg)
        _materialize(model, world, cfg)
        return model.train(), None
    pp_mesh = world.mesh["pp"]
    stage_ids, parts, n_stages = pp.split(model, pp_mesh, cfg, spec.first_stage, spec.last_stage, spec.blocks)
    for part in parts:
        spec.parallelize(part, world, cfg)
        _materialize(part, world, cfg)
        part.train()
    schedule, stages = pp.build_schedule(parts, stage_ids, n_stages, pp_mesh, world.device, cfg,
                                         lambda out, labels: loss(out, labels) * scale.value)
    view = pp.parts_view(parts, spec.first_stage + spec.last_stage, spec.blocks)
    return view, Pipeline(schedule, 0 in stage_ids, n_stages - 1 in stage_ids, pp_mesh.get_group(), parts,
                          stages)


def build_balancer(cfg: JobConfig, world: World, args, model: nn.Module, pipeline: Pipeline | None,
                   micro_batches: int) -> experts.Balancer | None:
    if getattr(args, "moe", None) is None:
        return None
    layers = experts.moe_layers(model)  # configured by build_step
    for part in pipeline.parts if pipeline is not None else ():
        experts.forget_shape_inference(part)
    return experts.Balancer(layers, cfg.moe.load_balance_rate,
                            world.flat["routing"].get_group() if world.mesh is not None else None,
                            pipeline.group if pipeline is not None else None, micro_batches)


def build_qk_clip(cfg: JobConfig, world: World, fam, args, model: nn.Module,
                  pipeline: Pipeline | None) -> QKClip | None:
    if not cfg.optimizer.qk_clip_threshold:
        return None
    dims = world.dims
    return QKClip(model, fam.qk_clip(args), cfg.optimizer.qk_clip_threshold,
                  dp_group=world.flat["dp"].get_group() if dims.dp > 1 else None,
                  tp_group=world.mesh["tp"].get_group() if dims.tp > 1 else None,
                  pp_group=pipeline.group if pipeline is not None else None)


def build_side_losses(cfg: JobConfig, model: nn.Module, micro_batches: int,
                      pipeline: Pipeline | None = None) -> list[SideLoss]:
    """The weighted side losses, of every stage under pipelining (each stage's model reads its weight)."""
    parts = pipeline.parts if pipeline is not None else [model]
    losses = [m for part in parts for m in part.modules() if isinstance(m, SideLoss)]
    for part in parts if pipeline is not None else ():
        pp.forget_shape_inference(part, [m for m in part.modules() if isinstance(m, SideLoss)])
    for m in losses:
        section, _, option = m.weight_option.rpartition(".")
        m.weight, m.share = getattr(getattr(cfg, section), option), 1.0 / micro_batches
    return [m for m in losses if m.weight]


def _materialize(model: nn.Module, world: World, cfg: JobConfig) -> None:
    # FSDP CPU offload keeps sharded parameters in host memory.
    materialize(model, world.device, cfg.training.seed,
                torch.device("cpu") if cfg.training.enable_cpu_offload else None,
                lora.initializer(cfg.lora, model.param_init))


def uses_loss_parallel(cfg: JobConfig, world: World) -> bool:
    return world.dims.tp > 1 and not cfg.parallelism.disable_loss_parallel


def training_loss(cfg: JobConfig, world: World, base: Callable = loss_fn) -> Callable:
    """`base` (the family's loss), compiled when compile.components holds "loss", but not under loss parallel:
    compiled, the cross-entropy of vocab-sharded logits came out TP times too large (torch 2.13), so it stays
    eager there."""
    if not (cfg.compile.enable and "loss" in cfg.compile.components):
        return base
    if uses_loss_parallel(cfg, world):
        log.info("compile: the loss stays eager under loss parallel (set parallelism.disable_loss_parallel to "
                 "compile it on gathered logits)")
        return base
    return compile_loss(base)


def set_determinism(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def build_metrics(cfg: JobConfig, world: World, labels: dict[str, str]) -> MetricsLogger:
    return MetricsLogger(cfg.job.dump_folder, cfg.training.steps, active=world.rank == 0, labels=labels,
                         wandb=cfg.metrics.enable_wandb,
                         tensorboard_dir=os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
                         if cfg.metrics.enable_tensorboard else None)


def start_run_folder(cfg: JobConfig, args, checkpointer: Checkpointer, n_params: int) -> None:
    """Once the model and its checkpoint have loaded: the folders are writable (the checkpoint one with room
    for a checkpoint: weights and two Adam moments in fp32), then the run's config and architecture go in."""
    on_rank0(lambda: probe_writable(cfg.job.dump_folder))
    checkpointer.prepare(n_params * 4 * 3)
    if checkpointer.rank == 0:
        write_run_record(cfg.job.dump_folder, cfg, args)


def build_trainer(run: ResolvedRun, world: World) -> Trainer:
    """The run that `tessera.preflight.validate` resolved, built on this rank."""
    cfg, fam = run.cfg, run.family
    set_determinism(cfg)
    t = cfg.training
    tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    damaged: set[str] = set()
    resume = confirm_resume(cfg, run.resume, run.damaged, damaged)  # a damaged one is skipped for an older one
    args, spec = run.args, fam.spec()
    own = spec.training  # a family's own data, batches, loss and evaluation; None: tokens
    grad_accum = run.batch.accumulation
    loss, scale = step_loss(cfg, world, spec), LossScale()
    model, pipeline = build_model(cfg, world, spec, args, loss, scale)
    optimizer = build_optimizer(model, cfg.optimizer, param_role(fam, spec.blocks))
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    if world.rank == 0 and (note := schedule_note(cfg.lr_scheduler, t.steps, cfg.optimizer.lr)):
        log.warning(note)  # a run shorter than its schedule (a smoke run) runs; this says how
    bad = BadRecords(t.max_bad_records)
    data = getattr(own, "data", None) or (lambda c, w, _, splits, bad: {split: build_dataloader(
        c, tokenizer, *ft_check.data_share(c, w.dp_rank, w.dims.dp), split, bad,
        accumulation=grad_accum) for split in splits})
    loaders = data(cfg, world, args, ("train", "validation") if cfg.validation.enable else ("train",), bad)
    loader, val_loader = loaders["train"], loaders.get("validation")
    counts = lora.trained_counts(fam.counts(args, t.seq_len), cfg.lora)  # of the whole model, whatever this rank holds
    peak = Peak(*peak_flops(world.device, cfg.metrics.peak_flops), say=world.rank == 0)
    log.info(f"model {cfg.model.name} {cfg.model.flavor or '(architecture from its checkpoint or config.json)'}: "
             f"{counts.params:,} parameters{f' ({counts.active:,} active)' if counts.active != counts.params else ''}, "
             f"vocab {args.vocab_size}; {world.size} rank(s) on "
             f"{world.device.type}, {world.dims}; grad accumulation {grad_accum}")
    log.info(f"peak FLOP/s {peak.flops:.3g} ({peak.source}); data: {t.dataset} {t.dataset_path}".rstrip())
    step = build_step(cfg, world, spec, model, pipeline=pipeline, loss=loss, scale=scale, batch=run.batch)
    progress = Progress()
    saved = Saved(model=model, optimizer=optimizer, scheduler=scheduler, data=loader, progress=progress,
                  bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, outer=build_outer_state(cfg, model),
                  device=world.device)
    checkpointer = Checkpointer(cfg, world.rank, args, saved, damaged)
    checkpointer.load(resume)
    start_run_folder(cfg, args, checkpointer, counts.params)
    document_bos = tokenizer.bos_id if cfg.model.attn_mask_type == "block_causal" else None
    fetch = functools.partial(own.batch if own is not None else token_batch,
                              BatchView(world, document_bos, tokenizer.eos_id))
    balancer = build_balancer(cfg, world, args, model, pipeline, run.batch.micro_batches)
    replicas = None
    if cfg.fault_tolerance.enable:
        from tessera.ft.replicas import ReplicaGroup
        replicas = ReplicaGroup(cfg, world, saved, fetch, balancer=balancer, model_args=args)
    metrics = build_metrics(cfg, world, dict(fam.metrics))
    evaluate = own.evaluate if own is not None else \
        evaluator(cfg, tokenizer, lambda at, values: metrics.log(at, values, prefix="eval/"), step)
    tr = Trainer(cfg=cfg, world=world, step_parts=step, model_args=args, optimizer=optimizer,
                 scheduler=scheduler, loader=loader, val_loader=val_loader,
                 metrics=metrics, checkpointer=checkpointer, tokenizer=tokenizer,
                 flops_per_token=counts.flops_per_token, peak=peak, token_loss=own is None,
                 batch_fn=replicas.batch if replicas is not None else fetch,  # a group's replays a step run again
                 after_optimizer_step=post_optimizer_hook(model, cfg), bad_records=bad, balancer=balancer,
                 progress=progress, evaluate=evaluate,
                 live_bytes=LiveBytes() if cfg.metrics.live_memory else None, replicas=replicas,
                 qk_clip=build_qk_clip(cfg, world, fam, args, model, pipeline),
                 trainable=StepTrainable(model, fam.trains_only, cfg) if fam.trains_only else None,
                 begin_step=build_begin_step(cfg, spec, model, pipeline))
    return tr


def build_begin_step(cfg: JobConfig, spec, model: nn.Module, pipeline: Pipeline | None):
    """The family's ModelSpec.begin_step on the model, or on each of this rank's pipeline parts."""
    if spec.begin_step is None:
        return None
    parts = pipeline.parts if pipeline is not None else [model]

    def begin_step(step: int) -> None:
        for part in parts:
            spec.begin_step(part, cfg, step)
    return begin_step
