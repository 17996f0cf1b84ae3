"""DeepSeek V4's torch side: its decoder and its plan."""

from tessera.models.contract import ModelSpec
from tessera.models.deepseek.v4.model import DeepSeekV4
from tessera.models.deepseek.v4.parallelize import parallelize

SPEC = ModelSpec(model=DeepSeekV4, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "hc_head", "output", "mtp"))
