"""Qwen 3.5 MoE's parallelism plan: Qwen 3.5's (tessera/models/qwen3_5/plan.py); the MoE layers keep each
rank's sequence slice under TP and split their experts by EP, their router and gated shared expert sharded like
the shared decoder's."""

from tessera.models.qwen3_5.moe import FAMILY
from tessera.models.qwen3_5.plan import plan

parallelize = plan("qwen3_5_moe", FAMILY.high_precision)
