"""Qwen 3 MoE's torch side: the shared decoder with MoE blocks and the shared plan (FSDP shards the stacked
experts along the expert dimension; TP, PP and CP wait for expert parallelism, #12)."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.decoder import Decoder
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.qwen3_moe import FAMILY


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, DECODER_BLOCK_TP_PLAN, FAMILY.high_precision)


SPEC = ModelSpec(model=Decoder, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
