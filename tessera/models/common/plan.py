"""The shared decoder's parallelism plan: which pieces each feature applies to, in which order (converters,
TP, EP, CP, AC, compile, FSDP). A family passes its blocks' TP plan for norms and attention; the FFN's is
the shared one (column/row-wise for a dense SwiGLU). MoE layers run on each rank's own tokens
(under TP its sequence slice), so their experts and router are sharded by FSDP over meshes of their own
(World.moe_mesh)."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.lora import apply_lora, freeze_base
from tessera.models.common.moe import MoE
from tessera.parallel.ac import apply_ac
from tessera.parallel.compile import apply_compile
from tessera.parallel.cp import apply_cp
from tessera.parallel.ep import apply_ep
from tessera.parallel.fsdp import apply_fsdp, mixed_precision
from tessera.parallel.quantize import apply_converters
from tessera.parallel.tp import (
    apply_tp,
    attention_plan,
    enable_async_tp,
    ffn_plan,
    local_tokens,
    place_adapters,
    root_plan,
)

NORMS = ("attention_norm", "ffn_norm")
DECODER_BLOCK_TP_PLAN = attention_plan("attention", ("wq", "wk", "wv"), "wo", NORMS)
# Per-head q/k norms (Qwen 3's): under TP each rank holds some heads, and the norms (over head_dim) run on them as
# a sequence-parallel style over the heads dimension, so their weights' gradients are summed over TP ranks.
QK_NORM_BLOCK_TP_PLAN = {**DECODER_BLOCK_TP_PLAN, **{f"attention.{n}": SequenceParallel(sequence_dim=2,
                                                                                        use_local_output=True)
                                                     for n in ("q_norm", "k_norm")}}
_FFN_TP_PLAN = {False: ffn_plan("feed_forward", ("w1", "w3"), "w2"), True: local_tokens("feed_forward")}


def parallelize_decoder(model: nn.Module, world: World, cfg: JobConfig, block_tp_plan,
                        high_precision: tuple[str, ...], more_units: tuple[nn.Module, ...] = (),
                        idle: bool = False, more_blocks: dict[str, nn.Module] | None = None,
                        more_tp: tuple[tuple[nn.Module, dict], ...] = ()) -> nn.Module:
    """`block_tp_plan`: the blocks' TP plan, or (block) -> its plan (a hybrid's blocks differ); its entries win over
    the shared FFN plan's (DeepSeek V4's hash-routed MoE takes its token ids too); `more_units`:
    modules beside the blocks that FSDP gathers one at a time (DeepSeek's MTP depths);
    `idle`: they are kept but never run (not trained in this layout); `more_blocks`: blocks inside them that TP
    and CP split like the model's (a depth's block); `more_tp`: (module, its TP plan) of the rest of them."""
    p = cfg.parallelism
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    apply_converters(model, cfg, world.device, high_precision)
    apply_lora(model, cfg.lora)  # after the converters, which swap the linears
    if world.dims.tp > 1:
        tp_mesh = world.mesh["tp"]
        plan_of = block_tp_plan if callable(block_tp_plan) else lambda _: block_tp_plan  # per block (hybrids)
        blocks = [(b, {**_FFN_TP_PLAN[isinstance(b.feed_forward, MoE)], **plan_of(b)})
                  for b in (*model.layers.values(), *(more_blocks or {}).values())]
        apply_tp(model, tp_mesh, root_plan("tok_embeddings", "norm", "output", not p.disable_loss_parallel),
                 [*blocks, *more_tp])
        place_adapters(model, tp_mesh)
        if p.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if world.dims.ep > 1:
        apply_ep([m.experts for m in moe], world.flat["ep"])
    if world.dims.cp > 1:
        for blocks in (model.layers, more_blocks or {}):
            apply_cp(blocks, "attention", world.mesh["cp"], p.context_parallel_method)
    apply_ac(model.layers, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model.layers, fullgraph=not moe,
                      async_tp=world.dims.tp > 1 and p.enable_async_tensor_parallel)
    dp_mesh, experts_mesh, router_mesh = world.dp_mesh(), world.moe_mesh(experts=True), world.moe_mesh(experts=False)
    inner = [(m.experts, experts_mesh) for m in moe if experts_mesh is not None]
    inner += [(part, router_mesh) for m in moe for part in (m.router, m.shared) if part and router_mesh is not None]
    if dp_mesh is not None or inner:
        shard_mesh = experts_mesh if experts_mesh is not None else dp_mesh
        by_rows = experts_by_rows([m.experts for m in moe], shard_mesh.size(-1) if shard_mesh is not None else 1,
                                  world.dims.ep, p.expert_fsdp_shard)
        param_dtype, reduce_dtype = mixed_precision(cfg.training, world.device)
        apply_fsdp(model, dp_mesh, [*model.layers.values(), *more_units], param_dtype=param_dtype,
                   reduce_dtype=reduce_dtype, reshard_after_forward=p.fsdp_reshard_after_forward,
                   cpu_offload=cfg.training.enable_cpu_offload, inner=tuple(inner),
                   inner_divide=world.dims.dp * world.dims.cp, idle=more_units if idle else (), by_rows=by_rows)
    if cfg.lora.rank:
        freeze_base(model)  # last: TP's plans made new parameters, which train
    return model


def decoder_plan(block_tp_plan: dict, high_precision: tuple[str, ...]):
    """A family's `parallelize` (model, world, cfg) -> model: the shared decoder's plan with its blocks' TP plan."""
    return lambda model, world, cfg: parallelize_decoder(model, world, cfg, block_tp_plan, high_precision)


def experts_by_rows(experts: list[nn.Module], shards: int, ep: int, mode: str) -> frozenset:
    """The stacked expert parameters [E, rows, ...] FSDP splits along their rows over `shards` ranks
    (parallelism.expert_fsdp_shard): all of them ("rows"), none ("experts"), or ("auto") those whose E / ep local
    experts do not divide by `shards` (whole experts would be padded) while their rows do."""
    params = [p for module in experts for p in module.parameters()]
    if mode == "experts" or shards == 1:
        return frozenset()
    if mode == "rows":
        return frozenset(params)
    return frozenset(p for p in params if (p.shape[0] // ep) % shards and p.shape[1] % shards == 0)
