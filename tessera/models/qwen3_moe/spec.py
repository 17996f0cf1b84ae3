"""Qwen 3 MoE's torch side: the shared decoder with MoE blocks and the shared plan. Under TP the attention is
Qwen 3's; a MoE layer keeps each rank's sequence slice (its experts are split by EP, not TP), a dense-first
block's SwiGLU is split as in the dense models."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.decoder import Decoder
from tessera.models.common.plan import parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.qwen3.parallelize import BLOCK_TP_PLAN
from tessera.models.qwen3_moe import FAMILY


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, BLOCK_TP_PLAN, FAMILY.high_precision)


SPEC = ModelSpec(model=Decoder, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
