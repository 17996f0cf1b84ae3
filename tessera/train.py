"""Entry point: `torchrun --nproc_per_node=N -m tessera.train --job.config_file FILE [--section.key VALUE ...]`."""

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from tessera.checkpoint.hf import HFError
from tessera.checkpoint.manager import CorruptCheckpoint
from tessera.config import ConfigError
from tessera.data.masks import trained_tokens
from tessera.distributed import World, init_world, set_timeout, shutdown, timeout_message, world_size_from_env
from tessera.experts import reset_statistics
from tessera.memory import live_memory, live_memory_metrics
from tessera.metrics import peak_memory_gib, setup_logging
from tessera.optim import clip_grad_norm_
from tessera.preflight import validate
from tessera.profiling import dump_cuda_snapshot, profiled
from tessera.report import write_report
from tessera.schema import help_text, parse_run
from tessera.step import forward_backward
from tessera.stopping import REQUEUE_EXIT, SaveFailed, Stopped, StopRequest
from tessera.tensors import local
from tessera.trainer import Trainer, build_trainer, run_view

log = logging.getLogger("tessera")


class NonFiniteError(RuntimeError):
    pass


class CommTimeout(RuntimeError):
    pass


def dp_mean(value: torch.Tensor, world: World) -> float:
    """Mean over the ranks that hold different tokens (data and context parallel); equal token counts."""
    n = world.dims.dp * world.dims.cp
    if n > 1:
        value = value.clone()
        dist.all_reduce(value, group=world.flat["dp_cp"].get_group())
        value /= n
    return value.item()


def dp_cp_sum(value: torch.Tensor, world: World) -> torch.Tensor:
    """The sum over the ranks that hold different tokens (data and context parallel)."""
    if world.dims.dp * world.dims.cp > 1:
        value = value.clone()
        dist.all_reduce(value, group=world.flat["dp_cp"].get_group())
    return value


def step_batches(tr: Trainer, times: list[float]):
    """The step's micro-batches, each one's loading time appended to `times`."""
    for _ in range(tr.step_parts.grad_accum):
        start = time.perf_counter()
        batch = tr.batch_fn(tr.loader)
        times.append(time.perf_counter() - start)
        yield batch


def set_loss_scale(tr: Trainer, labels: list[torch.Tensor] | None) -> torch.Tensor | None:
    """Before a step: the token loss's scale from the trained tokens of the whole global batch (`labels`: this
    rank's micro-batches'), which it returns; a family's own mean loss: 1 / its micro-batches."""
    if labels is None:
        tr.step_parts.loss_scale.value = 1.0 / tr.step_parts.micro_batches
        return None
    trained = dp_cp_sum(torch.stack([trained_tokens(y) for y in labels]).sum().float(), tr.world)
    tr.step_parts.loss_scale.value = tr.world.dims.dp * tr.world.dims.cp / trained.clamp(min=1)
    return trained


def pp_share(value: torch.Tensor, tr: Trainer) -> torch.Tensor:
    """The last stage's loss, on every stage."""
    if tr.step_parts.pipeline is not None:
        dist.all_reduce(value, group=tr.step_parts.pipeline.group)
    return value


