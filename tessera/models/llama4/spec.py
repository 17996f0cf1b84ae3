"""Llama 4's torch side: its decoder and its plan (parallelize.py)."""

from tessera.models.contract import ModelSpec
from tessera.models.llama4.model import Llama4
from tessera.models.llama4.parallelize import parallelize

SPEC = ModelSpec(model=Llama4, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
