"""State dicts of plain tensors, whatever wraps the model's weights in training.

Float8 with FSDP float8 all-gathers keeps each converted weight in torchao's WeightWithDynamicFloat8CastTensor,
MX in its MXFP8TrainingWeightWrapperTensor (under FSDP, as a DTensor's local tensor). Saved as they are, DCP
pickles the wrapper class into the checkpoint, so every reader without that class allowlisted (a run without the
converter, generate, convert, torch's dcp_to_torch_save) fails to unpickle it. These wrappers hold the weight
itself as their first inner tensor; checkpoints get that tensor instead (a DTensor is rebuilt around it with the
same mesh and placements). It shares the weight's storage, so DCP loading in place still fills the model.

The training state (step, scheduler, data position, RNG) is one torch.save'd blob, kept as a uint8 tensor: DCP
pickles a BytesIO value as a BytesIO object, which torch.load's default (weights_only) refuses in the file
dcp_to_torch_save makes of a checkpoint.
"""

import io

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only


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


def plain_state(state):
    """Every tensor of a (nested) state dict through plain_tensor."""
    with torch.no_grad():
        return tree_map_only(torch.Tensor, plain_tensor, state)


def model_state(model: torch.nn.Module) -> dict:
    """get_model_state_dict, holding plain tensors."""
    return plain_state(get_model_state_dict(model))


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """get_optimizer_state_dict, holding plain tensors."""
    return plain_state(get_optimizer_state_dict(model, optimizer))


def train_blob(train: dict) -> torch.Tensor:
    """The training state, torch.save'd, as a uint8 tensor."""
    blob = io.BytesIO()
    torch.save(train, blob)
    return torch.frombuffer(bytearray(blob.getbuffer()), dtype=torch.uint8)


def train_target(path: str) -> torch.Tensor | io.BytesIO:
    """What DCP loads the checkpoint's training state into: a tensor of its size, or (checkpoints from before
    the blob was a tensor) a BytesIO."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata.get("train")
    return torch.empty(tuple(saved.size), dtype=torch.uint8) if isinstance(saved, TensorStorageMetadata) \
        else io.BytesIO()


def read_train(loaded: torch.Tensor | io.BytesIO) -> dict:
    """The training state dict of what train_target received."""
    blob = io.BytesIO(loaded.numpy().tobytes()) if torch.is_tensor(loaded) else loaded
    blob.seek(0)
    return torch.load(blob, weights_only=False)  # our own checkpoint: scheduler and data state are plain objects


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
