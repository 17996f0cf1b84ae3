"""Qwen 3 MoE's parallelism plan: the shared one. Under TP the attention is Qwen 3's (per-head q/k norms); a MoE
layer keeps each rank's sequence slice (its experts are split by EP, not TP), a dense-first block's SwiGLU is
split as in the dense models."""

from tessera.models.common.plan import QK_NORM_BLOCK_TP_PLAN, decoder_plan
from tessera.models.qwen3.moe import FAMILY

parallelize = decoder_plan(QK_NORM_BLOCK_TP_PLAN, FAMILY.high_precision)
