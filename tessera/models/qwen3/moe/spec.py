"""Qwen 3 MoE's torch side: the shared decoder with MoE blocks, and its plan (parallelize.py)."""

from tessera.models.common.decoder import Decoder
from tessera.models.contract import ModelSpec
from tessera.models.qwen3.moe.parallelize import parallelize

SPEC = ModelSpec(model=Decoder, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
