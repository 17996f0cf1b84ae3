"""Expert parallelism: each MoE layer's routed experts split over the EP group (contiguous blocks of experts
per rank, a DTensor sharded along the expert dimension, so checkpoints reshard across EP degrees). Tokens,
sorted by expert, travel to the rank holding their expert and back with `all_to_all_single` (uneven splits;
the per-expert counts are exchanged first). Rows arrive grouped by source rank and are regrouped by local
expert with a stable sort, so runs reproduce bit for bit."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor


def apply_ep(experts: list[nn.Module], mesh: DeviceMesh) -> None:
    """`experts`: modules whose parameters are stacked [E, ...] and whose forward takes (tokens sorted by
    expert, tokens per expert [E]) and returns one row per token in the same order."""
    for module in experts:
        distribute_module(module, mesh, _shard_experts, input_fn=_dispatch, output_fn=_combine)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, counts = inputs
    ep, group = mesh.size(), mesh.get_group()
    received = torch.empty_like(counts)  # [source rank, local expert]: the tokens each rank sends each of mine
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)
    send, recv = counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()
    rows = all_to_all_single_autograd(tokens, recv, send, group)
    local_expert = torch.arange(received.shape[1], device=counts.device).repeat(ep)
    order = local_expert.repeat_interleave(received.flatten()).argsort(stable=True)
    module._ep_route = (order, send, recv)
    return rows[order], received.sum(0)


def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    order, send, recv = module._ep_route
    back = torch.empty_like(out).index_copy(0, order, out)  # undo the regrouping: rows by source rank again
    return all_to_all_single_autograd(back, send, recv, mesh.get_group())
