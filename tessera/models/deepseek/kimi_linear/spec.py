"""Kimi Linear's torch side: its hybrid decoder and its plan."""

from tessera.models.contract import ModelSpec
from tessera.models.deepseek.kimi_linear.model import KimiLinear
from tessera.models.deepseek.kimi_linear.parallelize import parallelize

SPEC = ModelSpec(model=KimiLinear, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
