"""Qwen 3.5's parallelism plan (dense and MoE): the shared decoder's. Under TP a full-attention block is Qwen 3's
(column-wise q with its gate, k, v, row-wise o, per-head q/k norms) and a DeltaNet block splits its heads the same
way: its in-projections column-wise, its per-head parameters (convolution taps, decay) by head, its gated norm (over
each head's values) like the q/k norms, its out-projection row-wise. Context parallelism: Ulysses only
(tessera.parallel.cp.UlyssesHeads splits DeltaNet's heads over CP as attention's; all-gather CP is refused before
launch by the family's check, tessera.models.qwen3_5.options.check)."""

from torch.distributed.tensor.parallel import SequenceParallel

from tessera.models.common.deltanet import GatedDeltaNet
from tessera.models.common.plan import QK_NORM_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.qwen3_5.options import apply_options, state_passing
from tessera.parallel.tp import ShardedByHead, attention_plan

_NORMS = ("attention_norm", "ffn_norm")
LINEAR_TP_PLAN = {**attention_plan("attention", ("wq", "wk", "wv", "wz", "wb", "wa"), "wo", _NORMS),
                  "attention.heads": ShardedByHead(),
                  "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True)}


def block_plan(block) -> dict:
    return LINEAR_TP_PLAN if isinstance(block.attention, GatedDeltaNet) else QK_NORM_BLOCK_TP_PLAN


def plan(section: str, high_precision: tuple[str, ...]):
    """A family's `parallelize` (model, world, cfg) -> model; its options from the config section `section`."""
    def parallelize(model, world, cfg):
        apply_options(model, getattr(cfg, section), world.device, world.rank == 0,
                      state_passing=state_passing(world, cfg))
        return parallelize_decoder(model, world, cfg, block_plan, high_precision)
    return parallelize
