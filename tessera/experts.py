"""The training side of mixture-of-experts layers: the `moe` settings, the aux-loss-free bias update after
each optimizer step, and the balance metrics. Token counts are summed over every rank of a pipeline stage
that routes its own tokens, so every rank holds the same biases."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.models.common.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def configure(layers: list[MoE], cfg, loss_share: int) -> None:
    """`cfg`: the `moe` section; `loss_share`: micro-batches per optimizer step (each one's share of its loss)."""
    for m in layers:
        m.aux_loss_coef, m.aux_scale = cfg.aux_loss_coef, 1.0 / loss_share
        m.router.force_balanced, m.experts.grouped = cfg.force_balanced, cfg.grouped_mm


def reset_statistics(layers: list[MoE]) -> None:
    for m in layers:
        m.tokens_per_expert.zero_()
        m.aux_loss_sum = torch.zeros_like(m.aux_loss_sum)


def forget_shape_inference(stage: nn.Module) -> None:
    """A pipeline stage's first forward infers shapes, on uninitialized tensors: what its MoE layers counted
    then is dropped when the first real forward starts."""
    layers, calls = moe_layers(stage), []

    def hook(module: nn.Module, args) -> None:
        calls.append(1)
        if len(calls) == 2:
            reset_statistics(layers)
            handle.remove()
    handle = stage.register_forward_pre_hook(hook)


@dataclass
class Balancer:
    layers: list[MoE]  # this rank's (its pipeline stages')
    rate: float  # moe.load_balance_rate
    group: dist.ProcessGroup | None  # the stage's routing ranks
    pp_group: dist.ProcessGroup | None
    micro_batches: int
    counts: torch.Tensor | None = None  # [layers, experts] of the last step, over the routing ranks
    aux: torch.Tensor | None = None  # [layers]: its mean balancing loss per micro-batch and rank

    @torch.no_grad()
    def after_step(self) -> None:
        """Move each bias by `rate` toward an even load (experts above the mean down, below it up), then start
        counting afresh."""
        if not self.layers:
            return
        stats = torch.stack([torch.cat([m.tokens_per_expert, m.aux_loss_sum.reshape(1)]) for m in self.layers])
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
        ranks = 1 if self.group is None else dist.get_world_size(self.group)
        self.counts, self.aux = stats[:, :-1], stats[:, -1] / (ranks * self.micro_batches)
        if self.rate:
            delta = self.rate * torch.sign(self.counts.mean(-1, keepdim=True) - self.counts)
            delta -= delta.mean(-1, keepdim=True)  # the biases' sum stays 0
            for m, d in zip(self.layers, delta, strict=True):
                m.expert_bias += d
        reset_statistics(self.layers)

    @torch.no_grad()
    def metrics(self, device: torch.device) -> dict[str, float]:
        """The last step's load imbalance (max / mean tokens per expert: mean and worst over layers, every
        stage's) and balancing loss (summed over layers). Every rank calls it at the same steps."""
        if self.counts is None:
            ratios, aux = torch.zeros(0, device=device), torch.zeros((), device=device)
        else:
            ratios, aux = self.counts.max(-1).values / self.counts.mean(-1).clamp(min=1e-9), self.aux.sum()
        summed = torch.stack([ratios.sum(), torch.tensor(float(len(ratios)), device=device), aux])
        worst = ratios.max() if len(ratios) else torch.zeros((), device=device)
        if self.pp_group is not None:
            dist.all_reduce(summed, group=self.pp_group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.pp_group)
        out = {"moe_imbalance": (summed[0] / summed[1]).item(), "moe_imbalance_worst": worst.item()}
        return {**out, "moe_aux_loss": summed[2].item()} if self.aux is not None and summed[2] else out