def train_step(tr: Trainer) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]:
    """One optimizer step over `grad_accum` micro-batches; returns (local loss, grad norm, data seconds, trained
    tokens of the global batch (None for a family's own loss)), or None
    under fault tolerance when the replica groups' quorum did not commit it (nothing applied; run it again)."""
    if tr.replicas is not None:
        tr.replicas.begin_step()  # this step's quorum; a group behind the others recovers from a live one here
    tr.optimizer.zero_grad()
    for side in tr.step_parts.side_losses:
        side.reset()
    if tr.begin_step is not None:
        tr.begin_step(tr.progress.step)
    if tr.qk_clip is not None:
        tr.qk_clip.reset()
    loss_total, times = torch.zeros((), device=tr.world.device), []
    batches = step_batches(tr, times)
    if tr.token_loss:  # all loaded first: the step's loss is normalized by their trained tokens
        batches = list(batches)
    trained = set_loss_scale(tr, [labels for _, labels in batches] if tr.token_loss else None)
    for inputs, labels in batches:
        loss_total += forward_backward(tr.step_parts, inputs, labels)
    data_s = sum(times)
    loss_total = pp_share(loss_total, tr)
    if tr.replicas is not None:
        tr.replicas.average_gradients()
    partial = tr.trainable is not None and tr.trainable.drop_frozen_grads(tr.progress.step)
    grad_norm = clip_grad_norm_(tr.step_parts.model.parameters(), tr.cfg.training.max_norm,
                                pp_group=tr.step_parts.pipeline.group if tr.step_parts.pipeline else None)
    if tr.replicas is not None and not tr.replicas.commit():
        return None
    if tr.cfg.training.nonfinite_policy == "skip" and not torch.isfinite(grad_norm).item():  # the same on every rank
        skip_update(tr)
    else:
        # Recorded on the device and checked at log and save time: a check per step would stall the GPU queue.
        bad = ~torch.isfinite(loss_total + grad_norm)
        if tr.first_nonfinite is None:
            tr.first_nonfinite = torch.full((), float("inf"), device=tr.world.device)
        tr.first_nonfinite = torch.where(bad, tr.first_nonfinite.clamp(max=tr.progress.step + 1), tr.first_nonfinite)
        tr.optimizer.step()
        if tr.qk_clip is not None:
            tr.qk_clip.after_step()
        if tr.after_optimizer_step is not None:
            tr.after_optimizer_step()
        if tr.balancer is not None and not partial:  # frozen routers: their selection bias too
            tr.balancer.after_step()
    tr.scheduler.step()
    return loss_total, grad_norm, data_s, trained


def skip_update(tr: Trainer) -> None:
    """training.nonfinite_policy = skip: a step with non-finite gradients changes no weight, no optimizer state
    and no expert bias (its load statistics are dropped)."""
    progress, limit = tr.progress, tr.cfg.training.max_skipped_steps
    progress.skipped_steps += 1
    if progress.skipped_steps > limit:
        raise NonFiniteError(f"step {progress.step + 1}: non-finite grad norm, {progress.skipped_steps} skipped steps, "
                             f"more than training.max_skipped_steps = {limit}; lower optimizer.lr or check the data")
    log.warning(f"step {progress.step + 1}: non-finite grad norm; skipped, no update ({progress.skipped_steps} of at "
                f"most {limit})")
    tr.optimizer.zero_grad()
    if tr.balancer is not None:
        reset_statistics(tr.balancer.layers)


def raise_if_nonfinite(tr: Trainer) -> None:
    if tr.first_nonfinite is not None and (step := tr.first_nonfinite.item()) != float("inf"):
        raise NonFiniteError(f"step {int(step)}: non-finite loss or grad norm; lower optimizer.lr, check the "
                             f"data, or raise lr_scheduler.warmup_steps (no checkpoint was saved after it)")


@torch.no_grad()
def validate_loss(tr: Trainer) -> float:
    tr.step_parts.model.eval()
    tr.val_loader.rewind()
    total, trained = torch.zeros((), device=tr.world.device), torch.zeros((), device=tr.world.device)
    # The token loss: summed, then divided by the trained tokens of all batches; a family's: a mean per batch.
    passes = tr.step_parts.micro_batches // tr.step_parts.grad_accum  # of one local batch: a validation step's
    tr.step_parts.loss_scale.value = 1.0 if tr.token_loss else 1.0 / passes
    for _ in range(tr.cfg.validation.steps):
        inputs, labels = tr.batch_fn(tr.val_loader)
        total += forward_backward(tr.step_parts, inputs, labels, train=False)
        trained += trained_tokens(labels) if tr.token_loss else 0
    tr.step_parts.model.train()
    if tr.balancer is not None:  # what MoE layers counted of the held-out tokens is no load the next update balances
        reset_statistics(tr.balancer.layers)
    total = pp_share(total, tr)
    if tr.token_loss:
        return (dp_cp_sum(total, tr.world) / dp_cp_sum(trained, tr.world).clamp(min=1)).item()
    return dp_mean(total / tr.cfg.validation.steps, tr.world)


