"""Qwen3-Next's torch side: Qwen 3.5's hybrid decoder, MoE or dense FFN per block, and its plan."""

from tessera.models.contract import ModelSpec
from tessera.models.qwen3_5.model import Qwen35
from tessera.models.qwen3_5.next.parallelize import parallelize

SPEC = ModelSpec(model=Qwen35, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
