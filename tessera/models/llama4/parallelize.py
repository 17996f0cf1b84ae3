"""Llama 4's parallelism plan: the shared one. Under TP the attention is split by heads as Llama's (the L2 q/k norm
has no weight, the temperature is one number per position), a dense layer's SwiGLU column- and row-wise, a MoE
layer keeps each rank's sequence slice; CP's kernel takes the chunks of the one it replaces (none on NoPE layers),
and each rank's position table its tokens' global positions."""

from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, decoder_plan
from tessera.models.llama4 import FAMILY

parallelize = decoder_plan(DECODER_BLOCK_TP_PLAN, FAMILY.high_precision)
