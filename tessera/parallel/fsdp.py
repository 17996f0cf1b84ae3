"""FSDP2 / HSDP: shard each block, then the root, over the data-parallel mesh axes."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module], *, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str = "default", cpu_offload: bool = False) -> None:
    """`mesh` is 1D (FSDP) or 2D (replicate, shard) for HSDP.

    The root group (embeddings, final norm, output) is not resharded by default: backward needs it
    first, so keeping it gathered saves one all-gather per step.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory needs an accelerator to pin for.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward != "never")
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload,
                reshard_after_forward=reshard_after_forward == "always")
