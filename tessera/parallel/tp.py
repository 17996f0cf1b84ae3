"""Tensor parallelism (Megatron-style) with sequence parallelism, as DTensor plans over modules.

A plan is `{submodule path: ParallelStyle}`; families write theirs with the helpers below. Between
blocks the residual stream stays sharded along the sequence (Shard(1)), so norms run on 1/TP of tokens.
"""

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def block_plan(attention: str, attn_in: tuple[str, ...], attn_out: str, ffn: str, ffn_in: tuple[str, ...],
               ffn_out: str, norms: tuple[str, ...], extra_inputs: int = 1) -> dict:
    """One transformer block: column-wise in-projections, row-wise out-projections back to sequence shards."""
    plan = {n: SequenceParallel() for n in norms}
    for module, ins, out in ((attention, attn_in, attn_out), (ffn, ffn_in, ffn_out)):
        passthrough = (None,) * (extra_inputs if module == attention else 0)
        plan[module] = PrepareModuleInput(input_layouts=(Shard(1), *passthrough),
                                          desired_input_layouts=(Replicate(), *passthrough))
        plan.update({f"{module}.{name}": ColwiseParallel() for name in ins})
        plan[f"{module}.{out}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


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


def apply_tp(model: nn.Module, mesh: DeviceMesh, root: dict, blocks: dict[str, nn.Module], block: dict) -> None:
    parallelize_module(model, mesh, root)
    for name, module in model.named_modules():  # a pipeline stage lacks some of the root's modules
        style = root.get(name)
        if isinstance(style, RowwiseParallel) and style.use_local_output:
            module.register_forward_hook(_settle)
    for module in blocks.values():
        parallelize_module(module, mesh, block)


def _settle(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """A row-wise module's local output is still an AsyncCollectiveTensor (its reduce-scatter in flight). A
    compiled block that takes one as input loses its gradient's DTensor wrapping in backward (torch 2.13:
    "'Tensor' object has no attribute '_local_tensor'"); a clone waits for it and is a plain tensor."""
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def enable_async_tp(mesh: DeviceMesh) -> None:
    """Let inductor split TP collectives into micro-pipelined matmuls over symmetric memory (CUDA only)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh.get_group().group_name)


def loss_context(enabled: bool):
    """Cross-entropy over vocab-sharded logits without gathering them."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
