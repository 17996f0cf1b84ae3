"""Entry point: `torchrun --nproc_per_node=N -m tessera.train --job.config_file FILE [--section.key VALUE ...]`."""

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera import models
from tessera.checkpoint.manager import Checkpointer, CorruptCheckpoint
from tessera.config import ConfigError, JobConfig, help_text, parse_args, to_toml
from tessera.config.validate import check_vocab, validate
from tessera.data import build_dataloader, build_tokenizer
from tessera.distributed import World, init_world, shutdown, world_size_from_env
from tessera.metrics import MetricsLogger, flops_per_token, peak_flops, peak_memory_gib, setup_logging
from tessera.models.llama3.model import num_params
from tessera.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from tessera.parallel.init import materialize
from tessera.parallel.tp import local, loss_context

log = logging.getLogger("tessera")


class NonFiniteError(RuntimeError):
    pass


@dataclass
class Trainer:
    cfg: JobConfig
    world: World
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: object
    val_loader: object | None
    metrics: MetricsLogger
    grad_accum: int
    flops_per_token: float
    peak_flops: float
    autocast: contextlib.AbstractContextManager
    loss_parallel: bool
    model_args: object
    checkpointer: Checkpointer
    step: int = 0
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_model(cfg: JobConfig, world: World, vocab_size: int):
    family = models.family(cfg.model.name)
    args = dataclasses.replace(family.FLAVORS[cfg.model.flavor], max_seq_len=cfg.training.seq_len)
    if cfg.model.flavor in family.TAKES_TOKENIZER_VOCAB:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    with torch.device("meta"):
        model = family.Transformer(args)
    model = family.parallelize(model, world, cfg)
    materialize(model, world.device, cfg.training.seed)
    return model.train(), args


