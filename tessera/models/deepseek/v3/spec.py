"""DeepSeek V3's torch side: the MLA decoder and its plan (parallelize.py)."""

from tessera.models.contract import ModelSpec
from tessera.models.deepseek.v3.model import DeepSeekV3
from tessera.models.deepseek.v3.options import begin_step
from tessera.models.deepseek.v3.parallelize import parallelize

SPEC = ModelSpec(model=DeepSeekV3, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output", "mtp"), begin_step=begin_step)
