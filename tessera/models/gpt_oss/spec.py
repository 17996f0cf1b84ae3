"""GPT-OSS's torch side: its decoder and its plan (parallelize.py)."""

from tessera.models.contract import ModelSpec
from tessera.models.gpt_oss.model import GptOss
from tessera.models.gpt_oss.parallelize import parallelize

SPEC = ModelSpec(model=GptOss, parallelize=parallelize, first_stage=("tok_embeddings",),
                 last_stage=("norm", "output"))
