"""Qwen 3's parallelism plan: the shared decoder's. Under TP each rank holds some heads, and the q/k norms
(over head_dim) run on them as a sequence-parallel style over the heads dimension, so their weights'
gradients are summed over TP ranks."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.qwen3 import FAMILY

BLOCK_TP_PLAN = {**DECODER_BLOCK_TP_PLAN, **{f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                                   for n in ("q_norm", "k_norm")}}


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, BLOCK_TP_PLAN, FAMILY.high_precision)
