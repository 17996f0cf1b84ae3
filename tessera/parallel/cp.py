"""Context parallelism on plain collectives, so it runs on gloo (CPU) and NCCL alike.

Each CP rank holds two of 2·CP equal chunks of every sequence: chunk r and chunk 2·CP−1−r. Under causal
attention late chunks attend to more keys than early ones, so pairing them balances the work. Attention
all-gathers K and V over the CP group and each local query chunk attends to the keys at or before it;
autograd carries the gradients of K and V back to their owners. The kernel is the replaced one's: on CUDA
FlexAttention keeps no scores; elsewhere they take (S/CP)·S memory per rank.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp)], dim=dim)


def _in_order(parts, cp: int, dim: int) -> torch.Tensor:
    """Each rank's two chunks (`parts[rank]`, 2L long along `dim`) -> the whole sequence along `dim`."""
    ordered = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        head, tail = chunk_ids(rank, cp)
        ordered[head], ordered[tail] = part.chunk(2, dim=dim)
    return torch.cat(ordered, dim=dim)


class _AllGather(torch.autograd.Function):
    """[...] on each rank -> [ranks, ...]; backward sums each rank's gradient for every piece back to its owner.
    (torch.distributed.nn's version mis-addresses sub-groups on gloo.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group), *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)  # gloo lacks all_gather_into_tensor
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":  # no reduce-scatter there: exchange, then sum
            pieces = torch.empty_like(grad)
            dist.all_to_all_single(pieces, grad, group=ctx.group)
            return pieces.sum(0), None
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class ContextParallelAttention(nn.Module):
    """This rank's query chunks against the whole sequence's keys and values, with the mask (causal, narrowed
    by a window or chunks) and the sinks of the kernel it replaces (the same parameter, under the same name),
    computed by that kernel's own `attend` function (queries at the last positions of the keys it is given)."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, kernel: nn.Module):
        super().__init__()
        self.group, self.cp_rank, self.cp = group, cp_rank, cp
        self.scale, self.window, self.chunk = (getattr(kernel, a, None) for a in ("scale", "window", "chunk"))
        self.sinks = getattr(kernel, "sinks", None)
        self.attend = type(kernel).attend

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """[b, h, 2L, d] on each rank -> [b, h, 2·CP·L, d] in global order."""
        return _in_order(_AllGather.apply(x, self.group), self.cp, dim=2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` [batch, 2L]: the document numbers of this rank's tokens (numbered over the whole sequence);
        the keys' are gathered here."""
        keys, values = self._whole(k), self._whole(v)
        docs = None if documents is None else self._documents(documents)
        size = q.shape[2] // 2
        out = []
        for half, chunk in enumerate(chunk_ids(self.cp_rank, self.cp)):
            end = (chunk + 1) * size  # keys after the chunk's last query are all masked: skip them
            out.append(self.attend(q[:, :, half * size:(half + 1) * size], keys[:, :, :end], values[:, :, :end],
                                   self.window, self.chunk, self.scale, self.sinks,
                                   None if docs is None else docs[:, :end]))
        return torch.cat(out, dim=2)

    @torch.compiler.disable
    def _documents(self, local: torch.Tensor) -> torch.Tensor:
        """The whole sequence's document numbers [batch, 2·CP·L], gathered in global order. Every layer of a
        forward asks with the same tensor: gathered once."""
        if _gathered[0] is not local:
            parts = [torch.empty_like(local) for _ in range(self.cp)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            _gathered[:] = [local, _in_order(parts, self.cp, dim=1)]
        return _gathered[1]


_gathered: list = [None, None]  # (local document numbers, the whole sequence's) of the last forward


class BidirectionalContextParallelAttention(nn.Module):
    """For a kernel with `bidirectional = True` (no mask: a diffusion transformer's joint attention): this rank's
    queries against every rank's keys and values. Without a mask the keys' order is moot, so they are taken as
    gathered; the kernel's own `attend(q, k, v)` computes it."""

    def __init__(self, group: dist.ProcessGroup, kernel: nn.Module):
        super().__init__()
        self.group, self.attend = group, type(kernel).attend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = (_AllGather.apply(x, self.group).permute(1, 2, 0, 3, 4).flatten(2, 3) for x in (k, v))
        return self.attend(q, keys, values)


def apply_cp(blocks: dict[str, nn.Module], attention: str, cp_mesh: DeviceMesh) -> None:
    """Swap each block's attention kernel (`<attention>.sdpa`) for the context-parallel one."""
    for block in blocks.values():
        module = getattr(block, attention)
        if getattr(module.sdpa, "bidirectional", False):
            module.sdpa = BidirectionalContextParallelAttention(cp_mesh.get_group(), module.sdpa)
            continue
        module.sdpa = ContextParallelAttention(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(),
                                               module.sdpa)
