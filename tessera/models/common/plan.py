"""The shared decoder's parallelism plan: which pieces each feature applies to, in which order (converters,
TP, EP, CP, AC, compile, FSDP). A family passes its block's TP plan. MoE layers run on each rank's own tokens
(under TP its sequence slice), so their experts and router are sharded by FSDP over meshes of their own
(World.moe_mesh)."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.moe import MoE
from tessera.parallel.ac import apply_ac
from tessera.parallel.compile import apply_compile
from tessera.parallel.cp import apply_cp
from tessera.parallel.ep import apply_ep
from tessera.parallel.fsdp import apply_fsdp, mixed_precision
from tessera.parallel.quantize import apply_converters
from tessera.parallel.tp import apply_tp, block_plan, enable_async_tp, root_plan

DECODER_BLOCK_TP_PLAN = block_plan(attention="attention", attn_in=("wq", "wk", "wv"), attn_out="wo",
                                   ffn="feed_forward", ffn_in=("w1", "w3"), ffn_out="w2",
                                   norms=("attention_norm", "ffn_norm"))


def parallelize_decoder(model: nn.Module, world: World, cfg: JobConfig, block_tp_plan: dict,
                        high_precision: tuple[str, ...]) -> nn.Module:
    p = cfg.parallelism
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    apply_converters(model, cfg, world.device, high_precision)
    if world.dims.tp > 1:
        tp_mesh = world.mesh["tp"]
        apply_tp(model, tp_mesh, root_plan("tok_embeddings", "norm", "output", not p.disable_loss_parallel),
                 model.layers, block_tp_plan)
        if p.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if world.dims.ep > 1:
        apply_ep([m.experts for m in moe], world.flat["ep"])
    if world.dims.cp > 1:
        apply_cp(model.layers, "attention", world.mesh["cp"])
    apply_ac(model.layers, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model.layers, fullgraph=not moe)
    dp_mesh, experts_mesh, router_mesh = world.dp_mesh(), world.moe_mesh(experts=True), world.moe_mesh(experts=False)
    inner = [(m.experts, experts_mesh) for m in moe if experts_mesh is not None]
    inner += [(part, router_mesh) for m in moe for part in (m.router, m.shared) if part and router_mesh is not None]
    if dp_mesh is not None or inner:
        param_dtype, reduce_dtype = mixed_precision(cfg.training, world.device)
        apply_fsdp(model, dp_mesh, list(model.layers.values()), param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=p.fsdp_reshard_after_forward, cpu_offload=cfg.training.enable_cpu_offload,
                   inner=tuple(inner), inner_divide=world.dims.dp * world.dims.cp)
    return model
