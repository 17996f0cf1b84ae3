"""Qwen3-Next's parallelism plan: Qwen 3.5's (tessera/models/qwen3_5/plan.py), its MoE blocks as Qwen 3.5 MoE's and
its dense blocks as Qwen 3.5's."""

from tessera.models.qwen3_5.next import FAMILY
from tessera.models.qwen3_5.plan import plan

parallelize = plan("qwen3_next", FAMILY.high_precision)
