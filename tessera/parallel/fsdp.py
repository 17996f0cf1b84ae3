"""FSDP2 / HSDP: shard each block, then the root, over the data-parallel mesh axes."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tessera.dtypes import DTYPES


def mixed_precision(training, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype of parameters, gradient-reduction dtype); "auto" = bf16 on accelerators, fp32 on CPU
    (where bf16 matmuls are slower than fp32 without AVX-512/AMX)."""
    name = training.mixed_precision_param
    if name == "auto":
        name = "float32" if device.type == "cpu" else "bfloat16"
    return DTYPES[name], DTYPES[training.mixed_precision_reduce]


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
