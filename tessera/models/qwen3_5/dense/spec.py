"""Qwen 3.5 dense's torch side: the hybrid decoder and its parallelism plan."""

from tessera.models.contract import ModelSpec
from tessera.models.qwen3_5.dense.parallelize import parallelize
from tessera.models.qwen3_5.model import Qwen35

SPEC = ModelSpec(model=Qwen35, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
