"""DeepSeek V3's torch side: the MLA decoder, and its plan (the shared decoder's; TP is refused at launch
by the family's layout check until MLA has a plan of its own; CP swaps its kernel, keeping MLA's score scale)."""

from torch import nn

from tessera.config import JobConfig
from tessera.distributed import World
from tessera.models.common.plan import parallelize_decoder
from tessera.models.contract import ModelSpec
from tessera.models.deepseek_v3 import FAMILY
from tessera.models.deepseek_v3.model import DeepSeekV3


def parallelize(model: nn.Module, world: World, cfg: JobConfig) -> nn.Module:
    return parallelize_decoder(model, world, cfg, {}, FAMILY.high_precision)


SPEC = ModelSpec(model=DeepSeekV3, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
