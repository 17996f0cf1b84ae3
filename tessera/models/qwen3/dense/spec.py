"""Qwen 3's torch side: the shared decoder (with q/k norms), and its parallelism plan."""

from tessera.models.common.decoder import Decoder
from tessera.models.contract import ModelSpec
from tessera.models.qwen3.dense.parallelize import parallelize

SPEC = ModelSpec(model=Decoder, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
