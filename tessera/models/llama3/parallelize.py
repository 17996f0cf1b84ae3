"""Llama 3's parallelism plan: which pieces each parallelism applies to, in which order."""

import torch
from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.parallel.fsdp import apply_fsdp

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    name = cfg.training.mixed_precision_param
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    dp_mesh = world.dp_mesh()
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh, list(model.layers.values()),
                   param_dtype=param_dtype(cfg, world.device),
                   reduce_dtype=_DTYPES[cfg.training.mixed_precision_reduce],
                   reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                   cpu_offload=cfg.training.enable_cpu_offload)
    return model