def train(tr: Trainer) -> None:
    t, m = tr.cfg.training, tr.cfg.metrics
    # Per device: TP/PP/CP ranks of one data-parallel replica share its tokens, so each counts once.
    tokens_per_step = t.local_batch_size * t.seq_len * tr.step_parts.grad_accum * tr.world.dims.dp / tr.world.size
    window_start, window_data_s, window_steps, window_trained = time.perf_counter(), 0.0, 0, 0.0
    first_step = tr.progress.step
    with profiled(tr.cfg, tr.world.rank, tr.world.device, first_step) as after_step, live_memory(tr), \
            StopRequest(tr.cfg.checkpoint.save_on_signal, tr.world.size) as stop:
        while tr.progress.step < t.steps:
            lr = tr.optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves on to the next one's
            stepped = train_step(tr)
            if stepped is None:  # fault tolerance: not committed by the replica groups' quorum
                if asked := at_boundary(tr, stop):  # a signal still stops the run (at the last committed step)
                    stop_and_save(tr, stop, asked)
                continue
            loss, grad_norm, data_s, trained = stepped
            if tr.progress.step == first_step:  # start-up and first compiles are over: a long wait now means trouble
                set_timeout(tr.world, tr.cfg.comm.train_timeout_seconds, "comm.train_timeout_seconds")
                if tr.cfg.compile.enable:
                    log.info(f"compile: first step took {time.perf_counter() - window_start:.1f}s, compilation "
                             f"included")
            tr.progress.step += 1
            after_step()
            tr.progress.tokens_seen += int(tokens_per_step * tr.world.size)
            if tr.replicas is not None:
                tr.replicas.after_step()  # semi-synchronous replica groups sync here, every sync_steps
            window_data_s, window_steps = window_data_s + data_s, window_steps + 1
            window_trained = window_trained + trained if trained is not None else None
            last = tr.progress.step == t.steps
            if tr.progress.step % m.log_freq == 0 or last or tr.checkpointer.should_save(tr.progress.step, last):
                raise_if_nonfinite(tr)
            if tr.progress.step % m.log_freq == 0 or last:
                log_window(tr, loss, grad_norm, lr, tokens_per_step * window_steps, window_data_s, window_start,
                           None if window_trained is None else window_trained / window_steps)
                window_start, window_data_s, window_steps, window_trained = time.perf_counter(), 0.0, 0, 0.0
            # Before validation: nothing after it can lose a save. Under fault tolerance one group saves.
            if tr.checkpointer.should_save(tr.progress.step, last) and (tr.replicas is None or tr.replicas.saves()):
                tr.checkpointer.save(last)
            if (asked := at_boundary(tr, stop)) and not last:  # every rank the same: a signal stops the run here,
                stop_and_save(tr, stop, asked)  # saved at once, the step's validation skipped (the kill is near)
            if tr.val_loader is not None and (tr.progress.step % tr.cfg.validation.freq == 0 or last):
                tr.metrics.log(tr.progress.step, {"loss": validate_loss(tr)}, prefix="validation/")
                window_start = time.perf_counter()
            if tr.evaluate is not None and tr.evaluate(run_view(tr), last):  # its time is not the step's
                window_start = time.perf_counter()
    tr.checkpointer.wait()


def at_boundary(tr: Trainer, stop: StopRequest) -> str | None:
    """The signal some rank got, agreed on by every rank (or None); a failed save ends the run here, on every
    rank, in one line."""
    asked, failed = stop.agree(tr.checkpointer.failure is not None)
    if failed:
        raise SaveFailed(stop.first_message(tr.checkpointer.failure) or "a checkpoint save failed on another rank")
    return asked


