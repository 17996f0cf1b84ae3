"""Materialize a meta-device model after sharding, identically for every layout.

Each parameter's full tensor is generated from a generator seeded by (seed, parameter name), then each
rank keeps its own shard. So any layout - 1 process, FSDP, TP, a pipeline stage holding some layers -
starts from the same weights, and no rank holds more than one full parameter at a time. Names are read
as the bare model spells them: wrappers (activation checkpointing, torch.compile) do not change them.
"""

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Path segments that wrappers insert: checkpoint_wrapper's and torch.compile's (OptimizedModule).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def bare_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, param_device: torch.device | None = None,
                init: Callable | None = None) -> None:
    """`param_device`: where parameters live when not on `device` (CPU under FSDP CPU offload); `init`: (name,
    full tensor, generator) filling it, by default the model's param_init.

    Values are generated on `device` either way, so offloading does not change them.
    """
    init = init or model.param_init
    model.to_empty(device=param_device or device)
    model.init_buffers(device)
    for name, param in model.named_parameters():
        name = bare_name(name)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        init(name, full, gen)
        if isinstance(param, DTensor):
            # Every rank generated the same full tensor, so each slices locally: no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
