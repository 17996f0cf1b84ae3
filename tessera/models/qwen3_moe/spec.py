"""Qwen 3 MoE's torch side: the shared decoder with MoE blocks and the shared plan. Under TP the attention is
Qwen 3's; the MoE layer keeps each rank's sequence slice (its experts are split by EP, not TP)."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.decoder import Decoder
from tessera.models.common.plan import parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.qwen3.parallelize import BLOCK_TP_PLAN as QWEN3_BLOCK_TP_PLAN
from tessera.models.qwen3_moe import FAMILY
from tessera.parallel.tp import local_tokens

BLOCK_TP_PLAN = {**{k: v for k, v in QWEN3_BLOCK_TP_PLAN.items() if not k.startswith("feed_forward")},
                 **local_tokens("feed_forward")}


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, BLOCK_TP_PLAN, FAMILY.high_precision)


SPEC = ModelSpec(model=Decoder, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
