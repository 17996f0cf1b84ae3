"""Materialize a meta-device model after sharding, identically for every layout.

Each parameter's full tensor is generated from a generator seeded by (seed, parameter name), then each
rank keeps its own shard. So any layout - 1 process, FSDP, TP, a pipeline stage holding some layers -
starts from the same weights, and no rank holds more than one full parameter at a time.
"""

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    model.init_buffers(device)
    for name, param in model.named_parameters():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        model.param_init(name, full, gen)
        if isinstance(param, DTensor):
            # Every rank generated the same full tensor, so each slices locally: no communication.
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
