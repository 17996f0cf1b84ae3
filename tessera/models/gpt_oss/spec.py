"""GPT-OSS's torch side: its decoder and the shared plan. Under TP each rank keeps its heads' sinks (q/k/v
biases split with their column-wise projections, o's added once after the row-wise sum); CP's kernel takes the
windows and the sinks of the kernel it replaces."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.gpt_oss import FAMILY
from tessera.models.gpt_oss.model import GptOss
from tessera.parallel.tp import ShardedByHead

BLOCK_TP_PLAN = {**DECODER_BLOCK_TP_PLAN, "attention.sdpa": ShardedByHead()}


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, BLOCK_TP_PLAN, FAMILY.high_precision)


SPEC = ModelSpec(model=GptOss, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
