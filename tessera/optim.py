"""Optimizer, LR schedule and gradient clipping that stays correct under sharding."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.config.sections import LRScheduler, Optimizer
from tessera.muon import Muon, muon_settings
from tessera.optim_state import with_state_dtype
from tessera.param_groups import param_groups


def build_optimizer(model: nn.Module, cfg: Optimizer, role=None) -> torch.optim.Optimizer:
    """`role`: (name, shape) -> the parameter's role (tessera.param_groups), for groups; None: one group."""
    # Fused kernels exist for CUDA and CPU and take DTensor (FSDP/TP) params; on a 2-core CPU the fused
    # AdamW step of debugmodel takes 5 ms against 13-20 ms for foreach and the per-tensor loop.
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    params = [p for p in model.parameters() if p.requires_grad] if role is None else param_groups(model, cfg, role)
    if cfg.name == "Muon":
        return Muon(params, muon_settings(cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                    weight_decay=cfg.weight_decay, fused=impl == "fused", foreach=impl == "foreach")
    if cfg.name == "SGD":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=impl == "fused",
                               foreach=impl == "foreach")
    cls = with_state_dtype(torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam, cfg.state_dtype)
    return cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
               weight_decay=cfg.weight_decay, fused=impl == "fused", foreach=impl == "foreach")


def phases(cfg: LRScheduler, total: int) -> tuple[int, int]:
    """(warm-up, decay) steps of a run of `total` steps. The warm-up is the configured one whatever the total, so
    a run shorter than it (a smoke run) follows the first steps of the full run's schedule and an extended one
    goes on from there; the decay takes at most what the warm-up leaves."""
    decay = total - cfg.warmup_steps if cfg.decay_ratio is None else round(cfg.decay_ratio * total)
    return cfg.warmup_steps, max(0, min(decay, total - cfg.warmup_steps))


def schedule_note(cfg: LRScheduler, total: int, peak_lr: float) -> str | None:
    """One line saying how a run too short for its schedule runs it, or None when the schedule fits."""
    warmup, decay = phases(cfg, total)
    if warmup > total:
        return (f"lr_scheduler.warmup_steps: {warmup} is longer than the run (training.steps = {total}); the run ends "
                f"inside the warm-up, at lr {peak_lr * lr_lambda(total - 1, cfg, total):.3g} ({total}/{warmup + 1} of "
                f"optimizer.lr {peak_lr:g}), and does not decay: the first {total} steps of the longer run's schedule")
    asked = None if cfg.decay_ratio is None else round(cfg.decay_ratio * total)
    if asked is not None and asked > decay:
        then = f"decays over the last {decay} steps instead" if decay else "does not decay"
        return (f"lr_scheduler.decay_ratio: warm-up {warmup} + decay {asked} steps is longer than the run "
                f"({total} steps); the lr {then}")
    return None


def lr_lambda(step: int, cfg: LRScheduler, total: int) -> float:
    """Warmup, stable, decay (WSD). `step` counts from 0; returns a factor of the peak lr.

    Warmup starts at 1/(warmup+1) rather than 0 so the first step still learns.
    """
    warmup, decay = phases(cfg, total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < total - decay or decay == 0:
        return 1.0
    progress = min(1.0, (step - (total - decay) + 1) / decay)
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * _decay_shape(progress, cfg.decay_type)


def _decay_shape(progress: float, decay_type: str) -> float:
    return {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
            "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[decay_type]


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """The run's lr schedule (lr_lambda over its total steps). Loading a saved one continues it at its step, over
    this run's training.steps and peak lr: a run extended (or shortened) on resume follows the schedule of its new
    total from the step reached (warm-up, which does not depend on the total, never restarts), and a changed
    optimizer.lr is the new peak from there. The next step's lr is set here: the optimizer's saved param groups
    hold the lr of the old schedule."""

    def load_state_dict(self, state_dict: dict) -> None:
        peaks = list(self.base_lrs)  # this run's: optimizer.lr times each group's multiplier
        super().load_state_dict(state_dict)
        self.base_lrs = peaks
        self._last_lr = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> Schedule:
    return Schedule(opt, lambda s: lr_lambda(s, cfg, total_steps))


# Settings a resume applies to the saved optimizer state (its moments stay valid under them): {key: what it is}.
RESUMABLE = ("name", "lr", "beta1", "beta2", "eps", "weight_decay")


def keep_settings(optimizer: torch.optim.Optimizer, built: list[dict]) -> None:
    """After loading a checkpoint's optimizer state: its param groups' settings (betas, eps, weight decay,
    Adam or AdamW's decoupling, the peak lr) replaced by `built`, the groups' settings as this run built them
    (the lr itself is the scheduler's to set)."""
    for group, ours in zip(optimizer.param_groups, built, strict=True):
        group.update({key: value for key, value in ours.items() if key not in ("params", "lr")})


def settings_changed(saved: dict, cfg: Optimizer) -> list[str]:
    """'key old -> new' for each RESUMABLE setting of `cfg` that the checkpoint's [optimizer] table `saved` set
    otherwise (a key it lacks, from an older config, had the default)."""
    defaults = Optimizer()
    return [f"{key} {saved.get(key, getattr(defaults, key))} -> {getattr(cfg, key)}" for key in RESUMABLE
            if saved.get(key, getattr(defaults, key)) != getattr(cfg, key)]


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm over every gradient, whatever its sharding; clips when max_norm > 0. Gradients on
    different meshes (dense and expert parameters) are normed per mesh, then their squares added."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        # A norm of sharded grads is a partial result; full_tensor() reduces it over the mesh.
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    norm = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:  # each stage holds other parameters: add the squares
        torch.distributed.all_reduce(norm, group=pp_group)
    norm = norm.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():  # one foreach op per mesh: DTensor ops do not mix meshes
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)  # takes params, not grads
    return norm
