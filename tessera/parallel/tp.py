"""Tensor parallelism (Megatron-style) with sequence parallelism, as DTensor plans over modules.

A plan is `{submodule path: ParallelStyle}`; families write theirs with the helpers below. Between
blocks the residual stream stays sharded along the sequence (Shard(1)), so norms run on 1/TP of tokens.
"""

import contextlib
import dataclasses

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle


def attention_plan(attention: str, ins: tuple[str, ...], out: str, norms: tuple[str, ...], extra_inputs: int = 1,
                   local_input: bool = False) -> dict:
    """A block's norms and attention: column-wise in-projections, a row-wise out-projection back to sequence
    shards. `local_input`: the attention gets the gathered sequence as a plain tensor (modules in it that
    stay replicated, like MLA's latent path, then run on it as they are)."""
    passthrough = (None,) * extra_inputs
    plan = {n: SequenceParallel() for n in norms}
    plan[attention] = PrepareModuleInput(input_layouts=(Shard(1), *passthrough),
                                         desired_input_layouts=(Replicate(), *passthrough),
                                         use_local_output=local_input)
    plan.update({f"{attention}.{name}": ColwiseParallel() for name in ins})
    plan[f"{attention}.{out}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def ffn_plan(ffn: str, ins: tuple[str, ...], out: str) -> dict:
    """A dense FFN on the gathered sequence: column-wise in, row-wise out to sequence shards."""
    plan = {ffn: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    plan.update({f"{ffn}.{name}": ColwiseParallel() for name in ins})
    plan[f"{ffn}.{out}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


class Replicated(ParallelStyle):
    """A module kept whole on every TP rank, run on plain tensors: its weights become replicated DTensors (so
    FSDP, clipping and checkpoints see them like any TP weight) and its input and output stay local. Its
    output's gradient must be whole on each rank; `sum_grad_columns`: the output's last columns feed only this
    rank's heads, so their gradient is summed over TP in backward (MLA's rope key, one head shared by all; the
    rest of its output reaches column-wise modules, whose input gradients TP already sums)."""

    def __init__(self, sum_grad_columns: int = 0):
        self.sum_grad_columns = sum_grad_columns

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, columns = device_mesh.get_group().group_name, self.sum_grad_columns

        def inputs(_, args, mesh):
            return tuple(a if a is None else DTensor.from_local(a, mesh, (Replicate(),), run_check=False)
                         for a in args)

        def output(_, out, __):
            if not isinstance(out, DTensor):  # several outputs, a record of them (an indexer's Scoring), each local
                return _to_local(out)
            return _SumTail.apply(out.to_local(), columns, group) if columns else out.to_local()

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=output)


def _to_local(out):
    """`out` with each DTensor in it (in a tuple, or a dataclass's field) its local tensor."""
    if isinstance(out, DTensor):
        return out.to_local()
    if isinstance(out, tuple):
        return tuple(_to_local(o) for o in out)
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(out, **{f.name: _to_local(getattr(out, f.name)) for f in dataclasses.fields(out)
                                           if isinstance(getattr(out, f.name), DTensor)})
    return out


class SummedOverRanks(ParallelStyle):
    """A module whose output, a sum over the heads a rank holds, is summed over the TP ranks (all heads'): forward
    only, for a target no gradient flows through (DSA's indexer target, tessera.models.common.sparse.HeadSum)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def output(_, out, __):
            out = out.detach()
            torch.distributed.all_reduce(out, group=group)
            return out

        return distribute_module(module, device_mesh, output_fn=output)


class ShardedByHead(ParallelStyle):
    """A module whose parameters are one value per attention head (GPT-OSS's sinks): each rank keeps its
    heads' (Shard(0)); the module takes their local part."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, shard)


class _SumTail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, columns: int, group: str) -> torch.Tensor:
        ctx.columns, ctx.group = columns, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        head, tail = grad.split([grad.shape[-1] - ctx.columns, ctx.columns], dim=-1)
        tail = funcol.all_reduce(tail.contiguous(), "sum", ctx.group)
        return torch.cat([head, funcol.wait_tensor(tail)], dim=-1), None, None


def local_tokens(module: str) -> dict:
    """A module that runs on each rank's own sequence slice (a MoE layer: tokens are routed one by one)."""
    return {module: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True)}


def root_plan(embedding: str, norm: str, output: str, loss_parallel: bool) -> dict:
    """Vocab-sharded embedding and output; with loss parallel the logits stay sharded over the vocab."""
    return {
        embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        norm: SequenceParallel(),
        output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel),
    }


def apply_tp(model: nn.Module, mesh: DeviceMesh, root: dict, blocks: list[tuple[nn.Module, dict]]) -> None:
    """`root`'s plan on the model, then each block's own (a block with experts gets another FFN plan). A pipeline
    stage lacks some of the root's modules: their entries are left out (torch warns of each, the model printed)."""
    present = dict(model.named_modules())
    parallelize_module(model, mesh, {name: style for name, style in root.items() if name in present})
    for name, module in present.items():
        style = root.get(name)
        if isinstance(style, RowwiseParallel) and style.use_local_output:
            module.register_forward_hook(_settle)
    for module, plan in blocks:
        parallelize_module(module, mesh, plan)


def place_adapters(model: nn.Module, mesh: DeviceMesh) -> None:
    """LoRA's adapters (tessera.lora) beside the linears TP split, on the meta device: a column-wise weight (its rows
    split) splits B's rows and repeats A, a row-wise one (its columns split) splits A's columns and repeats B; so
    each rank's update is its share of B A x, as its weight's output is (ColwiseParallel split every parameter of its
    linear by rows, RowwiseParallel left them whole)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "lora_a", None) is None or not isinstance(weight, DTensor):
            continue
        a, b = (Replicate(), Shard(0)) if weight.placements[0] == Shard(0) else (Shard(1), Replicate())
        for name, placement in (("lora_a", a), ("lora_b", b)):
            p = getattr(module, name)
            full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [placement])))


def _settle(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """A row-wise module's local output is still an AsyncCollectiveTensor (its reduce-scatter in flight). A
    compiled block that takes one as input loses its gradient's DTensor wrapping in backward (torch 2.13:
    "'Tensor' object has no attribute '_local_tensor'"); a clone waits for it and is a plain tensor."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def enable_async_tp(mesh: DeviceMesh) -> None:
    """Symmetric memory for the TP group, so that inductor can split its collectives into micro-pipelined matmuls
    (CUDA only); the blocks ask for the split as they are compiled (tessera.parallel.compile.apply_compile)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.get_group().group_name)


def loss_context(enabled: bool):
    """Cross-entropy over vocab-sharded logits without gathering them."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
