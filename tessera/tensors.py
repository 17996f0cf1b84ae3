"""The plain tensor inside what wraps a weight in training, for whatever keeps or reads the weight itself (the
checkpointer, Muon's shards, the semi-synchronous outer step).

Float8 with FSDP float8 all-gathers keeps each converted weight in torchao's WeightWithDynamicFloat8CastTensor,
MX in its MXFP8TrainingWeightWrapperTensor (under FSDP, as a DTensor's local tensor). These wrappers hold the weight
itself as their first inner tensor; plain_tensor returns that tensor (a DTensor is rebuilt around it with the same
mesh and placements), sharing the weight's storage.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` as a torch.Tensor (or a DTensor of one) sharing its storage: a wrapper subclass's inner weight."""
    if isinstance(value, DTensor):
        local = plain_tensor(value._local_tensor)
        if local is value._local_tensor:
            return value
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    while type(value) is not torch.Tensor and is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        inner = getattr(value, names[0])
        if inner.shape != value.shape or inner.dtype != value.dtype:  # a quantized tensor, not a wrapper
            raise TypeError(f"cannot checkpoint a {type(value).__qualname__} as a plain tensor: its inner "
                            f"'{names[0]}' is {inner.dtype} {list(inner.shape)}, the tensor {value.dtype} "
                            f"{list(value.shape)}")
        value = inner
    return value


def local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of `value` (a DTensor's local shard) as a plain tensor, sharing its storage."""
    value = plain_tensor(value)
    return value.to_local() if isinstance(value, DTensor) else value


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's part) as a tensor laid out like `param` (a DTensor around it when `param` is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return value