def stop_and_save(tr: Trainer, stop: StopRequest, asked: str) -> None:
    """A full checkpoint of the step reached (unless this step's was just written; an async one in flight is
    waited for), then Stopped with the line saying so. Nothing else first: the scheduler kills the run
    checkpoint.signal_grace_seconds after its signal, so the step's validation is skipped and the purge of older
    checkpoints left to the next run; a stop whose save ends later than that says so."""
    saves = tr.cfg.checkpoint.enable and (tr.replicas is None or tr.replicas.saves())
    if saves and not tr.checkpointer.should_save(tr.progress.step, False):
        tr.checkpointer.save(sync=True, purge=False)
    tr.checkpointer.wait()
    at_boundary(tr, stop)  # this save failed: that line instead
    grace = tr.cfg.checkpoint.signal_grace_seconds
    if saves and stop.received_at is not None and (took := time.monotonic() - stop.received_at) > grace:
        log.warning(f"the stop took {took:.1f}s from {asked} to its checkpoint saved, more than checkpoint."
                    f"signal_grace_seconds = {grace}: a scheduler that kills that long after its signal would have "
                    f"cut it")
    where = (f"checkpoint step {tr.progress.step} saved in {tr.checkpointer.root}" if saves else
             "no checkpoint saved (checkpoint.enable = false)" if not tr.cfg.checkpoint.enable else
             "this replica group saves no checkpoint (another group of the job does)")
    raise Stopped(f"stopped on {asked} after step {tr.progress.step} of {tr.cfg.training.steps}: {where}; exit status "
                  f"{REQUEUE_EXIT} (relaunch, or let SLURM requeue, to resume)")


def side_loss_metrics(tr: Trainer) -> dict[str, float]:
    """Each side loss's mean since the last log over the data ranks; under pipelining the last stage's (every
    stage holds the side losses, the last runs them), on every stage."""
    out = {}
    for metric in dict.fromkeys(m.metric for m in tr.step_parts.side_losses):
        summed = torch.zeros(2, device=tr.world.device)  # its values (local: loss parallel's are DTensors), count
        for m in tr.step_parts.side_losses:
            if m.metric == metric and m.count:
                summed += torch.stack([local(m.total).float(), summed.new_tensor(float(m.count))])
        summed = pp_share(summed, tr)
        if summed[1]:
            out[metric] = dp_mean(summed[0] / summed[1], tr.world)
    return out


def log_window(tr: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, tokens: float, data_s: float,
               start: float, trained: torch.Tensor | None = None) -> None:
    """The metrics of the steps since the last log (`tokens` per device in them; `trained`: the trained tokens
    of the global batch per step), at the last one's step."""
    if tr.world.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tps = tokens / elapsed
    stall, tr.checkpointer.stall_s = tr.checkpointer.stall_s, 0.0
    record = {"loss": dp_mean(loss, tr.world), "grad_norm": grad_norm.item(),
              "lr": lr, "tps": tps, "tflops": tps * tr.flops_per_token / 1e12,
              "mfu": tr.peak.mfu(tps * tr.flops_per_token), "memory_gib": peak_memory_gib(tr.world.device),
              "data_share": data_s / elapsed, "checkpoint_stall_s": stall,
              "samples_per_s": tps / tr.cfg.training.seq_len}  # sequences (Flux: images) per second per device
    if trained is not None:
        record["trained_tokens"] = float(trained)  # per step, global: tokens_seen counts every token
    if tr.cfg.training.nonfinite_policy == "skip":
        record["skipped_steps"] = tr.progress.skipped_steps
    if getattr(tr.loader, "mixture", None) is not None:  # the realized share of each dataset so far
        record.update({f"mix/{name}": share for name, share in tr.loader.shares().items()})
    if tr.balancer is not None:
        record.update(tr.balancer.metrics(tr.world.device))
    if tr.qk_clip is not None:
        record.update(tr.qk_clip.metrics(tr.world.device))
    record.update(side_loss_metrics(tr))
    record.update(live_memory_metrics(tr))
    if tr.replicas is not None:
        record.update(tr.replicas.metrics())
    tr.metrics.log(tr.progress.step, record)
    tr.history.append({"step": tr.progress.step, **record})


