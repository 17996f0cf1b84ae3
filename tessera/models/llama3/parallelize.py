"""Llama 3's parallelism plan: the shared decoder's."""

from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, decoder_plan
from tessera.models.llama3 import FAMILY

parallelize = decoder_plan(DECODER_BLOCK_TP_PLAN, FAMILY.high_precision)
