"""Qwen 3's parallelism plan: the shared decoder's, with its per-head q/k norms (models/common/plan.py)."""

from tessera.models.common.plan import QK_NORM_BLOCK_TP_PLAN, decoder_plan
from tessera.models.qwen3.dense import FAMILY

parallelize = decoder_plan(QK_NORM_BLOCK_TP_PLAN, FAMILY.high_precision)
