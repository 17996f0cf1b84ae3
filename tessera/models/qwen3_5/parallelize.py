"""Qwen 3.5 dense's parallelism plan: tessera/models/common/qwen3_5_plan.py, its options from [qwen3_5]."""

from tessera.models.common.qwen3_5_plan import plan
from tessera.models.qwen3_5 import FAMILY

parallelize = plan("qwen3_5", FAMILY.high_precision)
