"""Optimizer parameter groups, by rules on parameter names and shapes that a family may refine.

Each parameter gets a role: "embedding" (the family's input embedding; a tied output head is the same tensor,
so one group holds it), "output" (the output head), "vector" (norms and biases: under 2 dims, or named *bias, as
GPT-OSS's stacked expert biases), "matrix" (a weight matrix, or a stack of experts' matrices, of the block
stacks), "other" (any other matrix). Options of [optimizer] turn roles into groups: weight decay off for the
embedding and vectors, lr multipliers for the embedding and the output head, and with Muon, the matrices go to
Muon. Roles that get the same settings share one group, so a config using none of this has the single group it
always had (and its checkpoints load).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tessera.config.sections import Optimizer
from tessera.parallel.init import bare_name

log = logging.getLogger("tessera")
ROLES = ("embedding", "output", "vector", "matrix", "other")


def default_role(name: str, shape: tuple[int, ...], embedding: str, output: str, blocks: tuple[str, ...]) -> str:
    if name == embedding:
        return "embedding"
    if name == output:
        return "output"
    if len(shape) < 2 or name.endswith("bias"):  # a stack of experts' biases (GPT-OSS w1_bias) is no matrix
        return "vector"
    return "matrix" if name.split(".")[0] in blocks else "other"


def param_role(family, blocks: tuple[str, ...]) -> Callable[[str, tuple[int, ...]], str]:
    """The family's roles: its own refinement (Family.param_role) first, then the rules."""
    def role(name: str, shape: tuple[int, ...]) -> str:
        refined = family.param_role(name, shape) if family.param_role is not None else None
        return refined or default_role(name, shape, family.embedding, family.output, blocks)
    return role


@dataclass(frozen=True)
class Settings:
    muon: bool
    lr_multiplier: float
    weight_decay: float


def settings(role: str, cfg: Optimizer) -> Settings:
    multiplier = {"embedding": cfg.embedding_lr_multiplier, "output": cfg.output_lr_multiplier}.get(role, 1.0)
    decay = 0.0 if cfg.weight_decay_exclude and role in ("embedding", "vector") else cfg.weight_decay
    return Settings(cfg.name == "Muon" and role == "matrix", multiplier, decay)


def param_groups(model: nn.Module, cfg: Optimizer, role: Callable[[str, tuple[int, ...]], str]) -> list[dict]:
    """The optimizer's groups, each {"params", "lr", "weight_decay", "muon"} (lr: optimizer.lr x multiplier),
    those at optimizer.lr first, else in the order their first parameter comes; logs each group's roles and size."""
    groups: dict[Settings, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (LoRA's base): no state
            continue
        kind = role(bare_name(name), tuple(p.shape))
        s = settings(kind, cfg)
        group = groups.setdefault(s, {"params": [], "roles": {}, "numel": 0})
        group["params"].append(p)
        group["roles"][kind] = group["roles"].get(kind, 0) + 1
        group["numel"] += p.numel()
    out = []
    # Groups at optimizer.lr first: the lr the metrics log is the first group's.
    for s, group in sorted(groups.items(), key=lambda item: item[0].lr_multiplier != 1.0):
        roles = ", ".join(f"{n} {k}" for k, n in group["roles"].items())
        log.info(f"optimizer group: {'Muon' if s.muon else cfg.name if cfg.name != 'Muon' else 'AdamW'}, "
                 f"lr x{s.lr_multiplier:g}, weight decay {s.weight_decay:g}: {roles} "
                 f"({len(group['params'])} tensors, {group['numel']:,} parameters)")
        out.append({"params": group["params"], "lr": cfg.lr * s.lr_multiplier, "weight_decay": s.weight_decay,
                    "muon": s.muon})
    return out


class StepTrainable:
    """What trains in each step, as the family's Family.trains_only says: after the backward, the other parameters'
    gradients are dropped, so the optimizer leaves them as they are (no weight decay, no moments) and the grad norm
    counts the rest. Dropped rather than frozen beforehand: FSDP's unsharded parameters keep the requires_grad they
    were made with."""

    def __init__(self, model, trains_only, cfg):
        self.named, self.trains_only, self.cfg = list(model.named_parameters()), trains_only, cfg

    def drop_frozen_grads(self, step: int) -> bool:
        """Whether some parameters are frozen in this step (their gradients dropped)."""
        parts = self.trains_only(self.cfg, step)
        if parts is None:
            return False
        for name, p in self.named:
            if not any(part in name for part in parts):
                p.grad = None
        return True
