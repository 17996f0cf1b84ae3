"""Llama 3's parallelism plan: the shared decoder's."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.llama3 import FAMILY


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, DECODER_BLOCK_TP_PLAN, FAMILY.high_precision)
