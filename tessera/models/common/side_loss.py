"""Training losses a model computes on its own, beside the one on its logits (DeepSeek V3's multi-token
prediction): the gradient of each starts in backward from the tensor it is attached to, so the loss needs no
labels of its own and leaves the reported loss as it is; its value is kept for metrics."""

import torch
from torch import nn


class AddLossGrad(torch.autograd.Function):
    """Identity on `out` whose backward also starts `loss`'s backward (loss already weighted)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_ones(ctx.loss_shape)


class SideLoss(nn.Module):
    """`metric`: its name in metrics (the family names it, in Family.metrics); `weight_option`: the option that
    weights it, SECTION.KEY (its family's own: deepseek_v3.mtp_loss_weight; 0: the model skips it). The trainer
    sets `weight` and `share` (a micro-batch's part of the step's mean)."""

    def __init__(self, metric: str, weight_option: str):
        super().__init__()
        self.metric, self.weight_option = metric, weight_option
        self.weight, self.share = 0.0, 1.0
        self.values: list[torch.Tensor] = []  # its unweighted values since the last reset (summed when read: an
        # add here would run once more when activation checkpointing recomputes a block, which selective AC refuses)

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def total(self) -> torch.Tensor | None:
        return torch.stack(self.values).sum() if self.values else None

    def attach(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        self.values.append(loss.detach())
        return AddLossGrad.apply(out, loss * (self.weight * self.share))

    def reset(self) -> None:
        self.values = []


class Lookahead(nn.Module):
    """What a side loss reads of the tokens after each position (multi-token prediction's inputs and targets),
    of sequences [..., seq] along their last dim. Data and context parallelism swap it for one that counts trained
    labels over their ranks and reads across CP's chunks (tessera.parallel.cp.SplitLookahead): a model sees only
    its own."""

    @staticmethod
    def shift(x: torch.Tensor, k: int, fill: int | None = None, end: int = 0) -> torch.Tensor:
        """Slot i holds x[..., i + k] where i + k < seq - end, else `fill` (None: x's last value)."""
        n = x.shape[-1]
        keep = max(n - k - end, 0)
        pad = x[..., -1:] if fill is None else torch.full_like(x[..., :1], fill)
        return torch.cat([x[..., k:k + keep], pad.expand(*x.shape[:-1], n - keep)], dim=-1)

    def ahead(self, x: torch.Tensor, k: int, fill: int | None = None, end: int = 0) -> torch.Tensor:
        """The whole sequence's `shift`, as this rank holds it."""
        return self.shift(x, k, fill, end)

    @staticmethod
    def count(labels: torch.Tensor, ignore: int = -100) -> torch.Tensor:
        return (labels != ignore).sum()

    def trained(self, labels: torch.Tensor) -> torch.Tensor:
        """The divisor of a rank's summed loss over `labels` that makes it (averaged over the ranks that hold
        parts of the micro-batch, as gradients are) the whole micro-batch's mean: its trained labels (at least 1);
        a layout's lookahead counts them over those ranks."""
        return self.count(labels).clamp(min=1)
