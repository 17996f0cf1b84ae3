"""torch.compile, per transformer block and for the loss.

Each block compiles in place (`Module.compile`), so parameter names, FSDP's per-block groups and
checkpoint keys stay as they are; identical blocks share one compiled graph. Applied after TP and AC
(the compiled graph includes the recompute policy) and before FSDP (whose hooks stay outside it).
"""

from collections.abc import Callable

import torch
from torch import nn


def apply_compile(blocks: nn.ModuleDict) -> None:
    for block in blocks.values():
        block.compile(fullgraph=True)


def compile_loss(loss_fn: Callable) -> Callable:
    return torch.compile(loss_fn)