def set_determinism(cfg: JobConfig) -> None:
    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def build_trainer(cfg: JobConfig, world: World) -> Trainer:
    set_determinism(cfg)
    t = cfg.training
    tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    check_vocab(cfg, tokenizer.vocab_size, world.dims.tp)
    model, args = build_model(cfg, world, tokenizer.vocab_size)
    optimizer = build_optimizer(model, cfg.optimizer, world.device)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    loader = build_dataloader(cfg, tokenizer, world.dp_rank, world.dims.dp)
    val_loader = build_dataloader(cfg, tokenizer, world.dp_rank, world.dims.dp, split="validation") \
        if cfg.validation.enable else None
    per_step = t.local_batch_size * world.dims.dp
    grad_accum = 1 if t.global_batch_size == -1 else t.global_batch_size // per_step
    peak, peak_source = peak_flops(world.device)
    mixed = world.dp_mesh() is None and cfg.training.mixed_precision_param == "bfloat16"
    autocast = torch.autocast(world.device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    active = world.rank == 0
    metrics = MetricsLogger(cfg.job.dump_folder, t.steps, active=active, wandb=cfg.metrics.enable_wandb,
                            tensorboard_dir=os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
                            if cfg.metrics.enable_tensorboard else None, config=None)
    if active:
        with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as fh:
            fh.write(to_toml(cfg))
    n_params = num_params(model)
    log.info(f"model {cfg.model.name} {cfg.model.flavor}: {n_params:,} parameters, vocab {args.vocab_size}; "
             f"{world.size} rank(s) on {world.device.type}, {world.dims}; grad accumulation {grad_accum}")
    log.info(f"peak FLOP/s {peak:.3g} ({peak_source}); data: {t.dataset} {t.dataset_path}".rstrip())
    fpt = flops_per_token(num_params(model, exclude_embedding=True), args.n_layers, args.n_heads, args.head_dim,
                          t.seq_len)
    loss_parallel = world.dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
    tr = Trainer(cfg, world, model, optimizer, scheduler, loader, val_loader, metrics, grad_accum, fpt, peak,
                 autocast, loss_parallel, args, Checkpointer(cfg, world.rank))
    tr.checkpointer.load(tr)
    return tr


def dp_mean(value: torch.Tensor, world: World) -> float:
    if world.dims.dp > 1:
        value = value.clone()
        dist.all_reduce(value, group=world.flat["dp"].get_group())
        value /= world.dims.dp
    return value.item()


def train_step(tr: Trainer) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over `grad_accum` micro-batches; returns (local loss, grad norm, data seconds)."""
    tr.optimizer.zero_grad()
    loss_total, data_s = torch.zeros((), device=tr.world.device), 0.0
    for _ in range(tr.grad_accum):
        start = time.perf_counter()
        inputs, labels = tr.loader.next_batch()
        inputs, labels = inputs.to(tr.world.device, non_blocking=True), labels.to(tr.world.device, non_blocking=True)
        data_s += time.perf_counter() - start
        with loss_context(tr.loss_parallel):
            with tr.autocast:
                # Micro-batches hold equal token counts, so the mean of means is the global mean.
                loss = loss_fn(tr.model(inputs), labels) / tr.grad_accum
            loss.backward()
        loss_total += local(loss.detach())
    grad_norm = clip_grad_norm_(tr.model.parameters(), tr.cfg.training.max_norm)
    if not torch.isfinite(loss_total + grad_norm).item():
        raise NonFiniteError(f"step {tr.step + 1}: non-finite loss {loss_total.item()} or grad norm "
                             f"{grad_norm.item()}; lower optimizer.lr, check the data, or raise warmup")
    tr.optimizer.step()
    tr.scheduler.step()
    return loss_total, grad_norm, data_s


@torch.no_grad()
def validate_loss(tr: Trainer) -> float:
    tr.model.eval()
    tr.val_loader.load_state_dict({"sample_index": 0})
    total = torch.zeros((), device=tr.world.device)
    for _ in range(tr.cfg.validation.steps):
        inputs, labels = (x.to(tr.world.device) for x in tr.val_loader.next_batch())
        with tr.autocast, loss_context(tr.loss_parallel):
            total += local(loss_fn(tr.model(inputs), labels))
    tr.model.train()
    return dp_mean(total / tr.cfg.validation.steps, tr.world)


def train(tr: Trainer) -> None:
    t, m = tr.cfg.training, tr.cfg.metrics
    # Per device: TP/PP/CP ranks of one data-parallel replica share its tokens, so each counts once.
    tokens_per_step = t.local_batch_size * t.seq_len * tr.grad_accum * tr.world.dims.dp / tr.world.size
    window_start, window_data_s, window_steps = time.perf_counter(), 0.0, 0
    while tr.step < t.steps:
        loss, grad_norm, data_s = train_step(tr)
        tr.step += 1
        tr.tokens_seen += int(tokens_per_step * tr.world.size)
        window_data_s, window_steps = window_data_s + data_s, window_steps + 1
        if tr.step % m.log_freq == 0 or tr.step == t.steps:
            if tr.world.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - window_start
            tps = tokens_per_step * window_steps / elapsed
            stall, tr.checkpointer.stall_s = tr.checkpointer.stall_s, 0.0
            record = {"loss": dp_mean(loss, tr.world), "grad_norm": grad_norm.item(),
                      "lr": tr.scheduler.get_last_lr()[0], "tps": tps, "tflops": tps * tr.flops_per_token / 1e12,
                      "mfu": tps * tr.flops_per_token / tr.peak_flops, "memory_gib": peak_memory_gib(tr.world.device),
                      "data_share": window_data_s / elapsed, "checkpoint_stall_s": stall}
            tr.metrics.log(tr.step, record)
            tr.history.append({"step": tr.step, **record})
            window_start, window_data_s, window_steps = time.perf_counter(), 0.0, 0
        if tr.val_loader is not None and (tr.step % tr.cfg.validation.freq == 0 or tr.step == t.steps):
            tr.metrics.log(tr.step, {"loss": validate_loss(tr)}, prefix="validation/")
            window_start = time.perf_counter()
        if tr.checkpointer.should_save(tr.step, last=tr.step == t.steps):
            tr.checkpointer.save(tr, last=tr.step == t.steps)
    tr.checkpointer.wait()


def summarize(tr: Trainer) -> None:
    if not tr.history:
        return
    mean_tps = sum(h["tps"] for h in tr.history) / len(tr.history)
    dump = os.path.abspath(tr.cfg.job.dump_folder)
    log.info(f"done: {tr.step} steps, final loss {tr.history[-1]['loss']:.4f}, mean {mean_tps:,.0f} tokens/s "
             f"per device, {tr.tokens_seen:,} tokens seen")
    log.info(f"config and metrics.jsonl in {dump}" +
             (f"; TensorBoard: tensorboard --logdir {os.path.join(dump, tr.cfg.metrics.save_tb_folder)}"
              if tr.cfg.metrics.enable_tensorboard else ""))


def _fail(error: Exception, code: int) -> int:
    """One line on stderr (from rank 0 only, so a job prints it once) and the exit status."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"tessera: {error}", file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
        dims = validate(cfg, world_size_from_env())
    except ConfigError as e:
        return _fail(e, 2)
    world = init_world(dims)
    setup_logging(world.rank)
    try:
        tr = build_trainer(cfg, world)
        if cfg.checkpoint.create_seed_checkpoint:
            tr.checkpointer.save_seed(tr)
        else:
            train(tr)
            summarize(tr)
        tr.metrics.close()
    except ConfigError as e:  # checks that need the tokenizer, the model or the checkpoint folder
        return _fail(e, 2)
    except (NonFiniteError, CorruptCheckpoint) as e:
        return _fail(e, 1)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
