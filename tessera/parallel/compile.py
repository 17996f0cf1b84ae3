"""torch.compile, per transformer block and for the loss.

Each block compiles in place (`Module.compile`), so parameter names, FSDP's per-block groups and
checkpoint keys stay as they are; identical blocks share one compiled graph. Applied after TP and AC
(the compiled graph includes the recompute policy) and before FSDP (whose hooks stay outside it).
"""

from collections.abc import Callable

import torch
from torch import nn


def apply_compile(blocks: nn.ModuleDict, fullgraph: bool = True, async_tp: bool = False) -> None:
    """`fullgraph=False` for blocks with data-dependent shapes and hooks inside (MoE: token counts per expert,
    the experts' own FSDP and EP hooks): dynamo breaks the graph around those instead of refusing. `async_tp`:
    inductor splits these blocks' TP collectives into micro-pipelined matmuls (tessera.parallel.tp.enable_async_tp),
    an option of their compilation only, not of every graph the process compiles."""
    options = {"_micro_pipeline_tp": True} if async_tp else None
    for block in blocks.values():
        block.compile(fullgraph=fullgraph, options=options)


def compile_loss(loss_fn: Callable) -> Callable:
    return torch.compile(loss_fn)
