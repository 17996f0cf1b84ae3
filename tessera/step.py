"""One micro-batch's forward and backward, the same code for a training step, an evaluation and tessera.estimate's
trace: the parts it runs (StepParts, which tessera.trainer.build_step builds for both) and forward_backward."""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.models.common.side_loss import SideLoss
from tessera.parallel.tp import local, loss_context


@dataclass
class Pipeline:
    schedule: object
    first: bool  # this rank runs the first stage (feeds inputs)
    last: bool  # this rank runs the last stage (computes the loss)
    group: torch.distributed.ProcessGroup
    parts: list[nn.Module]  # this rank's stages' modules
    stages: list  # their torch PipelineStages


@dataclass
class LossScale:
    """What each micro-batch's loss is multiplied by, set before the step (or evaluation) that uses it: for the
    token cross-entropy, a sum over trained tokens, the ranks that see different data over the step's trained
    tokens in the whole global batch (gradients are averaged over those ranks: the step's loss is the mean over its
    trained tokens); for a family's own (mean) loss, 1 / its micro-batches per step."""
    value: torch.Tensor | float = 1.0


@dataclass(frozen=True, kw_only=True)
class StepParts:
    """What a step runs, fixed once the model is built."""
    model: nn.Module  # under pipelining: a view over this rank's stages with the whole model's names
    pipeline: Pipeline | None
    loss_fn: Callable  # the family's loss (default: the summed token cross-entropy), compiled when
    # compile.components holds "loss"; model_loss when the model computes it (labels_in_forward)
    loss_scale: LossScale  # what loss_fn's value is multiplied by (the pipeline schedule's loss reads it too)
    labels_in_forward: bool  # the model takes the labels and returns its loss (training.loss_chunks)
    loss_parallel: bool  # the logits are vocab-sharded (TP): the loss is computed on the shards
    side_losses: tuple[SideLoss, ...]  # losses the model computes itself (multi-token prediction), for metrics
    autocast: contextlib.AbstractContextManager  # bf16 compute without FSDP (which casts parameters itself)
    grad_accum: int  # forward-backwards of a local batch per optimizer step (gradient accumulation)
    micro_batches: int  # forward passes per optimizer step (under PP each local batch is cut into micro-batches):
    # each one's share of the step's mean loss is 1 / this (tessera.run_plan.Batch)
    device: torch.device


def forward_backward(step: StepParts, inputs: dict, labels: torch.Tensor, train: bool = True) -> torch.Tensor:
    """Loss of one micro-batch times step.loss_scale, with its backward when training; `inputs`: the model's by keyword.
    Under pipelining the schedule runs both (the first stage takes the tokens, every stage the rest); only the last
    stage sees the loss (others return 0)."""
    pipe = step.pipeline
    if step.labels_in_forward:
        inputs = {**inputs, "labels": labels}
    with loss_context(step.loss_parallel):
        if pipe is None:
            with step.autocast:
                loss = step.loss_fn(step.model(**inputs), labels) * step.loss_scale.value
            if train:
                loss.backward()
            return local(loss.detach())
        losses = [] if pipe.last else None
        run = pipe.schedule.step if train else pipe.schedule.eval
        rest = {k: v for k, v in inputs.items() if k != "tokens"}
        # Outputs not kept: the last stage would hold every micro-batch's logits to the end of the step.
        with step.autocast:  # bf16 without FSDP, on every stage as without PP
            run(*([inputs["tokens"]] if pipe.first else []), target=labels if pipe.last else None, losses=losses,
                return_outputs=False, **rest)
    if not losses:
        return torch.zeros((), device=step.device)
    return local(torch.stack([local(x) for x in losses]).sum().detach())


@torch.no_grad()
def pipeline_outputs(step: StepParts, tokens: torch.Tensor) -> torch.Tensor | None:
    """The model's outputs (logits) of a local batch of `tokens` [local batch, seq_len], the training's shape (the
    stages' buffers have it), run forward through the schedule: on the last stage, whole (gathered under loss
    parallelism); None on the others. The schedule's loss of them is computed (on zero labels) and dropped."""
    pipe = step.pipeline
    with loss_context(step.loss_parallel), step.autocast:
        out = pipe.schedule.eval(*([tokens] if pipe.first else []), target=torch.zeros_like(tokens) if pipe.last
                                 else None, return_outputs=pipe.last)
    for stage in pipe.stages:  # what the schedule kept of this batch (its outputs, activations) goes now
        stage.clear_runtime_states()
    if not pipe.last:
        return None
    return out.full_tensor() if isinstance(out, DTensor) else out  # vocab-sharded under loss parallel
