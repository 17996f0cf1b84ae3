"""Qwen 3.5 MoE's torch side: the hybrid decoder with MoE blocks, and its plan."""

from tessera.models.contract import ModelSpec
from tessera.models.qwen3_5.model import Qwen35
from tessera.models.qwen3_5.moe.parallelize import parallelize

SPEC = ModelSpec(model=Qwen35, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