def summarize(tr: Trainer) -> None:
    dump = os.path.abspath(tr.cfg.job.dump_folder)
    if not tr.history:
        log.info(f"nothing to train: the checkpoint in {dump} is already at step {tr.progress.step} of "
                 f"{tr.cfg.training.steps}; raise training.steps or pick another job.dump_folder")
        return
    mean_tps = sum(h["tps"] for h in tr.history) / len(tr.history)
    log.info(f"done: {tr.progress.step} steps, final loss {tr.history[-1]['loss']:.4f}, mean {mean_tps:,.0f} tokens/s "
             f"per device, {tr.progress.tokens_seen:,} tokens seen")
    if tr.bad_records.count:
        log.warning(f"{tr.bad_records.count} bad data record(s) skipped (training.max_bad_records = "
                    f"{tr.cfg.training.max_bad_records}); the first, {tr.bad_records.first}")
    where = [f"config and metrics.jsonl in {dump}"]
    if tr.cfg.checkpoint.enable:
        where.append(f"checkpoints in {os.path.abspath(tr.checkpointer.root)}")
    if tr.cfg.metrics.enable_tensorboard:
        where.append(f"TensorBoard: tensorboard --logdir {os.path.join(dump, tr.cfg.metrics.save_tb_folder)}")
    log.info("; ".join(where))


def _fail(error: BaseException, code: int) -> int:
    """One line for the whole job, and the exit status. Under tessera.launch each rank leaves the line in its
    torchelastic error file and the launcher prints the first failure's; otherwise rank 0 prints it."""
    report(f"{error}" if code == 2 or isinstance(error, (NonFiniteError, CorruptCheckpoint, CommTimeout, Stopped,
                                                         SaveFailed))
           else f"{type(error).__name__}: {error}")
    return code


def report(message: str) -> None:
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as fh:
            json.dump({"message": message, "timestamp": int(time.time()), "tessera": True}, fh)
    if not os.environ.get("TESSERA_LAUNCHER") and int(os.environ.get("RANK", "0")) == 0:
        print(f"tessera: {message}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    setup_logging(int(os.environ.get("RANK", "0")))  # the pre-check may log (it reads checkpoints)
    try:
        one_process = "LOCAL_RANK" not in os.environ  # then it is the launch too
        run = validate(parse_run(argv), world_size_from_env(), launch=one_process, training=True)
    except ConfigError as e:
        return _fail(e, 2)
    cfg = run.cfg
    world = init_world(run.dims, cfg.comm.init_timeout_seconds)
    setup_logging(world.rank)
    clean, tr = False, None
    try:
        tr = build_trainer(run, world)
        if cfg.checkpoint.create_seed_checkpoint:
            tr.checkpointer.save_seed()
        else:
            train(tr)
            summarize(tr)
            if world.rank == 0:
                write_report([cfg.job.dump_folder])
        tr.metrics.close()
        clean = True
    except (ConfigError, HFError) as e:  # bad input found once ranks run: the tokenizer, data, checkpoints
        return _fail(e, 2)
    except (NonFiniteError, CorruptCheckpoint) as e:
        return _fail(e, 1)
    except (Stopped, SaveFailed) as e:  # every rank at the same step boundary
        tr.metrics.close()
        clean = True
        return _fail(e, REQUEUE_EXIT if isinstance(e, Stopped) else 1)
    except Exception as e:  # a fault: its traceback follows; the launcher names the rank
        if why := timeout_message(e, world.timeout):
            return _fail(CommTimeout(f"{f'step {tr.progress.step + 1}' if tr else 'start-up'}: {why}"), 1)
        if isinstance(e, torch.OutOfMemoryError) and cfg.profiling.enable_memory_snapshot:
            dump_cuda_snapshot(cfg, world.rank, "oom")
        _fail(e, 1)
        raise
    finally:
        if tr is not None and tr.replicas is not None:
            tr.replicas.close()
        shutdown(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
