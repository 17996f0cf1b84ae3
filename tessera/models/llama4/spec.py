"""Llama 4's torch side: its decoder and the shared plan. Under TP the attention is split by heads as Llama's
(the L2 q/k norm has no weight, the temperature is one number per position), a dense layer's SwiGLU column- and
row-wise, a MoE layer keeps each rank's sequence slice; CP's kernel takes the chunks of the one it replaces (none
on NoPE layers), and each rank's position table its tokens' global positions."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.llama4 import FAMILY
from tessera.models.llama4.model import Llama4


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, DECODER_BLOCK_TP_PLAN, FAMILY.high_precision)


SPEC = ModelSpec(model=Llama4, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
