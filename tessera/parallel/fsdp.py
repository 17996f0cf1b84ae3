"""FSDP2 / HSDP: shard each block, then the root, over the data-parallel mesh axes."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from tessera.dtypes import DTYPES


def mixed_precision(training, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype of parameters, gradient-reduction dtype); "auto" = bf16 on accelerators, fp32 on CPU
    (where bf16 matmuls are slower than fp32 without AVX-512/AMX)."""
    name = training.mixed_precision_param
    if name == "auto":
        name = "float32" if device.type == "cpu" else "bfloat16"
    return DTYPES[name], DTYPES[training.mixed_precision_reduce]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh | None, blocks: list[nn.Module], *, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, reshard_after_forward: str = "default", cpu_offload: bool = False,
               inner: tuple[tuple[nn.Module, DeviceMesh], ...] = (), inner_divide: float = 1.0,
               idle: tuple[nn.Module, ...] = (), by_rows: frozenset[nn.Parameter] = frozenset()) -> None:
    """`mesh` is 1D (FSDP) or 2D (replicate, shard) for HSDP; None: only the `inner` groups are sharded.

    `inner`: submodules sharded first, over meshes of their own (a MoE layer's experts and router), whose
    gradients are summed over their mesh and divided by `inner_divide`, the number of ranks that see
    different data (their mesh may hold ranks that see the same, or miss some that do not).

    `idle`: modules kept (checkpointed, exported) but never run, such as an untrained MTP depth. Their groups
    get no casting policy: between micro-batches torch 2.13's post-backward reads the gathered copy of every
    group that keeps its gradients in another dtype, and a group that never ran was never gathered.

    `by_rows`: parameters sharded along their dim 1 instead of 0 (stacked experts [E, rows, columns] whose
    experts do not divide by the group: split by rows, no rank holds padding).

    The root group (embeddings, final norm, output) is not resharded by default: backward needs it
    first, so keeping it gathered saves one all-gather per step.
    """
    cast = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    unused = {m for unit in idle for m in unit.modules()}
    # Pinned host memory needs an accelerator to pin for.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()

    def shard(module: nn.Module, on: DeviceMesh, reshard: bool) -> None:
        fully_shard(module, mesh=on, mp_policy=MixedPrecisionPolicy() if module in unused else cast,
                    offload_policy=offload, reshard_after_forward=reshard,
                    shard_placement_fn=(lambda p: Shard(1) if p in by_rows else None) if by_rows else None)

    for module, inner_mesh in inner:
        shard(module, inner_mesh, reshard_after_forward != "never")
        module.set_gradient_divide_factor(inner_divide)
        # A sum, then the division: gloo has no pre-scaled sum. Not on a shard axis of 1 rank, where torch 2.13
        # would divide twice (once copying the unreduced gradient, once after the sum).
        module.set_force_sum_reduction_for_comms(inner_mesh.size(-1) > 1)
    if mesh is None:
        return
    for block in blocks:
        shard(block, mesh, reshard_after_forward != "never")
    shard(model, mesh, reshard_after_forward == "always")
