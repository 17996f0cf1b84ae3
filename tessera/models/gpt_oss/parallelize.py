"""GPT-OSS's parallelism plan: the shared one. Under TP each rank keeps its heads' sinks (q/k/v biases split with
their column-wise projections, o's added once after the row-wise sum); CP's kernel takes the windows and the sinks
of the kernel it replaces."""

from tessera.models.common.plan import DECODER_BLOCK_TP_PLAN, decoder_plan
from tessera.models.gpt_oss import FAMILY
from tessera.parallel.tp import ShardedByHead

BLOCK_TP_PLAN = {**DECODER_BLOCK_TP_PLAN, "attention.sdpa": ShardedByHead()}

parallelize = decoder_plan(BLOCK_TP_PLAN, FAMILY.high_precision)
