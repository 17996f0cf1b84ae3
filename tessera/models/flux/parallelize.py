"""Flux's parallelism plan: CP, AC, compile and FSDP over both block stacks (no TP, no PP: checked at launch)."""

from torch import nn

from tessera.distributed import World
from tessera.models.flux.options import FluxConfig
from tessera.parallel.ac import apply_ac
from tessera.parallel.compile import apply_compile
from tessera.parallel.cp import apply_cp
from tessera.parallel.fsdp import apply_fsdp, mixed_precision

STACKS = ("transformer_blocks", "single_transformer_blocks")


def parallelize(model: nn.Module, world: World, cfg: FluxConfig) -> nn.Module:
    stacks = [getattr(model, name) for name in STACKS]
    for stack in stacks:
        if world.dims.cp > 1:  # bidirectional: every rank's queries see every token's keys
            apply_cp(stack, "attn", world.mesh["cp"], cfg.parallelism.context_parallel_method)
        apply_ac(stack, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
        if cfg.compile.enable and "model" in cfg.compile.components:
            apply_compile(stack)
    dp_mesh = world.dp_mesh()
    if dp_mesh is not None:
        param_dtype, reduce_dtype = mixed_precision(cfg.training, world.device)
        apply_fsdp(model, dp_mesh, [b for stack in stacks for b in stack.values()], param_dtype=param_dtype,
                   reduce_dtype=reduce_dtype, reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                   cpu_offload=cfg.training.enable_cpu_offload)
    return model
