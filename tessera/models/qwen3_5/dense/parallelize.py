"""Qwen 3.5 dense's parallelism plan: tessera/models/qwen3_5/plan.py, its options from [qwen3_5]."""

from tessera.models.qwen3_5.dense import FAMILY
from tessera.models.qwen3_5.plan import plan

parallelize = plan("qwen3_5", FAMILY.high_precision)
